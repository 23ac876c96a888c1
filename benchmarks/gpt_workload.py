"""The gpt benchmark's baseline: plain PyTorch DDP under torchrun, training ray_ddp's
``gpt`` model on the very batches ``ray-ddp train`` takes (the same token table, the same
epoch order, the same rows per rank: ``ray_ddp.data.epoch_order`` and ``rows_of_step``),
with AdamW and next-token cross-entropy; with ``--hf-model DIR`` a Hugging Face
GPT2LMHeadModel on its own loss (``model(input_ids=..., labels=...).loss``) over the rows of
DATA/rows, a datasets save_to_disk folder. Rank 0 times the steps and each rank writes its
timings as JSON.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpt_workload.py --data DIR --out DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-model", default=None,
                        help="a GPT2LMHeadModel folder: train it on its own loss, rows from DATA/rows")
    args = parser.parse_args()
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ray_ddp.data.sources import epoch_order, rows_of_step
    from ray_ddp.data.table_stats import inspect_table
    from ray_ddp.data.tables import load_table
    from ray_ddp.worker.devices import peak_memory_mb
    from ray_ddp.models.builtin import GPT

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.hf_model:  # the rows ray-ddp reads from the same datasets folder, as tensors
        from transformers import GPT2LMHeadModel

        from ray_ddp.data.saved import SavedDataset

        x_all = torch.tensor(SavedDataset(os.path.join(args.data, "rows")).table().column("input_ids").to_pylist())
        y_all = x_all
        model = GPT2LMHeadModel.from_pretrained(args.hf_model).to(device)
    else:
        x_all, y_all = load_table(inspect_table(args.data, None, None, "lm"), args.seq_len)
        torch.manual_seed(args.seed)
        model = GPT(args.vocab_size, args.width, args.depth, args.heads, args.seq_len).to(device)
    ddp = DDP(model, device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    order = epoch_order(len(x_all), args.seed, 0)
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    times = {}
    total = args.warmup + args.steps
    for step in range(total):
        # the step's global batch is world x --batch-size (ray-ddp's, per worker), cut in order
        idx, _ = rows_of_step(order, step, rank, 0, world, world * args.batch_size, 1)
        x, y = x_all[idx].to(device), y_all[idx].to(device)
        optimizer.zero_grad(set_to_none=True)
        if args.hf_model:  # the model's own loss, as the Hugging Face Trainer takes it
            loss = ddp(input_ids=x, labels=y).loss
        else:
            out = ddp(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if step + 1 in (args.warmup, total):
            sync()
            times["warm_at" if step + 1 == args.warmup else "end_at"] = time.time()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, **times, **peak_memory_mb(device)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
