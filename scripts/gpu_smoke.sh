#!/usr/bin/env bash
# Every GPU path in one go, for whoever has a GPU machine: the GPU tests (among them the
# NCCL flight recorder's dump of a forced hang landing in <run>/hangs/), then a short
# throughput run of a transformer-sized mlp (bf16) with achieved TFLOP/s, under DDP and
# under FSDP, `ray-ddp doctor` (matmul TFLOP/s per GPU, NCCL bus bandwidth), ray-ddp
# against torchrun (benchmarks/throughput.py --preset gpu), an HF GPT-2 small on its own
# loss against torchrun (3 paired rounds), the built-in gpt at GPT-2-small shape in bf16
# with --compile (its mfu), and FSDP's start-up GPU memory of an HF Llama
# (benchmarks/fsdp_memory.py). Under 8 minutes; the result files land in OUT.
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
# an HF GPT-2 small (768 x 12) on its own loss: ray-ddp against a plain torchrun DDP loop,
# 3 paired rounds (result file gpt_tokens-<machine>-<date>.json in OUT)
"$PY" benchmarks/gpt_tokens.py --hf --gpus-per-worker 1 --workers 1 --width 768 --depth 12 --heads 12 \
    --seq-len 512 --vocab-size 50257 --batch-size 8 --warmup 10 --steps 20 --rounds 3 --results-dir "$OUT" \
    2>&1 | tee "$OUT/hf_gpt2_vs_torchrun.txt" | tail -6
hf_rc=${PIPESTATUS[0]}
# the built-in gpt at GPT-2-small shape, bf16, compiled: tokens/s and mfu from its metrics
"$PY" -m ray_ddp data synth --task lm --rows 4096 --seq-len 1024 --vocab-size 50304 --out "$RUNS/gpt_tokens_data" >/dev/null
"$PY" -m ray_ddp train --model gpt --task lm --data "$RUNS/gpt_tokens_data" --width 768 --depth 12 --heads 12 \
    --seq-len 1024 --vocab-size 50304 --batch-size 8 --amp bf16 --compile --optimizer adamw --lr 3e-4 \
    --gpus-per-worker 1 --workers 1 --epochs 1 --steps-per-epoch 120 --report-every 20 --storage "$RUNS" \
    --name "gpt-mfu-$(date +%s)" --quiet --json > "$OUT/gpt_mfu.json"
gpt_rc=$?
# FSDP's start-up and peak GPU memory (setup_gpu_max_mb, gpu_max_mb) of an HF Llama, against DDP
"$PY" benchmarks/fsdp_memory.py --model hf-llama --gpus-per-worker 1 --workers 1 --optimizer sgd --rounds 1 \
    --results-dir "$OUT" 2>&1 | tee "$OUT/fsdp_memory.txt" | tail -8
mem_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, throughput runs exit ddp $train_rc fsdp $fsdp_rc, vs torchrun exit $bench_rc, doctor exit $doctor_rc," \
     "hf gpt2 vs torchrun exit $hf_rc, gpt mfu exit $gpt_rc, fsdp memory exit $mem_rc"
exit $(( tests_rc || train_rc || fsdp_rc || bench_rc || doctor_rc > 1 || hf_rc || gpt_rc || mem_rc ))
