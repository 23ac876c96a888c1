"""Time to the first step, and the whole smallest real job: ray-ddp against plain Ray Train.

The job: the tutorial's toy model, 2 CPU workers, one DDP step, then rank 0 saves a
checkpoint into Ray's run storage; the command exits. Two arms, run as commands side by
side, alternating which goes first, in paired rounds:
  ray-train  this file with --plain: a TorchTrainer written as Ray's documentation shows
             (prepare_model, one step, torch.save, ray.train.report with the checkpoint)
  ray-ddp    `python -m ray_ddp train --model toy --epochs 1 --steps-per-epoch 1`
  ray-ddp-idle-workers   the same with RAY_prestart_worker_first_driver=1: the Ray it
             starts prestarts idle Python workers for the driver, as Ray does by default
             and ray-ddp no longer asks for (not in the default arms)
Measured from launching the command: the end of rank 0's first step (both arms write
when it ended), the command's exit (whole-process wall time), and the CPU seconds the
whole machine spent meanwhile (every process: the command, Ray Train's controller, its
workers and helper actors, Ray's own daemons; Linux's /proc/stat, so None elsewhere):
what one run costs a test suite on a machine whose cores are all busy. Where ray-ddp's seconds
go comes from its summary's startup_s; where the CPU seconds go, from each process's own
(/proc/<pid>/stat, sampled every 0.2 s while the command runs, so a process's last 0.2 s
before it exits can be missed), grouped by what the process is (``process_kind``): Ray
Train's workers, its controller, its helper actors, ray-ddp's actors, the command itself,
Ray's own processes: its daemons and idle workers (with --by-process).

  --cluster local     each command starts a Ray of its own (ray.init), as on a laptop
  --cluster attached  both attach to one Ray that this script starts first (a two-CPU head
                      from ray.cluster_utils), as under `ray job submit`

    python benchmarks/startup.py --rounds 3                     # local
    python benchmarks/startup.py --rounds 3 --cluster attached
    python benchmarks/startup.py --rounds 4 --arms ray-ddp,ray-ddp-idle-workers
    python benchmarks/startup.py --rounds 3 --cluster attached --by-process
Runs on the machine it measures. The figures also go to
benchmarks/results/startup-<machine>-<date>.json (--results-dir, --no-save; see
benchmarks/_results.py).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _procs import ProcessSampler, busy_cpu_s, ray_name  # noqa: E402

ARMS = ("ray-train", "ray-ddp", "ray-ddp-idle-workers")
DEFAULT_ARMS = ARMS[:2]
ARM_ENV = {"ray-ddp-idle-workers": {"RAY_prestart_worker_first_driver": "1"}}


def plain_train_func(config: dict) -> None:
    """On each Ray Train worker: one DDP step of the toy model; rank 0 saves and reports
    a checkpoint, the others report without one."""
    import ray.train
    import ray.train.torch
    import torch

    from ray_ddp.models.builtin import ToyModel

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(ToyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
    optimizer.step()
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        with open(config["first_step_file"], "w") as f:
            f.write(str(time.time()))
        folder = tempfile.mkdtemp()
        torch.save(model.module.state_dict(), os.path.join(folder, "model.pt"))
        ray.train.report({"step": 1}, checkpoint=ray.train.Checkpoint.from_directory(folder))
    else:
        ray.train.report({"step": 1})


def run_plain(args) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(plain_train_func, train_loop_config={"first_step_file": args.first_step_file},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(storage_path=args.storage, name="plain"))
    trainer.fit()


def arm_command(arm: str, storage: str, first_step_file: str) -> list[str]:
    if arm == "ray-train":
        return [sys.executable, os.path.abspath(__file__), "--plain", "--storage", storage,
                "--first-step-file", first_step_file]
    return [sys.executable, "-m", "ray_ddp", "train", "--model", "toy", "--workers", "2", "--epochs", "1",
            "--steps-per-epoch", "1", "--storage", storage, "--name", "small", "--quiet", "--json"]


# Ray Train's own actors besides its workers and controller (one of each per run, each a
# new Python process), and ray-ddp's (the hang watch and its tasks)
RAY_TRAIN_HELPERS = ("PlacementGroupCleaner", "SynchronizationActor", "DatasetManager",
                     "_AutoscalingCoordinatorActor")
RAY_DDP_ACTORS = ("HangWatch", "py_spy_dump", "_alive", "_kill")  # driver/hang_actor.py's actor and tasks
KINDS = ("workers", "controller", "Ray Train's helpers", "ray-ddp's actors", "the command", "Ray's own processes",
         "other")


def process_kind(title: str, is_command: bool) -> str:
    """What a process is, from its command line (Ray names an actor's process
    ``ray::Class`` or ``ray::Class.method``, a task's ``ray::function``)."""
    if is_command:
        return "the command"
    name = ray_name(title)
    if name is None:
        return "Ray's own processes" if "/ray/" in title or "ray." in title else "other"
    if name == "RayTrainWorker":
        return "workers"
    if name == "TrainController":
        return "controller"
    if name in RAY_TRAIN_HELPERS:
        return "Ray Train's helpers"
    if name in RAY_DDP_ACTORS:
        return "ray-ddp's actors"
    return "Ray's own processes" if name in ("DashboardAgent", "RuntimeEnvAgent", "IDLE") else "other"


def cpu_by_kind(before: dict, seen: dict, command_pid: int) -> dict[str, float]:
    """CPU seconds spent since ``before`` per kind of process, ``seen`` holding each
    process's last sample and its ``better_title``."""
    kinds = dict.fromkeys(KINDS, 0.0)
    for pid, (cpu, title) in seen.items():
        spent = cpu - before.get(pid, (0.0, ""))[0]
        if spent > 0:
            kinds[process_kind(title, pid == command_pid)] += spent
    return kinds


def median_by_kind(runs: list[dict]) -> dict[str, float] | None:
    """Each kind's median CPU seconds over an arm's rounds (None without /proc)."""
    if not runs or any(r.get("cpu_by_process") is None for r in runs):
        return None
    return {k: statistics.median(r["cpu_by_process"][k] for r in runs) for k in KINDS}


def run_arm(arm: str, env: dict, by_process: bool = False) -> dict:
    storage = tempfile.mkdtemp(prefix=f"bench_start_{arm}_")
    first_step_file = os.path.join(storage, "first_step")
    # (the sampling itself costs CPU: "other" in the breakdown, and in CPU s)
    sampler = ProcessSampler().start() if by_process and os.path.isdir("/proc") else None
    cpu_before = busy_cpu_s()
    launched = time.time()
    proc = subprocess.Popen(arm_command(arm, storage, first_step_file), env={**env, **ARM_ENV.get(arm, {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()
    wall = time.time() - launched
    cpu = busy_cpu_s() - cpu_before if cpu_before is not None else None
    if sampler is not None:
        sampler.stop()
    if proc.returncode != 0:
        shutil.rmtree(storage, ignore_errors=True)
        raise SystemExit(f"{arm} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    startup = None
    if arm.startswith("ray-ddp"):
        import pyarrow.parquet as pq

        rows = pq.read_table(os.path.join(storage, "small", "metrics.parquet")).to_pylist()
        first_step = min(r["first_step_at"] for r in rows if r["rank"] == 0)
        startup = json.loads(stdout.strip().splitlines()[-1]).get("startup_s")
    else:
        with open(first_step_file) as f:
            first_step = float(f.read())
    shutil.rmtree(storage, ignore_errors=True)
    return {"arm": arm, "first_step_s": first_step - launched, "wall_s": wall, "cpu_s": cpu,
            "startup_s": startup,
            "cpu_by_process": cpu_by_kind(sampler.before, sampler.seen, proc.pid) if sampler else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cluster", choices=("local", "attached"), default="local")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, from {', '.join(ARMS)} (ray-train is the baseline, always run)")
    parser.add_argument("--json", help="write every round's raw figures here")
    parser.add_argument("--by-process", action="store_true",
                        help="also each kind of process's CPU seconds (sampled, which costs CPU itself)")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the ray-train arm itself
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--first-step-file", help=argparse.SUPPRESS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, rounds_by, save_result

    add_result_args(parser)
    args = parser.parse_args()
    if args.plain:
        return run_plain(args)
    arms = ["ray-train"] + [a for a in args.arms.split(",") if a and a != "ray-train"]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm {unknown[0]}; choose from {', '.join(ARMS)}")

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a local Ray on loopback, as ray-ddp's
    cluster = None
    if args.cluster == "attached":
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        env["RAY_ADDRESS"] = cluster.address
    results = []
    try:
        for round_no in range(args.rounds):
            for arm in (arms if round_no % 2 == 0 else arms[::-1]):
                r = {**run_arm(arm, env, args.by_process), "round": round_no}
                results.append(r)
                print(f"round {round_no + 1}/{args.rounds} {arm}: first step {r['first_step_s']:.1f} s, "
                      f"wall {r['wall_s']:.1f} s"
                      + (f", CPU {r['cpu_s']:.1f} s" if r.get("cpu_s") is not None else "")
                      + (f", startup {r['startup_s']}" if r["startup_s"] else ""),
                      flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown()
    print(f"\nthe smallest job (toy model, 2 CPU workers, 1 step, a rank-0 checkpoint), {args.cluster} Ray, "
          f"{os.cpu_count()} CPUs, medians of {args.rounds} paired rounds")
    fields = ("first_step_s", "wall_s") + (("cpu_s",) if all(r.get("cpu_s") is not None for r in results) else ())
    print("| arm | first step s | x ray-train (paired) | wall s | x ray-train (paired) |"
          + (" CPU s | x ray-train (paired) |" if "cpu_s" in fields else "")
          + "\n|---|---|---|---|---|" + ("---|---|" if "cpu_s" in fields else ""))
    base = {r["round"]: r for r in results if r["arm"] == "ray-train"}
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        cells = []
        for field in fields:
            cells.append(f"{statistics.median(r[field] for r in mine):.1f}")
            cells.append(f"{statistics.median(r[field] / base[r['round']][field] for r in mine):.3f}")
        print(f"| {arm} | " + " | ".join(cells) + " |")
    ddp = [r["startup_s"] for r in results if r["arm"] == "ray-ddp" and r["startup_s"]]
    if ddp:
        print("ray-ddp startup_s (median per phase): " + ", ".join(
            f"{k} {statistics.median(s[k] for s in ddp):.2f}" for k in ddp[0]))
    by_process = {arm: median_by_kind([r for r in results if r["arm"] == arm]) for arm in arms}
    if all(by_process.values()):
        print("\nCPU s by process (medians): | arm | " + " | ".join(KINDS) + " |")
        for arm, kinds in by_process.items():
            print(f"| {arm} | " + " | ".join(f"{kinds[k]:.1f}" for k in KINDS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": args.cluster, "rounds": results}, f, indent=1)
    rows = []
    for arm in arms:
        mine = [r for r in results if r["arm"] == arm]
        row = {"arm": arm, **({"by_process": by_process[arm]} if by_process[arm] else {})}
        for field in fields:
            row[field] = statistics.median(r[field] for r in mine)
            row[f"baseline_{field}"] = statistics.median(r[field] for r in base.values())
            row[f"{field}_paired"] = statistics.median(r[field] / base[r["round"]][field] for r in mine)
        rows.append(row)
    per_round = rounds_by(results)
    for entry in per_round:
        plain = entry["arms"]["ray-train"]
        entry["paired_ratio"] = {arm: {f: r[f] / plain[f] for f in fields}
                                 for arm, r in entry["arms"].items()}
    save_result(args, "startup", {
        "setup": f"the smallest job (toy model, 2 CPU workers, 1 step, a rank-0 checkpoint), {args.cluster} Ray, "
                 f"{os.cpu_count()} CPUs, medians of {args.rounds} paired rounds",
        "cluster": args.cluster, "baseline": "ray-train", "paired_rounds": args.rounds, "arms": rows,
        "startup_s": {k: statistics.median(s[k] for s in ddp) for k in ddp[0]} if ddp else {},
    }, per_round)


if __name__ == "__main__":
    main()
