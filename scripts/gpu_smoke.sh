#!/usr/bin/env bash
# Every GPU path in one go, for whoever has a GPU machine: the GPU tests, then a short
# throughput run of a transformer-sized mlp (bf16) with achieved TFLOP/s, under DDP and
# under FSDP, `ray-ddp doctor` (matmul TFLOP/s per GPU, NCCL bus bandwidth), and ray-ddp
# against torchrun (benchmarks/throughput.py --preset gpu). Under 8 minutes.
#   bash scripts/gpu_smoke.sh            (after bash scripts/install.sh on a CUDA machine)
# PY=python (default .venv/bin/python), OUT=DIR for the reports (default /tmp/ray_ddp_gpu_smoke),
# RUNS=DIR for the runs' folders (default OUT/runs).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-/tmp/ray_ddp_gpu_smoke}"
# the runs' folders (checkpoints, metrics) apart from the reports, which stay few and flat
RUNS="${RUNS:-$OUT/runs}"
mkdir -p "$OUT" "$RUNS"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('GPUs:', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])" || exit 1

"$PY" -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

WIDTH=4096 DEPTH=8 DIM=4096 BATCH=256 STEPS=200
"$PY" -m ray_ddp train --model mlp --width $WIDTH --depth $DEPTH --input-dim $DIM --output-dim $DIM \
    --batch-size $BATCH --amp bf16 --optimizer adamw --lr 1e-4 --gpus-per-worker 1 --workers 1 \
    --epochs 1 --steps-per-epoch $STEPS --report-every 50 --storage "$RUNS" \
    --name "mlp-$(date +%s)" --quiet --json > "$OUT/throughput.json"
train_rc=$?

# the same model and batches under FSDP2 (bf16 parameters, fp32 gradient reduction)
"$PY" -m ray_ddp train --strategy fsdp --model mlp --width $WIDTH --depth $DEPTH --input-dim $DIM \
    --output-dim $DIM --batch-size $BATCH --amp bf16 --optimizer adamw --lr 1e-4 --gpus-per-worker 1 \
    --workers 1 --epochs 1 --steps-per-epoch $STEPS --report-every 50 --storage "$RUNS" \
    --name "fsdp-$(date +%s)" --quiet --json > "$OUT/throughput_fsdp.json"
fsdp_rc=$?

for arm in ddp fsdp; do
  file="$OUT/throughput.json"; [ $arm = fsdp ] && file="$OUT/throughput_fsdp.json"
  "$PY" - "$file" $WIDTH $DEPTH $DIM $arm <<'PY'
import json, sys
try:
    summary = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    sys.exit(f"{sys.argv[5]}: no summary (the run failed)")
width, depth, dim = map(int, sys.argv[2:5])
params = dim * width + (depth - 1) * width * width + width * dim  # the Linear weights
tflops = 6 * params * summary["samples_per_s"] / 1e12  # forward + backward ~ 6 FLOP/param/sample
print(f"{sys.argv[5]}: mlp {params / 1e6:.0f}M params, bf16, 1 GPU: {summary['samples_per_s']:,.0f} "
      f"samples/s, {tflops:.1f} TFLOP/s achieved, final loss {summary['final_loss']:.4f}")
PY
done
# the doctor's view of this box (docs/commands.md#ray-ddp-doctor): each GPU's bf16 matmul
# TFLOP/s, NCCL's all-reduce bus bandwidth over every GPU, the disk's speed. Exit 1 only
# names a slow GPU: a figure, not a failure of the smoke; 2 or more is one.
"$PY" -m ray_ddp doctor --storage "$RUNS" --json > "$OUT/doctor.json"
doctor_rc=$?
# does ray-ddp cost anything on a GPU? the same kind of model under torchrun, side by side;
# its result file (throughput-<machine>-<date>.json) lands in OUT: copy it to benchmarks/results/
"$PY" benchmarks/throughput.py --preset gpu --rounds 1 --results-dir "$OUT" 2>&1 | tee "$OUT/vs_torchrun.txt" | tail -6
bench_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, throughput runs exit ddp $train_rc fsdp $fsdp_rc, vs torchrun exit $bench_rc, doctor exit $doctor_rc"
exit $(( tests_rc || train_rc || fsdp_rc || bench_rc || doctor_rc > 1 ))
