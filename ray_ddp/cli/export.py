"""``ray-ddp export``: a checkpoint's model as one plain state_dict file, or (``--format
hf``) a Hugging Face model as a ``from_pretrained`` folder. Runs on the driver."""

from __future__ import annotations

import argparse

from ray_ddp.config.train import TrainConfig


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint's model as one plain state_dict file "
                                           "(consolidating an FSDP checkpoint's shards), or a Hugging "
                                           "Face model as a from_pretrained folder")
    export.add_argument("run", help="the run's name (its folder under --storage)")
    export.add_argument("--storage", default=TrainConfig.storage,
                        help=f"where the run lives (default: {TrainConfig.storage})")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint's global step (default: the newest whole checkpoint)")
    # the names live here, not imported from export/run.py: that module imports
    # torch, and `ray-ddp --help` should not wait for it
    export.add_argument("--format", choices=("torch", "hf"), default="torch",
                        help="torch: one state_dict file for torch.load(weights_only=True); hf: for a "
                             "Hugging Face (transformers) model, a folder that "
                             "AutoModel*.from_pretrained loads (config.json, model.safetensors) "
                             "(default: torch)")
    export.add_argument("--out", metavar="PATH", default=None,
                        help="--format torch: the file to write (default: <run>-step-<N>.pt in the "
                             "current folder); --format hf: the new or empty folder to write (required)")
    export.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="--format hf: the largest safetensors file, as save_pretrained's max_shard_size "
                             "(5GB, 500MB, 2GiB); a bigger model is written as model-0000N-of-0000M.safetensors "
                             "files with model.safetensors.index.json (default: transformers' own, 50GB)")
    export.add_argument("--merge", action="store_true",
                        help="--format hf of a --lora run: write the whole model with the adapters merged "
                             "into the base (a plain from_pretrained folder, no peft needed) instead of the "
                             "adapters alone; required for a --lora run started with --init-from, whose "
                             "adapters were not trained over hf:DIR's own weights")


def run(args: argparse.Namespace) -> int:
    # here, not at the top: `ray-ddp --help` imports every command's module and needs none of what this one runs
    from ray_ddp.export.run import export_model

    print(export_model(args.run, args.storage, args.step, args.out, args.format, args.merge,
                       args.max_shard_size).text())
    return 0
