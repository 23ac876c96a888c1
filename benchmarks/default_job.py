"""The default job, whole: `ray-ddp train` with no flags against the same job written by
hand on plain Ray Train. What a new user runs first, start-up and shutdown included.

The job (ray-ddp's defaults): the tutorial's ToyModel, 2 CPU workers, 3 epochs of 20
steps of 32 synthetic rows per worker, SGD (momentum 0.9, lr 0.05), a metrics report every
10 steps, rank 0 saving a checkpoint (model and optimizer) into Ray's run storage at each
epoch's end, the newest 2 kept. Two arms, each a command that starts a local Ray of its
own (as on a laptop), run one after the other in paired rounds, alternating which goes
first:
  ray-train  this file with --plain: a TorchTrainer as Ray's documentation writes it
             (prepare_model, the loop, torch.save, ray.train.report with the checkpoint)
  ray-ddp    `python -m ray_ddp train` with no flags (HOME set to a fresh folder, so
             its default storage ~/ray_ddp_runs starts empty)
The figure is each command's wall time, from launch to exit; the claim is the paired
ratio ray-ddp / ray-train (at most 1.0: ray-ddp costs nothing over writing it by hand).

    python benchmarks/default_job.py --rounds 3
Runs on the machine it measures. The figures also go to
benchmarks/results/default_job-<machine>-<date>.json (--results-dir, --no-save; see
benchmarks/_results.py), rendered into docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = ("ray-train", "ray-ddp")
EPOCHS, STEPS, BATCH, REPORT_EVERY, KEEP = 3, 20, 32, 10, 2


def plain_train_func(config: dict) -> None:
    """On each Ray Train worker: the default job's loop, written by hand."""
    import ray.train
    import ray.train.torch
    import torch

    from ray_ddp.models.builtin import ToyModel

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(ToyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1 + rank)
    for epoch in range(1, EPOCHS + 1):
        for step in range(1, STEPS + 1):
            x, y = torch.randn(BATCH, 10, generator=data), torch.randn(BATCH, 5, generator=data)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            metrics = {"epoch": epoch, "step": (epoch - 1) * STEPS + step, "loss": loss.item()}
            if step % REPORT_EVERY and step != STEPS:
                continue
            if step != STEPS:
                ray.train.report(metrics)
            elif rank == 0:
                with tempfile.TemporaryDirectory() as folder:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "epoch": epoch}, os.path.join(folder, "model.pt"))
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
            else:
                ray.train.report(metrics)


def run_plain(storage: str) -> None:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(plain_train_func, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=storage, name="plain",
                                      checkpoint_config=CheckpointConfig(num_to_keep=KEEP))).fit()


def arm_command(arm: str, storage: str) -> list[str]:
    if arm == "ray-train":
        return [sys.executable, os.path.abspath(__file__), "--plain", storage]
    return [sys.executable, "-m", "ray_ddp", "train"]


def run_arm(arm: str, env: dict) -> dict:
    home = tempfile.mkdtemp(prefix=f"bench_default_{arm}_")
    launched = time.time()
    proc = subprocess.run(arm_command(arm, os.path.join(home, "runs")), env={**env, "HOME": home},
                          cwd=home, capture_output=True, text=True)
    wall = time.time() - launched
    shutil.rmtree(home, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"arm": arm, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain", metavar="STORAGE", help=argparse.SUPPRESS)  # the ray-train arm itself
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, rounds_by, save_result

    add_result_args(parser)
    args = parser.parse_args()
    if args.plain:
        return run_plain(args.plain)
    # each arm starts a Ray of its own on loopback; Ray Train's own timing (no test settings)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    results = []
    for round_no in range(args.rounds):
        for arm in (ARMS if round_no % 2 == 0 else ARMS[::-1]):
            results.append({**run_arm(arm, env), "round": round_no})
            print(f"round {round_no + 1}/{args.rounds} {arm}: wall {results[-1]['wall_s']:.1f} s", flush=True)
    per_round = rounds_by(results)
    for entry in per_round:
        entry["paired_ratio"] = entry["arms"]["ray-ddp"]["wall_s"] / entry["arms"]["ray-train"]["wall_s"]
    wall = {arm: statistics.median(r["wall_s"] for r in results if r["arm"] == arm) for arm in ARMS}
    paired = [entry["paired_ratio"] for entry in per_round]
    setup = (f"ToyModel, 2 CPU workers, {EPOCHS} epochs of {STEPS} steps, a rank-0 checkpoint each epoch; "
             f"each command starts its own Ray; {os.cpu_count()} CPUs")
    print(f"\nthe default job ({setup}), medians of {args.rounds} paired rounds")
    print("| arm | wall s | x ray-train (paired) |\n|---|---|---|")
    print(f"| ray-train | {wall['ray-train']:.1f} | 1.000 |")
    print(f"| ray-ddp | {wall['ray-ddp']:.1f} | {statistics.median(paired):.3f} |")
    print("paired per round: " + ", ".join(f"{p:.3f}" for p in paired))
    save_result(args, "default_job", {
        "setup": setup, "baseline": "ray-train", "paired_rounds": args.rounds,
        "wall_s": wall["ray-ddp"], "baseline_wall_s": wall["ray-train"],
        "paired_ratio": statistics.median(paired), "paired_ratio_all": paired,
    }, per_round)


if __name__ == "__main__":
    main()
