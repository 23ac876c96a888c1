"""How DDP's bucket-view gradients are best zeroed: ``zero_grad(set_to_none=True)``
against zeroing in place (what ray-ddp does when ``gradient_as_bucket_view`` is on), on
one process and one gloo group of one rank, in paired rounds.

It also checks what a step does to the gradients' memory: whether, after
``set_to_none=True``, the next backward puts each gradient back into DDP's bucket (the
same address every step) or allocates a new one.

    python benchmarks/zero_grad.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

ARMS = ("set_to_none", "in_place")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    started_group = not dist.is_initialized()  # a caller's group (a test's) is used as it is
    if started_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    ddp = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(args.batch_size, args.width)

    def step(set_to_none: bool) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        ddp(x).sum().backward()
        optimizer.step()

    addresses = {}
    for arm in ARMS:
        step(arm == "set_to_none")  # the first backward after a switch may still allocate
        seen = set()
        for _ in range(3):
            step(arm == "set_to_none")
            seen.add(model[0].weight.grad.data_ptr())
        addresses[arm] = len(seen)
    rounds, times = [], {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        ms = {}
        for arm in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(arm == "set_to_none")
            ms[arm] = (time.perf_counter() - start) / args.steps * 1e3
            times[arm].append(ms[arm])
        rounds.append({"round": r + 1, "order": list(order), "step_ms": ms,
                       "in_place_x_set_to_none": ms["in_place"] / ms["set_to_none"]})
    ratios = [r["in_place_x_set_to_none"] for r in rounds]
    result = {"step_ms": {arm: statistics.median(times[arm]) for arm in ARMS},
              "paired_ratio": statistics.median(ratios), "paired_ratio_all": ratios,
              "grad_addresses_over_3_steps": addresses,
              "setup": f"DDP(gradient_as_bucket_view=True), MLP {args.depth} x {args.width}, "
                       f"batch {args.batch_size}, SGD, 1 rank, 1 thread"}
    print(result["setup"])
    print("| zeroing | step ms | gradient addresses over 3 steps |")
    print("|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {result['step_ms'][arm]:.2f} | {addresses[arm]} |")
    print(f"in place x set_to_none, paired: {result['paired_ratio']:.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    save_result(args, "zero_grad", result, rounds)
    if started_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
