#!/usr/bin/env bash
# Issue 19's GPU checks on one machine (docs/RELIABILITY.md, "GPU findings"): one line
# per check ("GPU-CHECK <name>: PASS|SKIP|FAIL ..."), bounded to 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
timeout 600 "$PY" -m pytest -m gpu tests/gpu/test_issue19_gpu.py -q -s -p no:cacheprovider \
    2>&1 | tee "${OUT:-/tmp}/issue19_gpu.log" | grep -E "^GPU-CHECK|passed|failed|skipped|error" \
    || true
grep -q "^GPU-CHECK" "${OUT:-/tmp}/issue19_gpu.log"
