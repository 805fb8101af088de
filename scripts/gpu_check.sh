#!/usr/bin/env bash
# The prepared GPU check (issue 23, part 1), for the device machine:
#   run(command="bash scripts/gpu_check.sh", timeout_s=480)
# It needs no Ray: torch with CUDA, safetensors, pyarrow, pyyaml, numpy and xxhash, which the
# device image has, and pydantic (ray_resume.config validates with it), not yet seen there.
# Results: $OUT/gpu_check.json and one line per part.
# On CPU (a dry run): bash scripts/gpu_check.sh --device cpu
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-out-XXXX)}
WORK=${WORK:-$(mktemp -d /tmp/gpu-check-work-XXXX)}
trap 'rm -rf "$WORK"' EXIT
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
PY=${PYTHON:-$(command -v python3 || command -v python)}
"$PY" -c "import torch, safetensors, pyarrow, yaml, pydantic, numpy, xxhash; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
"$PY" scripts/gpu_check.py --out "$OUT" --work "$WORK" "$@"
