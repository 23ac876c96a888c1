"""A worker's set-up with Python's garbage collector on, and paused as ray-ddp's worker
loop pauses it (``ray_ddp.worker.loop.collection_paused``), in paired rounds.

Each arm is a fresh process that first imports what a Ray Train worker already holds when
ray-ddp's loop starts (torch, torch.distributed, ray, ray.train.torch), joins a gloo group
of one rank, then times the CPU seconds (its own process time) of the set-up step that
costs the most: wrapping the tutorial's toy model in DDP, whose constructor imports
torch._dynamo. The arms alternate which goes first.

    python benchmarks/worker_setup.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

ARMS = ("on", "paused")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import contextlib, sys, time
import torch, torch.distributed as dist, ray, ray.train.torch
from ray_ddp.models.builtin import ToyModel
from ray_ddp.parallel.ddp import wrap_ddp
from ray_ddp.worker.loop import collection_paused

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
pause = collection_paused() if sys.argv[1] == "paused" else contextlib.nullcontext()
start = time.process_time()
with pause:
    wrap_ddp(ToyModel(), [torch.device("cpu")])
print(time.process_time() - start)
dist.destroy_process_group()
"""


def run_arm(arm: str) -> float:
    """CPU seconds of one fresh process's DDP wrap under ``arm``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", CHILD, arm], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.exit(2, f"--rounds {args.rounds}: give 1 or more\n")
    rounds = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        cpu = {arm: run_arm(arm) for arm in order}
        rounds.append({"round": r + 1, "order": list(order), "cpu_s": cpu,
                       "paused_x_on": cpu["paused"] / cpu["on"]})
        print(f"round {r + 1}: " + ", ".join(f"{arm} {cpu[arm]:.3f} CPU-s" for arm in order), flush=True)
    ratios = [r["paused_x_on"] for r in rounds]
    result = {"cpu_s": {arm: statistics.median(r["cpu_s"][arm] for r in rounds) for arm in ARMS},
              "paired_ratio": statistics.median(ratios), "paired_ratio_all": ratios,
              "setup": "DDP(ToyModel) in a fresh process holding torch and Ray Train, gloo, 1 rank"}
    print(result["setup"])
    print("| collector | CPU s (median) |")
    print("|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {result['cpu_s'][arm]:.3f} |")
    print(f"paused x on, paired: {result['paired_ratio']:.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    save_result(args, "worker_setup", result, rounds)


if __name__ == "__main__":
    main()
