"""Parquet input against in-memory synthetic data: the same ray-ddp run, fed two ways.

Runs on the machine it measures; each arm is a `python -m ray_ddp train` subprocess.
`ray-ddp data synth` first writes a parquet set of --rows rows (in --files files) with
the synthetic task's shape; the arms then train the same MLP with the same batch:
  synthetic  rows generated on the worker each step (the default --data synthetic)
  parquet    --data <the set>: every rank reads the table, then indexes it each step
  stream     --data <the set> --stream: every rank reads its part row group by row group
Steady samples/s is all workers' samples from the end of epoch 1 to the end of the last
epoch over rank 0's wall time for them (its metrics rows), so reading the files (before
the first step) is not in it; the arms' wall times are shown too.

    python benchmarks/data_throughput.py
The figures also go to benchmarks/results/data_throughput-<machine>-<date>.json
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
import time


def train_command(args, storage: str, data: str | None, stream: bool = False) -> list[str]:
    steps = -(-args.rows // (2 * args.batch_size))  # one pass over the rows, 2 workers
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--model", "mlp", "--width", str(args.width),
           "--depth", str(args.depth), "--batch-size", str(args.batch_size), "--optimizer", "sgd",
           "--epochs", str(args.epochs), "--workers", "2", "--report-every", str(steps),
           "--storage", storage, "--name", "run", "--quiet", "--json"]
    if data is not None:  # the data sets the dims and the steps per epoch
        return cmd + ["--data", data] + (["--stream"] if stream else [])
    return cmd + ["--input-dim", str(args.features), "--output-dim", str(args.targets),
                  "--steps-per-epoch", str(steps)]


def run_arm(name: str, args, data: str | None) -> dict:
    import pyarrow.parquet as pq

    storage = tempfile.mkdtemp(prefix="bench_data_")
    started = time.time()
    proc = subprocess.run(train_command(args, storage, data, stream=name == "stream"),
                          capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        shutil.rmtree(storage, ignore_errors=True)
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [r for r in pq.read_table(os.path.join(storage, "run", "metrics.parquet")).to_pylist()
            if r["rank"] == 0]
    shutil.rmtree(storage, ignore_errors=True)
    rows.sort(key=lambda r: r["step"])
    first_epoch_end = max((r for r in rows if r["epoch"] == 1), key=lambda r: r["step"])
    samples = sum(r["samples"] for r in rows if r["step"] > first_epoch_end["step"]) * summary["world_size"]
    return {"arm": name, "samples_per_s": samples / (rows[-1]["time"] - first_epoch_end["time"]), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--targets", type=int, default=16)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row-group-rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, paired_arms, save_result

    add_result_args(parser)
    args = parser.parse_args()
    data = os.path.join(tempfile.mkdtemp(prefix="bench_parquet_"), "set")
    subprocess.run([sys.executable, "-m", "ray_ddp", "data", "synth", "--rows", str(args.rows),
                    "--features", str(args.features), "--targets", str(args.targets), "--files",
                    str(args.files), "--row-group-rows", str(args.row_group_rows), "--out", data],
                   check=True, capture_output=True)
    arms = {"synthetic": None, "parquet": data, "stream": data}
    results = []
    try:
        for round_no in range(args.rounds):
            shift = round_no % len(arms)  # rotate the order: no arm always runs first
            order = list(arms)[shift:] + list(arms)[:shift]
            for name in order:
                r = run_arm(name, args, arms[name])
                results.append({**r, "round": round_no})
                print(f"round {round_no + 1}/{args.rounds} {name}: {r['samples_per_s']:.0f} samples/s, "
                      f"wall {r['wall_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    median = {n: statistics.median(r["samples_per_s"] for r in results if r["arm"] == n) for n in arms}
    wall = {n: statistics.median(r["wall_s"] for r in results if r["arm"] == n) for n in arms}
    print(f"\n{args.rows} rows x {args.features} features -> {args.targets} targets in {args.files} parquet "
          f"files; MLP {args.depth} x {args.width}, 2 workers x batch {args.batch_size}, {args.epochs} epochs, "
          f"{os.cpu_count()} CPUs")
    print("| data | steady samples/s | x synthetic | wall s |\n|---|---|---|---|")
    for name in arms:
        print(f"| {name} | {median[name]:.0f} | {median[name] / median['synthetic']:.3f} | {wall[name]:.1f} |")
    # paired: each arm's samples/s over the synthetic run's in the same round
    per_round, rows = paired_arms(results, list(arms), "synthetic", args.rounds)
    save_result(args, "data_throughput", {
        "setup": f"{args.rows} rows x {args.features} features -> {args.targets} targets in {args.files} "
                 f"parquet files; MLP {args.depth} x {args.width}, 2 workers x batch {args.batch_size}, "
                 f"{args.epochs} epochs, {os.cpu_count()} CPUs",
        "baseline": "synthetic", "paired_rounds": args.rounds, "arms": rows,
    }, per_round)


if __name__ == "__main__":
    main()
