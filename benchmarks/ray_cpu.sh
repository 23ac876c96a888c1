#!/usr/bin/env bash
# Where the CPU goes during a 2-worker ray-ddp run: CPU ticks (1/100 s) each Ray process
# used over 10 s of steady training, largest first. The training workers show as
# ray::RayTrainWorker; everything else is Ray's own cost on the same cores.
#   bash benchmarks/ray_cpu.sh            (from the repository root, after scripts/install.sh)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
storage=$(mktemp -d)
"$PY" -m ray_ddp train --model mlp --width 1024 --depth 4 --input-dim 256 --output-dim 16 \
  --batch-size 64 --epochs 1 --steps-per-epoch 1500 --storage "$storage" --name cpu --quiet > /dev/null 2>&1 &
run=$!
sleep 35  # past Ray's start and the first steps
pids=$(pgrep -f "ray::|raylet|gcs_server|dashboard|runtime_env|log_monitor|monitor.py" || true)
declare -A before
for p in $pids; do before[$p]=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0); done
sleep 10
for p in $pids; do
  after=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null) || continue
  echo "$(( after - ${before[$p]:-0} )) $(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-70)"
done | sort -rn
wait "$run"
rm -rf "$storage"
