#!/usr/bin/env bash
# Create .venv and install ray_resume. `--test`: with what the test suite needs besides, MindSpore
# Transformers' own checkpoint code among it (~1 GB more). Safe to run again.
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
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test,mindformers]'
  # MindFormers' own code for the format tests: --no-deps, since it declares packages PyPI does not
  # have (pyproject.toml, the mindformers extra); its checkpoint modules need only what that extra installs.
  .venv/bin/python -m pip install -q --no-deps mindformers==2.1.0
else
  .venv/bin/python -m pip install -q -e .
fi
echo "ray_resume installed in $(pwd)/.venv"
