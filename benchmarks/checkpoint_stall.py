"""Does checkpointing stall training? ray-ddp with a checkpoint every epoch against the
same run with none, on a model of about 50M parameters, in one run.

Runs on the machine it measures; each arm is a `python -m ray_ddp train` subprocess.
Steady samples/s is all workers' samples from the end of epoch 1 to the end of the
last step, over rank 0's wall time for them (from its metrics rows). That stretch holds
the checkpoints of epochs 1 .. E-1 (the last one is written after the last row's
clock reads, in both arms alike). After each run the newest checkpoint is loaded
(``weights_only=True``) and checked against its meta.json, and in the checkpointing
arm every kept checkpoint is: complete and consistent, not only fast.

    python benchmarks/checkpoint_stall.py              # the README's figures
    python benchmarks/checkpoint_stall.py --rounds 1 --steps-per-epoch 5   # quicker
The figures also go to benchmarks/results/checkpoint_stall-<machine>-<date>.json
(--results-dir, --no-save; see benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ARMS = {"no checkpoints": ["--checkpoint-every", "1000000"], "checkpoint every epoch": ["--checkpoint-every", "1"]}


def run_arm(name: str, args) -> dict:
    import pyarrow.parquet as pq

    storage = tempfile.mkdtemp(prefix="bench_ckpt_")
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--model", "mlp", "--width", str(args.width),
           "--depth", str(args.depth), "--input-dim", "256", "--output-dim", "16",
           "--batch-size", str(args.batch_size), "--optimizer", "sgd", "--epochs", str(args.epochs),
           "--steps-per-epoch", str(args.steps_per_epoch), "--report-every", str(args.steps_per_epoch),
           "--workers", str(args.workers), "--keep", str(args.epochs), "--storage", storage,
           "--name", "run", "--quiet", "--json", *ARMS[name]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(storage, ignore_errors=True)
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    run_dir = os.path.join(storage, "run")
    rows = [r for r in pq.read_table(os.path.join(run_dir, "metrics.parquet")).to_pylist() if r["rank"] == 0]
    at = {r["step"]: r["time"] for r in rows}
    start, end = args.steps_per_epoch, args.epochs * args.steps_per_epoch
    samples = args.workers * args.batch_size * (end - start)
    checked = check_checkpoints(run_dir)
    shutil.rmtree(storage, ignore_errors=True)
    return {"arm": name, "samples_per_s": samples / (at[end] - at[start]), "checkpoints_checked": checked}


def check_checkpoints(run_dir: str) -> list[str]:
    """Every checkpoint left: its files match meta.json, and both load with weights_only."""
    import torch

    from ray_ddp.checkpoint.verify import verify_checkpoint

    names = sorted(n for n in os.listdir(run_dir) if n.startswith("step-"))
    for name in names:
        folder = os.path.join(run_dir, name)
        problem = verify_checkpoint(folder)
        if problem is not None:
            raise SystemExit(f"checkpoint {name} is not whole: {problem}")
        for file in ("model.pt", "train_state.pt"):
            torch.load(os.path.join(folder, file), weights_only=True, map_location="cpu")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=13, help="13 x 2048 wide: about 50M parameters")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write every round's raw figures here")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args()
    params = 256 * args.width + (args.depth - 1) * args.width**2 + args.width * 16 + args.depth * args.width + 16
    results = []
    for round_no in range(args.rounds):
        names = list(ARMS) if round_no % 2 == 0 else list(reversed(ARMS))
        for name in names:
            r = run_arm(name, args)
            results.append(r)
            print(f"round {round_no + 1}/{args.rounds} {name}: {r['samples_per_s']:.1f} samples/s; "
                  f"checkpoints whole and loadable: {', '.join(r['checkpoints_checked'])}", flush=True)
    median = {n: statistics.median(r["samples_per_s"] for r in results if r["arm"] == n) for n in ARMS}
    base = median["no checkpoints"]
    # paired: each round's checkpointing run against the run beside it (a noisy machine drifts)
    paired = [c["samples_per_s"] / n["samples_per_s"] for n, c in zip(results[0::2], results[1::2])]
    paired = [p if n["arm"] == "no checkpoints" else 1 / p for p, n in zip(paired, results[0::2])]
    print(f"\nMLP of {params / 1e6:.1f}M parameters, {args.workers} workers x batch {args.batch_size}, "
          f"{args.epochs} epochs x {args.steps_per_epoch} steps, {os.cpu_count()} CPUs")
    print("| arm | steady samples/s | x no checkpoints | paired (per round) |\n|---|---|---|---|")
    for name in ARMS:
        rounds = "" if name == "no checkpoints" else \
            f"{statistics.median(paired):.3f} ({', '.join(f'{p:.3f}' for p in paired)})"
        print(f"| {name} | {median[name]:.1f} | {median[name] / base:.3f} | {rounds} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "parameters": params, "rounds": results, "median": median}, f, indent=1)
    per_round = []
    for i, (first, second) in enumerate(zip(results[0::2], results[1::2])):
        per_round.append({"round": i + 1, "order": [first["arm"], second["arm"]],
                          "arms": {r["arm"]: {"samples_per_s": r["samples_per_s"],
                                              "checkpoints_checked": r["checkpoints_checked"]}
                                   for r in (first, second)},
                          "paired_ratio": paired[i]})
    save_result(args, "checkpoint_stall", {
        "setup": f"MLP of {params / 1e6:.1f}M parameters, {args.workers} workers x batch {args.batch_size}, "
                 f"{args.epochs} epochs x {args.steps_per_epoch} steps, {os.cpu_count()} CPUs",
        "parameters": params, "baseline": "no checkpoints", "paired_rounds": args.rounds,
        "samples_per_s": median, "ratio": median["checkpoint every epoch"] / base,
        "paired_ratio": statistics.median(paired), "paired_ratio_all": paired,
    }, per_round)


if __name__ == "__main__":
    main()
