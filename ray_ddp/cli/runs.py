"""``ray-ddp runs``: the runs under a storage folder. Runs on the driver."""

from __future__ import annotations

import argparse
import json

from ray_ddp.config.train import TrainConfig


def add_parser(sub) -> None:
    runs = sub.add_parser("runs", help="list the runs under a storage folder")
    runs.add_argument("--storage", default=TrainConfig.storage,
                      help=f"where the runs live (default: {TrainConfig.storage})")
    runs.add_argument("--json", action="store_true", help="print the list as one JSON array")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.observe.runs import format_runs, list_runs, runs_as_dicts

    listings = list_runs(args.storage)
    if args.json:
        print(json.dumps(runs_as_dicts(listings)))
    elif not listings:
        print(f"no runs under {args.storage}")
    else:
        print(format_runs(listings))
    return 0
