#!/usr/bin/env bash
# Where the CPU goes during a ray-ddp run: CPU ticks (1/100 s) each Ray process used over
# 10 s of steady training, largest first, then the totals. The training workers show as
# ray::RayTrainWorker; everything else is Ray's own cost on the same cores.
#   bash benchmarks/ray_cpu.sh              (from the repository root, after scripts/install.sh)
#   WORKERS=1 bash benchmarks/ray_cpu.sh    (one worker running a torch thread per core)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
WORKERS=${WORKERS:-2}
storage=$(mktemp -d)
"$PY" -m ray_ddp train --model mlp --width 1024 --depth 4 --input-dim 256 --output-dim 16 \
  --batch-size 64 --epochs 1 --steps-per-epoch 3000 --workers "$WORKERS" --storage "$storage" \
  --name cpu --quiet > /dev/null 2>&1 &
run=$!
sleep 35  # past Ray's start and the first steps
pids=$(pgrep -f "ray::|raylet|gcs_server|dashboard|runtime_env|log_monitor|monitor.py" || true)
declare -A before
for p in $pids; do before[$p]=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0); done
sleep 10
for p in $pids; do
  after=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null) || continue
  echo "$(( after - ${before[$p]:-0} )) $(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-70)"
done | sort -rn | awk -v cores="$(nproc)" '
  { print; if ($2 == "ray::RayTrainWorker") train += $1; else other += $1; n += ($2 != "ray::RayTrainWorker") }
  END { printf "training workers %d ticks, Ray'"'"'s other %d processes %d ticks, of %d (%d cores x 10 s)\n",
        train, n, other, cores * 1000, cores }'
wait "$run"
rm -rf "$storage"
