#!/usr/bin/env bash
# Create .venv and install ray_resume with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# On a machine without an NVIDIA GPU take the CPU build of torch first; a bare
# "torch" requirement would pull a multi-GB CUDA build.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q torch==2.13.0
fi
.venv/bin/python -m pip install -q -e '.[test]'
echo "ray_resume installed in $(pwd)/.venv"
