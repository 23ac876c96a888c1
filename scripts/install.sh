#!/usr/bin/env bash
# Install ray_ddp and its test tools into ./.venv (created if missing). Safe to rerun.
# torch is pinned and installed FIRST: left to the resolver, a bare `torch` requirement
# can pull a multi-GB CUDA build onto a machine that has no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/python -c "import torch, ray, ray_ddp; print(f'installed ray_ddp {ray_ddp.__version__}: torch {torch.__version__}, ray {ray.__version__}')"
