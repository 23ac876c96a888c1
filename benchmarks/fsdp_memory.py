"""DDP against FSDP on the same model and batches: peak memory per rank and samples/s.

The model is an mlp whose weights and AdamW state dominate memory (the default is 30M
parameters: 120 MB of weights, and with gradients and AdamW's two moments about 480 MB
of training state, which DDP holds whole on every rank and FSDP splits across them).
Each arm is a `python -m ray_ddp train` subprocess; the rounds alternate the arms.

- peak memory: the largest ``max_rss_mb`` of any rank in the metrics (a process's peak
  resident memory; on a GPU, use ``gpu_max_mb`` the same way: ``--gpus-per-worker 1``);
- samples/s: all ranks' samples after the first metrics window over rank 0's wall time
  for them, the median over the rounds.

    python benchmarks/fsdp_memory.py                     # the README's figures
    python benchmarks/fsdp_memory.py --width 512 --depth 2 --rounds 1   # seconds (CI)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ARMS = ("ddp", "fsdp")


def run_arm(strategy: str, args) -> dict:
    import pyarrow.parquet as pq

    storage = tempfile.mkdtemp(prefix="bench_fsdp_")
    steps = args.steps
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--strategy", strategy, "--model", "mlp",
           "--width", str(args.width), "--depth", str(args.depth), "--input-dim", "256",
           "--output-dim", "16", "--batch-size", str(args.batch_size), "--optimizer", "adamw",
           "--lr", "1e-4", "--epochs", "1", "--steps-per-epoch", str(steps),
           "--report-every", str(max(1, steps // 3)), "--workers", str(args.workers),
           "--gpus-per-worker", str(args.gpus_per_worker), "--skip-final-model",
           "--storage", storage, "--name", "run", "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{strategy} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = pq.read_table(os.path.join(storage, "run", "metrics.parquet")).to_pylist()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    memory_key = "gpu_max_mb" if args.gpus_per_worker else "max_rss_mb"
    first = min(r["step"] for r in rows)
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    later = [r for r in rows if r["step"] > first]
    seconds = rank0[-1]["time"] - rank0[0]["time"]
    return {"peak_mb": max(r[memory_key] for r in rows),
            "samples_per_s": sum(r["samples"] for r in later) / seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    params = 256 * args.width + (args.depth - 1) * args.width ** 2 + args.width * 16
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            results[arm].append(run_arm(arm, args))
    where = f"{args.gpus_per_worker} GPU" if args.gpus_per_worker else "CPU"
    print(f"mlp {params / 1e6:.1f}M parameters, AdamW, {args.workers} workers ({where}), batch "
          f"{args.batch_size} per worker, median of {args.rounds} round(s)")
    print("| strategy | peak memory per rank (MB) | samples/s |")
    print("|---|---|---|")
    peaks = {}
    for arm in ARMS:
        peaks[arm] = statistics.median(r["peak_mb"] for r in results[arm])
        rate = statistics.median(r["samples_per_s"] for r in results[arm])
        print(f"| {arm} | {peaks[arm]:,.0f} | {rate:,.0f} |")
    print(f"FSDP's peak is {peaks['fsdp'] / peaks['ddp']:.2f} x DDP's "
          f"({peaks['ddp'] - peaks['fsdp']:,.0f} MB less per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
