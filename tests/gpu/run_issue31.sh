#!/usr/bin/env bash
# Issue 31's GPU checks (NIXL VRAM -> VRAM and DRAM -> VRAM): one line per check
# ("GPU-CHECK nixl_<name>: PASS|FAIL ..."), bounded to 5 minutes. Needs nixl-cu12.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}"
timeout 300 "$PY" -m pytest -m gpu tests/gpu/test_nixl_gpu.py -q -s -p no:cacheprovider \
    2>&1 | tee "${OUT:-/tmp}/issue31_gpu.log" | grep -E "^GPU-CHECK|passed|failed|skipped|error" \
    || true
grep -q "^GPU-CHECK" "${OUT:-/tmp}/issue31_gpu.log"
