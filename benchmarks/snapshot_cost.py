"""What in-memory snapshots cost a run that never fails: steady samples/s with them off,
at the default cadence (by cost, at most 1 % of the time) and every step.

One job, three arms, on one local Ray that this script starts (loopback only), in paired
rounds rotating which goes first: ray_ddp.run with 2 CPU workers, an mlp (10 inputs, 2
hidden layers of --width, 5 outputs) under AdamW (its state: weights and two moments),
1 epoch of --steps steps of --batch-size rows per worker, a metrics window every 10 steps,
no step checkpoints; under --strategy ddp (one copy per node) or fsdp (every rank's own
shards, with an all-gather of their sizes and CRC-32s per snapshot):
  off          --snapshot-every-steps 0
  default      no --snapshot-every-steps (the cadence by cost)
  every-step   --snapshot-every-steps 1
The figure: the steady samples/s over every metrics window but the first (rank 0's rows of
metrics.parquet: rows over seconds of the windows, whose time includes the snapshots
taken in them), and each arm's paired ratio to off in the same round.

    python benchmarks/snapshot_cost.py --rounds 3
    python benchmarks/snapshot_cost.py --strategy fsdp --rounds 2 --steps 1000
The figures also go to benchmarks/results/snapshot_cost-<machine>-<date>.json
(--results-dir, --no-save; see benchmarks/_results.py), rendered into docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _procs import start_ray  # noqa: E402

ARMS = {"off": 0, "default": None, "every-step": 1}


def run_arm(arm: str, args) -> dict:
    import pyarrow.parquet as pq

    from ray_ddp import TrainConfig, run

    folder = tempfile.mkdtemp(prefix=f"bench_snapshots_{arm}_")
    try:
        cfg = TrainConfig(workers=2, epochs=1, steps_per_epoch=args.steps, batch_size=args.batch_size,
                          model="mlp", width=args.width, depth=2, optimizer="adamw", report_every=10,
                          strategy=args.strategy,
                          snapshot_every_steps=ARMS[arm], storage=folder, name="snapshots", quiet=True)
        run(cfg, echo=lambda line: None)
        rows = [r for r in pq.read_table(os.path.join(folder, "snapshots", "metrics.parquet")).to_pylist()
                if r["rank"] == 0]
        rows.sort(key=lambda r: r["step"])
        steady = rows[1:]
        seconds = sum(r["samples"] / r["samples_per_s"] for r in steady)
        return {"arm": arm, "samples_per_s": sum(r["samples"] for r in steady) / seconds}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    from _results import add_result_args, rounds_by, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 20:
        parser.exit(2, "give --rounds 1 or more and --steps 20 or more\n")
    stop_ray = start_ray()
    arms, results = list(ARMS), []
    try:
        for round_no in range(args.rounds):
            for arm in arms[round_no % 3:] + arms[:round_no % 3]:
                results.append({**run_arm(arm, args), "round": round_no})
                print(f"round {round_no + 1}/{args.rounds} {arm}: {results[-1]['samples_per_s']:,.0f} samples/s",
                      flush=True)
    finally:
        stop_ray()
    per_round = rounds_by(results)
    rows = []
    for arm in arms:
        paired = [entry["arms"][arm]["samples_per_s"] / entry["arms"]["off"]["samples_per_s"] for entry in per_round]
        rows.append({"arm": arm, "samples_per_s": statistics.median(r["samples_per_s"] for r in results
                                                                   if r["arm"] == arm),
                     "paired_ratio": statistics.median(paired), "paired_ratio_all": paired})
    sharded = ", --strategy fsdp" if args.strategy == "fsdp" else ""
    setup = (f"mlp 10-{args.width}x2-5 under AdamW{sharded}, 2 CPU workers, {args.steps} steps of {args.batch_size} rows, "
             f"a window every 10 steps; one local Ray, {os.cpu_count()} CPUs")
    result = {"setup": setup, "baseline": "off", "paired_rounds": args.rounds, "arms": rows}
    print(f"\n{setup}; medians of {args.rounds} paired rounds")
    for row in rows:
        print(f"| {row['arm']} | {row['samples_per_s']:,.0f} samples/s | x off {row['paired_ratio']:.3f} |")
    save_result(args, "snapshot_cost", result, per_round)


if __name__ == "__main__":
    main()
