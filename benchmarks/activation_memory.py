"""Activation checkpointing on the built-in gpt: what the forward keeps for the backward,
GPU peak memory and step time, with ``--activation-checkpointing`` off and on.

Both arms run in this one process, no Ray: the same model (the same seed), the same
batches, the same AdamW; the rounds alternate which arm goes first. Per arm and round:

- saved MB: the bytes the forward keeps for the backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, the weights left
  out: they are held anyway), plus, with checkpointing on, the block inputs each
  checkpoint holds to recompute from. A count, not a reading of process memory: on CPU
  torch keeps no allocator statistics, and ru_maxrss only ever grows in one process, so
  it cannot tell two arms of one process apart;
- recompute MB (off arm): the most one block's forward keeps; with checkpointing on, a
  backward rebuilds one block at a time, so its peak is about saved MB + this;
- GPU peak MB: ``torch.cuda.max_memory_allocated`` over one step, reset before it (CUDA
  only: weights, gradients, AdamW state and activations, recompute included);
- step ms: the median of --steps timed steps (forward, backward, AdamW step) after
  --warmup, the GPU synchronized around each.

    python benchmarks/activation_memory.py --rounds 3                 # CPU: ~a minute
    python benchmarks/activation_memory.py --width 1024 --depth 12 --seq-len 1024 --batch-size 8   # a GPU
    python benchmarks/activation_memory.py --width 32 --depth 2 --seq-len 16 --batch-size 2 \\
        --warmup 1 --steps 2 --rounds 1 --no-save                     # seconds (a check)

The figures also go to benchmarks/results/activation_memory-<machine>-<date>.json
(--results-dir, --no-save; see benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ARMS = ("off", "on")
MB = 1024 * 1024


def build(args, device):
    import torch

    from ray_ddp.models.builtin import GPT

    torch.manual_seed(0)
    with device:
        return GPT(args.vocab_size, args.width, args.depth, args.heads, args.seq_len)


def batches(args, device):
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (args.batch_size, args.seq_len + 1)
    return [torch.randint(0, args.vocab_size, shape, generator=g).to(device) for _ in range(4)]


def step(model, optimizer, ids, vocab: int) -> None:
    import torch

    optimizer.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()


def count_saved(model, optimizer, ids, vocab: int, checkpointed: bool) -> tuple[int, int]:
    """One step with every saved tensor counted: the bytes the forward kept for the
    backward, and the most any one block's forward kept (its own saved tensors)."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    per_block: dict[int, int] = {}
    current = [None]

    def note(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in saved:
            saved[ptr] = t.untyped_storage().nbytes()
            if current[0] is not None:
                per_block[current[0]] = per_block.get(current[0], 0) + saved[ptr]

    def pack(t):
        note(t)
        return t

    def enter(i):
        def hook(_module, inputs):
            if counting[0]:
                current[0] = i
                if checkpointed:  # the checkpoint holds the block's input to recompute from
                    note(inputs[0])
        return hook

    counting = [True]
    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(model.blocks)]
    handles.append(model.ln.register_forward_pre_hook(lambda *_: current.__setitem__(0, None)))
    try:
        optimizer.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        counting[0] = False  # the recompute in backward calls the blocks again
        loss.backward()
        optimizer.step()
    finally:
        for h in handles:
            h.remove()
    return sum(saved.values()), max(per_block.values(), default=0)


def measure_arm(arm: str, args) -> dict:
    """One round of one arm: saved MB, recompute MB, GPU peak MB and step ms."""
    import torch

    device = torch.device(args.device)
    model = build(args, device)
    model.set_activation_checkpointing(arm == "on")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(args, device)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for i in range(args.warmup):
        step(model, optimizer, data[i % len(data)], args.vocab_size)
    saved, block = count_saved(model, optimizer, data[0], args.vocab_size, arm == "on")
    peak = None
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        step(model, optimizer, data[1], args.vocab_size)
        sync()
        peak = torch.cuda.max_memory_allocated(device) / MB
    times = []
    for i in range(args.steps):
        sync()
        started = time.perf_counter()
        step(model, optimizer, data[i % len(data)], args.vocab_size)
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return {"saved_mb": saved / MB, "recompute_mb": block / MB if arm == "off" else None,
            "gpu_peak_mb": peak, "step_ms": statistics.median(times)}


def count_parameters(args) -> int:
    import torch

    model = build(args, torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def median_of(results: list[dict], key: str):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    params = count_parameters(args)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    per_round = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]  # neither arm always runs on a warmer machine
        for arm in order:
            results[arm].append(measure_arm(arm, args))
        off, on = results["off"][-1], results["on"][-1]
        per_round.append({"round": r + 1, "order": list(order), "arms": {"off": off, "on": on},
                          "saved_ratio": on["saved_mb"] / off["saved_mb"],
                          "gpu_peak_ratio": on["gpu_peak_mb"] / off["gpu_peak_mb"] if off["gpu_peak_mb"] else None,
                          "time_ratio": on["step_ms"] / off["step_ms"]})
    setup = (f"gpt {params / 1e6:.1f}M parameters (width {args.width}, depth {args.depth}, heads "
             f"{args.heads}), {args.batch_size} x {args.seq_len} tokens, AdamW, {args.device}, median of "
             f"{args.rounds} round(s)")
    saved = {arm: median_of(results[arm], "saved_mb") for arm in ARMS}
    peaks = {arm: median_of(results[arm], "gpu_peak_mb") for arm in ARMS}
    step_ms = {arm: median_of(results[arm], "step_ms") for arm in ARMS}
    recompute = median_of(results["off"], "recompute_mb")
    print(setup)
    print("| activation checkpointing | saved MB | GPU peak MB | step ms |")
    print("|---|---|---|---|")
    for arm in ARMS:
        peak = f"{peaks[arm]:,.0f}" if peaks[arm] is not None else ""
        print(f"| {arm} | {saved[arm]:,.1f} | {peak} | {step_ms[arm]:,.1f} |")
    paired_time = [r["time_ratio"] for r in per_round]
    paired_peak = [r["gpu_peak_ratio"] for r in per_round if r["gpu_peak_ratio"] is not None]
    print(f"on keeps {saved['on'] / saved['off']:.3f} x the saved bytes (a backward rebuilds about "
          f"{recompute or 0:,.1f} MB, one block, at a time); paired step time {statistics.median(paired_time):.3f} x")
    save_result(args, "activation_memory", {
        "setup": setup, "parameters": params, "device": args.device, "baseline": "off",
        "paired_rounds": args.rounds, "saved_mb": saved, "saved_ratio": saved["on"] / saved["off"],
        "recompute_mb": recompute, "gpu_peak_mb": peaks if peaks["off"] is not None else None,
        "paired_gpu_peak_ratio": statistics.median(paired_peak) if paired_peak else None,
        "step_ms": step_ms, "time_ratio": step_ms["on"] / step_ms["off"],
        "paired_time_ratio": statistics.median(paired_time),
        "paired_time_ratio_all": [round(t, 3) for t in paired_time],
    }, per_round, command=None if argv is None else ["python", "benchmarks/activation_memory.py", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
