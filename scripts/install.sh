#!/usr/bin/env bash
# Install ray_ddp and its test tools into ./.venv (or $VENV; created if missing). Safe to rerun.
# torch is pinned and installed FIRST: left to the resolver, a bare `torch` requirement
# can pull a multi-GB CUDA build onto a machine that has no GPU.
# pip installs without compiling. Where PYTHONDONTWRITEBYTECODE is set, nothing would ever
# cache a module's bytecode, so compileall compiles the venv here, on every core at once
# (pip would compile its ~24,000 files one by one: benchmarks/install_time.py,
# docs/testing.md). Where it is not set, Python caches each module the first time any
# process imports it: about 4,000 files for torch, Ray Train, transformers and the rest,
# so compiling all 24,000 up front would cost more than it saves.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-compile "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install --quiet --no-compile -e ".[test]"
# -j 0: one process per core; a file some package ships that does not compile (test data,
# Python 2 examples) is one that is never imported, so its error is no reason to stop
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
    # ray_ddp itself is installed editable (its source, never compiled by pip), and every Ray
    # worker, controller and command imports ~110 of its modules: compiled once here, each
    # such process loads them in ~0.04 s of CPU instead of ~0.15 (where PYTHONDONTWRITEBYTECODE
    # is set, nothing else would ever write them). An edited module is recompiled as usual.
    "$VENV/bin/python" -m compileall -q -j 0 ray_ddp tests/helpers >/dev/null
fi
# the check imports what every training worker imports: where bytecode is cached on first
# import, it is cached here once, not by the first processes of a run all at the same time
"$VENV/bin/python" -c "import torch, torch._dynamo, ray, ray.train.torch, ray_ddp, ray_ddp.worker.loop; print(f'installed ray_ddp {ray_ddp.__version__}: torch {torch.__version__}, ray {ray.__version__}')"
