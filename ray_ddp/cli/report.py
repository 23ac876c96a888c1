"""``ray-ddp report``: plots of a run's metrics and its slowest rank. Runs on the driver."""

from __future__ import annotations

import argparse

from ray_ddp.config.train import TrainConfig


def add_parser(sub) -> None:
    report = sub.add_parser("report", help="plot a run's metrics (PNG) and name its slowest rank")
    report.add_argument("run", help="the run's name (its folder under --storage)")
    report.add_argument("--storage", default=TrainConfig.storage,
                        help=f"where the run lives (default: {TrainConfig.storage})")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="where the PNGs and report.txt go (default: <storage>/<run>/report/)")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.observe.report import write_report

    summary = write_report(args.storage, args.run, args.out)
    print(summary.text())
    for path in summary.files:
        print(f"wrote {path}")
    return 0
