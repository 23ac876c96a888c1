"""What spot-preemption handling costs, and how fast it saves: two numbers, one run.

1. The per-step cost of asking Ray whether a node is being preempted.
   ``ray.train.get_preemption_info()`` is a barrier through Ray (rank 0's answer is
   broadcast), so ray_ddp asks at window ends, at most once a second. Three arms run the
   same DDP steps of a small mlp on 2 gloo workers under Ray Train, side by side, each
   with ray-ddp's one all-reduce per metrics window: no check, a check every step (the
   worst case), and a check at most once a second at window ends, decided in that
   all-reduce (what ray_ddp does). Reported: median seconds per step and the cost per
   call, over paired rounds.
2. Notice to checkpoint: a two-node Ray on this machine (``ray.cluster_utils.Cluster``:
   real raylets), `ray-ddp train --workers 1-2` on it, the second node drained the way
   the autoscaler does (DRAIN_NODE_REASON_PREEMPTION, 30 s deadline); the time from the
   drain call to the preemption checkpoint in progress.json. Ray Train's watcher polls
   drains every RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (5 s by default), so that is most of it.

    python benchmarks/preemption.py                 # both, 3 rounds
    python benchmarks/preemption.py --skip-notice   # only the per-step cost
The figures also go to benchmarks/results/preemption-<machine>-<date>.json (--results-dir,
--no-save; see benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = ("no check", "check every step", "ray-ddp: at window ends, <= 1/s")


def train_fn(config: dict) -> None:
    """DDP steps of an mlp; the arm decides when get_preemption_info() is called."""
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 64), torch.randn(128, 8)
    calls, last_check = 0, time.perf_counter()
    ray.train.get_preemption_info()  # the first call sets Ray's side up: once per run, not timed
    for step in range(config["warmup"] + config["steps"]):
        if step == config["warmup"]:
            started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        arm = config["arm"]
        if arm == ARMS[1]:
            ray.train.get_preemption_info()
            calls += 1
        if (step + 1) % config["window"] == 0:
            # every arm: the window's all-reduce, which in ray-ddp also carries rank 0's
            # clock deciding whether a preemption check is due (no extra collective)
            due = torch.tensor([float(time.perf_counter() - last_check >= 1.0)])
            torch.distributed.all_reduce(due)
            if arm == ARMS[2] and due.item():
                last_check = time.perf_counter()
                ray.train.get_preemption_info()
                calls += 1
    elapsed = time.perf_counter() - started
    if ray.train.get_context().get_world_rank() == 0:  # Ray keeps only checkpointed metrics: a file
        with open(config["out"], "w") as f:
            json.dump({"s_per_step": elapsed / config["steps"], "calls": calls}, f)


def per_step_cost(args) -> dict:
    """Run the per-step arms, print their table; return its figures and the rounds'."""
    results = run_per_step(args)
    base = statistics.median(r["s_per_step"] for r in results[ARMS[0]])
    print(f"per-step cost of the preemption check: 2 gloo workers, mlp 64-512-8, {args.steps} steps, "
          f"{args.rounds} rounds (medians)")
    print("| arm | ms per step | x no check | calls per run | ms per call |")
    print("|---|---|---|---|---|")
    rows = []
    for arm in ARMS:
        per_step = statistics.median(r["s_per_step"] for r in results[arm])
        calls = statistics.median(r["calls"] for r in results[arm])
        per_call = (per_step - base) * args.steps / calls * 1e3 if calls else None
        print(f"| {arm} | {per_step * 1e3:.2f} | {per_step / base:.3f} | {calls:.0f} | "
              f"{'' if per_call is None else f'{per_call:.2f}'} |")
        paired = [r["s_per_step"] / b["s_per_step"] for r, b in zip(results[arm], results[ARMS[0]])]
        rows.append({"arm": arm, "ms_per_step": per_step * 1e3, "baseline_ms_per_step": base * 1e3,
                     "x_baseline": per_step / base, "paired_ratio": statistics.median(paired),
                     "paired_ratio_all": paired, "calls": calls, "ms_per_call": per_call})
    rounds = [{"round": i + 1, "order": list(ARMS), "arms": {arm: results[arm][i] for arm in ARMS}}
              for i in range(args.rounds)]
    return {"setup": f"2 gloo workers, mlp 64-512-8, {args.steps} steps, {args.window}-step windows, "
                     f"{args.rounds} rounds", "baseline": ARMS[0], "arms": rows, "rounds": rounds}


def run_per_step(args) -> dict[str, list[dict]]:
    """Each arm's runs under Ray Train, in round order: {arm: [{s_per_step, calls}]}."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="bench_preempt_")
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_ in range(args.rounds):
        for i, arm in enumerate(ARMS):
            out = os.path.join(storage, f"r{round_}-{i}.json")
            trainer = TorchTrainer(train_fn, train_loop_config={"arm": arm, "steps": args.steps, "out": out,
                                                                "warmup": 20, "window": args.window},
                                   scaling_config=ScalingConfig(num_workers=2),
                                   run_config=RunConfig(name=f"r{round_}-{i}", storage_path=storage))
            trainer.fit()
            with open(out) as f:
                results[arm].append(json.load(f))
    ray.shutdown()
    return results


def notice_to_checkpoint(args) -> dict:
    """Time the drains, print the line; return the figures."""
    times = run_notice(args)
    print(f"\nnotice to checkpoint: drain (30 s deadline) to the preemption checkpoint in progress.json, "
          f"watcher polling every {args.poll_s:g} s, {args.rounds} rounds: median "
          f"{statistics.median(times):.1f} s (each: {', '.join(f'{t:.1f}' for t in times)})")
    return {"poll_s": args.poll_s, "median_s": statistics.median(times), "each_s": times}


def run_notice(args) -> list[float]:
    """Seconds from each round's drain call to the preemption checkpoint."""
    from ray.cluster_utils import Cluster

    times = []
    for round_ in range(args.rounds):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        storage = tempfile.mkdtemp(prefix="bench_notice_")
        cmd = [sys.executable, "-m", "ray_ddp", "train", "--address", cluster.address, "--workers", "1-2",
               "--model", "mlp", "--epochs", "3", "--steps-per-epoch", "2000", "--batch-size", "64",
               "--storage", storage, "--name", "spot", "--quiet", "--max-failures", "0"]
        env = {**os.environ, "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(args.poll_s)}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        progress = os.path.join(storage, "spot", "progress.json")
        try:
            _wait(lambda: _read(progress).get("step", 0) >= 20, proc)
            drained = time.time()
            subprocess.run(["ray", "drain-node", "--address", cluster.address, "--node-id", node.node_id,
                            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "benchmark",
                            "--deadline-remaining-seconds", "30"], check=True, capture_output=True)
            _wait(lambda: _read(progress).get("preemptions"), proc)
            times.append(time.time() - drained)
        finally:
            proc.kill()
            proc.wait()
            cluster.shutdown()
    return times


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _wait(predicate, proc, timeout=180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise SystemExit(f"ray-ddp train exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise SystemExit("timed out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per run of the per-step arms")
    parser.add_argument("--window", type=int, default=10, help="steps per metrics window (--report-every)")
    parser.add_argument("--poll-s", type=float, default=5.0,
                        help="Ray Train's preemption watcher poll interval (its default: 5)")
    parser.add_argument("--skip-notice", action="store_true", help="only the per-step cost")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args()
    result = per_step_cost(args)
    rounds = result.pop("rounds")
    result["paired_rounds"] = args.rounds
    result["notice"] = None
    if not args.skip_notice:
        result["notice"] = notice_to_checkpoint(args)
        for entry, seconds in zip(rounds, result["notice"]["each_s"]):
            entry["notice_s"] = seconds  # a separate measurement, numbered as the rounds are
    save_result(args, "preemption", result, rounds)


if __name__ == "__main__":
    main()
