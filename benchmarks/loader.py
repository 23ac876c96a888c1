"""--loader-workers against torchrun's DistributedSampler + DataLoader(num_workers=N), on an
I/O-bound Dataset (every item waits, as a read from network storage does:
benchmarks/slow_reads.py). One machine, one run, paired rounds.

Arms (each trains the same MLP, 2 workers, one epoch of --warmup + --steps steps):
  torchrun            benchmarks/loader_workload.py under torchrun --standalone: the
                      user's usual code, DistributedSampler and DataLoader(num_workers=N,
                      persistent_workers=True) (the baseline)
  ray-ddp             python -m ray_ddp train --dataset slow_reads:slow_reads --loader-workers N
  ray-ddp-in-thread   the same with --loader-workers 0: items read in the training thread
                      (what ray-ddp did before; not a default arm)

  steady samples/s    both workers' samples of the timed steps / rank 0's time for them
                      (from the end of step --warmup to the end of the last step)
  paired              each round's samples/s over torchrun's in the same round; the table
                      gives the median and every round's

    python benchmarks/loader.py                    # the recorded result
    python benchmarks/loader.py --arms torchrun,ray-ddp,ray-ddp-in-thread --rounds 1
The figures also go to benchmarks/results/loader-<machine>-<date>.json (--results-dir,
--no-save), from which docs/performance.md is rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _results import add_result_args, paired_arms, save_result  # noqa: E402

ARMS = ("torchrun", "ray-ddp", "ray-ddp-in-thread")


def arm_command(arm: str, args, out: str) -> list[str]:
    py = sys.executable
    model = ["--width", str(args.width), "--depth", str(args.depth), "--batch-size", str(args.batch_size),
             "--lr", "0.01"]
    if arm == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                os.path.join(HERE, "loader_workload.py"), *model, "--loader-workers", str(args.loader_workers),
                "--warmup", str(args.warmup), "--out", out]
    workers = args.loader_workers if arm == "ray-ddp" else 0
    return [py, "-m", "ray_ddp", "train", "--model", "mlp", "--dataset", "slow_reads:slow_reads", *model,
            "--optimizer", "sgd", "--loader-workers", str(workers), "--workers", "2", "--epochs", "1",
            "--report-every", str(args.warmup), "--storage", out, "--name", "run", "--quiet", "--json"]


def run_arm(arm: str, args) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench_loader_{arm}_")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
           "SLOW_READS_ROWS": str(2 * args.batch_size * (args.warmup + args.steps)),
           "SLOW_READS_WAIT_MS": str(args.wait_ms), "SLOW_READS_DIM": str(args.dim)}
    launched = time.time()
    proc = subprocess.run(arm_command(arm, args, out), env=env, capture_output=True, text=True)
    wall = time.time() - launched
    try:
        if proc.returncode != 0:
            raise SystemExit(f"{arm} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        if arm == "torchrun":
            timing = json.load(open(os.path.join(out, "rank_0.json")))
            warm_at, end_at = timing["warm_at"], timing["end_at"]
        else:
            import pyarrow.parquet as pq

            rows = [r for r in pq.read_table(os.path.join(out, "run", "metrics.parquet")).to_pylist()
                    if r["rank"] == 0]
            at = {r["step"]: r["time"] for r in rows}
            warm_at, end_at = at[args.warmup], at[args.warmup + args.steps]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"arm": arm, "samples_per_s": 2 * args.batch_size * args.steps / (end_at - warm_at), "wall_s": wall}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default="torchrun,ray-ddp", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--loader-workers", type=int, default=4, help="DataLoader processes per worker")
    parser.add_argument("--wait-ms", type=float, default=2.0, help="each item's read, in milliseconds")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per worker per step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="timed steps (a multiple of --warmup)")
    parser.add_argument("--rounds", type=int, default=3)
    add_result_args(parser)
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if "torchrun" not in arms or any(a not in ARMS for a in arms) or args.steps % args.warmup:
        parser.error(f"--arms must name torchrun and only {', '.join(ARMS)}; --steps a multiple of --warmup")
    results = []
    for round_no in range(args.rounds):
        shift = round_no % len(arms)  # rotate the order: no arm always runs first
        for arm in arms[shift:] + arms[:shift]:
            r = {**run_arm(arm, args), "round": round_no}
            results.append(r)
            print(f"round {round_no + 1}/{args.rounds} {arm}: {r['samples_per_s']:.0f} samples/s, "
                  f"wall {r['wall_s']:.1f} s", flush=True)
    per_round, rows = paired_arms(results, arms, "torchrun", args.rounds)
    setup = (f"{args.wait_ms:g} ms per item, {args.loader_workers} loader processes per worker, 2 workers x "
             f"batch {args.batch_size}, MLP {args.depth} x {args.width}, {args.warmup} + {args.steps} steps, "
             f"{os.cpu_count()} CPUs")
    print(f"\n{setup}\n| arm | steady samples/s | x torchrun | paired | paired per round |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['samples_per_s']:.0f} | {row['x_baseline']:.3f} | {row['paired_ratio']:.3f} | "
              f"{', '.join(f'{p:.3f}' for p in row['paired_ratio_all'])} |")
    save_result(args, "loader", {"setup": setup, "baseline": "torchrun", "paired_rounds": args.rounds,
                                 "arms": rows}, per_round)


if __name__ == "__main__":
    main()
