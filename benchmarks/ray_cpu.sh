#!/usr/bin/env bash
# Where the CPU goes during a ray-ddp run: CPU ticks (1/100 s) each Ray process used over
# 10 s of steady training, largest first, then the totals. The training workers show as
# ray::RayTrainWorker; everything else is Ray's own cost on the same cores.
#   bash benchmarks/ray_cpu.sh              (from the repository root, after scripts/install.sh)
#   WORKERS=1 bash benchmarks/ray_cpu.sh    (one worker running a torch thread per core)
# The totals also go to benchmarks/results/ray_cpu-<machine>-<date>.json (through
# benchmarks/_results.py); --no-save writes none, --results-dir DIR writes there instead.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
WORKERS=${WORKERS:-2}
here=$(cd "$(dirname "$0")" && pwd)
save=1
results_dir="$here/results"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-save) save=0; shift ;;
    --results-dir) results_dir=$2; shift 2 ;;
    *) echo "usage: [WORKERS=N] bash benchmarks/ray_cpu.sh [--no-save] [--results-dir DIR]" >&2; exit 2 ;;
  esac
done
storage=$(mktemp -d)
totals="$storage/totals.json"
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
done | sort -rn | awk -v cores="$(nproc)" -v workers="$WORKERS" -v out="$totals" '
  { print; if ($2 == "ray::RayTrainWorker") train += $1; else other += $1; n += ($2 != "ray::RayTrainWorker") }
  END { printf "training workers %d ticks, Ray'"'"'s other %d processes %d ticks, of %d (%d cores x 10 s)\n",
        train, n, other, cores * 1000, cores
        printf "{\"setup\": \"ray-ddp train, mlp 256-1024x4-16, batch 64, %d worker(s), 10 s of steady training after 35 s\", \"workers\": %d, \"window_s\": 10, \"training_ticks\": %d, \"other_processes\": %d, \"other_ticks\": %d, \"available_ticks\": %d}\n",
        workers, workers, train, n, other, cores * 1000 > out }'
wait "$run"
if [ "$save" = 1 ]; then
  "$PY" "$here/_results.py" --bench ray_cpu --result-file "$totals" \
    --command "WORKERS=$WORKERS bash benchmarks/ray_cpu.sh" --results-dir "$results_dir"
fi
rm -rf "$storage"
