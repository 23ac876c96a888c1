"""The plain Ray Train arm: the benchmark workload written as Ray's documentation shows.

Runs on the driver (TorchTrainer) and, through ``train_func``, on each Ray Train worker:
``ray.train.torch.prepare_model`` wraps the model in DDP, every rank calls
``ray.train.report`` once per "epoch" (``--report-every`` steps), nothing else.
Each rank writes its timings as ``benchmarks/workload.py`` does.

    python benchmarks/plain_ray_train.py --workers 2 --out DIR ...
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def train_func(config: dict) -> None:
    import ray.train
    import ray.train.torch

    sys.path.insert(0, config["benchmarks_dir"])  # the workers' copy of this folder
    from workload import train, write_result

    from ray_ddp.models.builtin import build_mlp

    args = argparse.Namespace(**config["args"])
    ctx = ray.train.get_context()
    model = build_mlp(args.input_dim, args.output_dim, args.width, args.depth)
    model = ray.train.torch.prepare_model(model)
    device = ray.train.torch.get_device()

    def report(step: int, loss: float) -> None:
        ray.train.report({"step": step, "loss": loss})

    result = train(args, model, device, ctx.get_world_rank(), ctx.get_world_size(),
                   epoch_end=report, every=args.report_every)
    write_result(args.out, result)


def main() -> None:
    sys.path.insert(0, HERE)
    from workload import add_workload_args

    parser = argparse.ArgumentParser(description=__doc__)
    add_workload_args(parser)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", type=int, default=0)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_func,
        train_loop_config={"args": vars(args), "benchmarks_dir": HERE},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus_per_worker > 0),
        run_config=RunConfig(storage_path=args.storage, name="plain_ray_train"),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
