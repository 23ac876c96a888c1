"""``ray-ddp launch``: a torchrun-style script in N processes placed by Ray. Runs on the driver."""

from __future__ import annotations

import argparse
import os

from ray_ddp.config.train import TrainConfig
from ray_ddp.config.checks import check_launch
from ray_ddp.launch.launch import launch


def add_parser(sub) -> None:
    launch = sub.add_parser("launch", help="run a torchrun-style script in N processes placed by Ray")
    launch.add_argument("--workers", type=int, default=2, help="processes (world size) (default: 2)")
    launch.add_argument("--gpus-per-worker", type=int, default=0, choices=(0, 1, 2),
                        help="GPUs each process owns (default: 0)")
    launch.add_argument("--address", default=None,
                        help="Ray cluster to attach to (auto or HOST:PORT); default: RAY_ADDRESS, "
                             "else start a local Ray")
    launch.add_argument("--max-failures", type=int, default=0,
                        help="restart all processes this many times when one fails (default: 0)")
    launch.add_argument("--wait-for-resources", type=float, default=TrainConfig.wait_for_resources,
                        help="seconds to wait for the cluster to hold every process "
                             f"(default: {TrainConfig.wait_for_resources:g})")
    launch.add_argument("script", help="the script; it reads RANK, WORLD_SIZE, LOCAL_RANK, "
                                       "MASTER_ADDR, MASTER_PORT")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    check_launch(args.script, args.max_failures, args.wait_for_resources)
    return launch([os.path.abspath(args.script), *args.script_args], args.workers,
                  args.gpus_per_worker, args.address, args.max_failures, args.wait_for_resources)
