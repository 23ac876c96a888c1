"""``ray-ddp doctor``: before a run, on the cluster it would use, whether it should start:
each node's CPUs, GPUs and their speed, the run storage from every node, all-reduces
across the placed ranks and between nodes, the network settings; a table (or ``--json``)
and exit 0 (start it) or 1 (a node is named). Runs on the driver (cluster/doctor.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ray_ddp.cli.common import EXIT_TRAINING_FAILED
from ray_ddp.config.train import TrainConfig

HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}


def add_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check the cluster a run would use before it starts: nodes, GPUs, "
                                           "matmul speed, all-reduce bandwidth, storage speed; exit 1 names "
                                           "the nodes that would slow or stop the run")
    doctor.add_argument("--address", default=None, help=HELP["address"])
    doctor.add_argument("--workers", type=int, default=None,
                        help="workers the run would use (default: as `ray-ddp train` takes them)")
    doctor.add_argument("--gpus-per-worker", type=int, default=None, help=HELP["gpus_per_worker"])
    doctor.add_argument("--storage", default=None,
                        help="the run storage to time from every node (a local path shared by the nodes, "
                             "or a URI); default: not timed")
    doctor.add_argument("--json", action="store_true", help="print the findings as one JSON object")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.cluster.attach import attach_ray
    from ray_ddp.cluster.doctor import examine_cluster

    with attach_ray(args.address, verbose=False):
        report = examine_cluster(args.workers, args.gpus_per_worker, args.storage)
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return 0 if report.ok else EXIT_TRAINING_FAILED


def _num(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def format_report(report) -> str:
    """The table a person reads: a line per node, the group and the pairs, then the verdict."""
    count = f"{len(report.nodes)} node" + ("s" if len(report.nodes) != 1 else "")
    lines = [f"ray-ddp doctor: {count}; the run {report.need}, backend {report.backend}",
             f"{'node':14} {'host':16} {'CPUs':>5} {'GPUs':>5} {'TFLOP/s (min)':>14} {'write MB/s':>11} "
             f"{'read MB/s':>10} {'late s':>7} {'links GB/s':>11}  GPU names"]
    for n in report.nodes:
        storage = n.storage or {}
        names = ", ".join(sorted(set(n.gpu_names))) or "-"
        lines.append(f"{n.node_id[:12] + '…':14} {(n.host or '?')[:16]:16} {n.cpus:>5g} {n.gpus:>5g} "
                     f"{_num(min(n.matmul_tflops, default=None)):>14} {_num(storage.get('write_mb_s'), '.0f'):>11} "
                     f"{_num(storage.get('read_mb_s'), '.0f'):>10} {_num(n.late_s):>7} "
                     f"{_num(n.pair_busbw_gb_s):>11}  {names}")
    if report.group_busbw_gb_s is not None:
        lines.append(f"all-reduce over {report.workers} placed ranks: {report.group_busbw_gb_s:.3g} GB/s bus "
                     f"bandwidth, a step of {report.group_step_s:.3g} s")
    for pair in report.pairs:
        lines.append(f"nodes {pair['a'][:12]}… and {pair['b'][:12]}…: "
                     + (f"{pair['busbw_gb_s']:.3g} GB/s" if pair["busbw_gb_s"] is not None else pair["error"]))
    settings = {k: v for n in report.nodes for k, v in n.env.items()}
    ib = sorted({d for n in report.nodes for d in n.ib_devices})
    lines.append("settings: " + (", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or
                                 "no NCCL_* or GLOO_* network variable set")
                 + f"; InfiniBand devices: {', '.join(ib) or 'none'}")
    for problem in report.problems:
        lines.append(f"problem: {problem}")
    for n in report.nodes:
        for problem in n.problems:
            lines.append(f"problem: node {n.node_id[:12]}… ({n.host or '?'}): {problem}")
    lines.append("verdict: the run can start" if report.ok else "verdict: do not start the run here yet")
    return "\n".join(lines)
