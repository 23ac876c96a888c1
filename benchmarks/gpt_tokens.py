"""Tokens/s of the ``gpt`` task: ray-ddp against plain PyTorch DDP under torchrun, the
same model and the same batches, side by side in one run (rounds alternate the order;
the table shows medians and each round's figures).

Both arms train ray_ddp's GPT on a token table written by ``ray-ddp data synth --task lm``
for --warmup + --steps steps of --batch-size sequences per worker; the clock runs from the
end of step --warmup to the end of the last step (ray-ddp: its metrics rows at those
steps; torchrun: rank 0's own clock).

    python benchmarks/gpt_tokens.py                     # 2 CPU workers, small sizes
    python benchmarks/gpt_tokens.py --width 512 --depth 8 --seq-len 256 --batch-size 32   # a GPU
    python benchmarks/gpt_tokens.py --hf                # a Hugging Face GPT-2 on its own loss
    python benchmarks/gpt_tokens.py --hf --gpus-per-worker 1 --workers 1 --width 768 --depth 12 \
        --heads 12 --seq-len 512 --vocab-size 50257 --batch-size 8   # GPT-2 small on a GPU

With ``--hf`` both arms train a ``transformers`` GPT2LMHeadModel of the same sizes (a
``save_pretrained`` folder made here) on its own loss, from rows as Hugging Face users hold
them: a ``datasets`` ``save_to_disk`` folder of ``{input_ids, labels}`` (ray-ddp: ``--model
hf:DIR --data ROWS``; torchrun: ``model(input_ids=..., labels=...).loss``).
The figures also go to benchmarks/results/gpt_tokens-<machine>-<date>.json (--results-dir,
--no-save; see benchmarks/_results.py).
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

HERE = os.path.dirname(os.path.abspath(__file__))


def sizes(args) -> list[str]:
    return ["--width", str(args.width), "--depth", str(args.depth), "--heads", str(args.heads),
            "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr)]


def run_arm(arm: str, args, data: str) -> float:
    """One round of one arm: its tokens/s over the timed steps."""
    out = tempfile.mkdtemp(prefix=f"bench_gpt_{arm}_")
    total = args.warmup + args.steps
    if arm == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.workers}", os.path.join(HERE, "gpt_workload.py"), "--data", data,
               "--out", out, *sizes(args), "--warmup", str(args.warmup), "--steps", str(args.steps),
               *(["--hf-model", os.path.join(data, "model")] if args.hf else [])]
    else:
        model = ["--model", f"hf:{os.path.join(data, 'model')}", "--data", os.path.join(data, "rows")] if args.hf \
            else ["--data", data, "--task", "lm", "--model", "gpt", *sizes(args)]
        cmd = [sys.executable, "-m", "ray_ddp", "train", *model, "--batch-size", str(args.batch_size),
               "--lr", str(args.lr), "--optimizer", "adamw", "--epochs", "1", "--workers", str(args.workers),
               "--report-every", str(args.warmup), "--storage", out, "--name", "run", "--quiet", "--json",
               "--gpus-per-worker", str(args.gpus_per_worker)]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    if arm == "torchrun":
        # one intra-op thread per rank, as ray-ddp's workers run (one per reserved CPU):
        # torchrun sets this itself only for more than one process per node
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    if arm == "torchrun":
        rank0 = json.load(open(os.path.join(out, "rank_0.json")))
        seconds = rank0["end_at"] - rank0["warm_at"]
    else:
        import pyarrow.parquet as pq

        rows = [r for r in pq.read_table(os.path.join(out, "run", "metrics.parquet")).to_pylist() if r["rank"] == 0]
        at = {r["step"]: r["time"] for r in rows}
        seconds = at[total] - at[args.warmup]
    shutil.rmtree(out, ignore_errors=True)
    return args.workers * args.batch_size * args.seq_len * args.steps / seconds


def write_hf(data: str, rows: int, args) -> None:
    """DATA/model: a GPT2LMHeadModel of the benchmark's sizes (save_pretrained); DATA/rows:
    ``rows`` sequences of random tokens as a datasets save_to_disk folder of
    {input_ids, labels} (labels = input_ids: the model shifts them)."""
    import datasets
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab_size, n_positions=args.seq_len, n_embd=args.width,
                               n_layer=args.depth, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0)).save_pretrained(os.path.join(data, "model"))
    ids = torch.randint(args.vocab_size, (rows, args.seq_len), generator=torch.Generator().manual_seed(1)).tolist()
    datasets.Dataset.from_dict({"input_ids": ids, "labels": ids}).save_to_disk(os.path.join(data, "rows"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="timed steps, a multiple of --warmup")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus-per-worker", type=int, default=0,
                        help="1: each worker on a GPU (torchrun's ranks take one each whenever CUDA is there)")
    parser.add_argument("--hf", action="store_true",
                        help="a Hugging Face GPT2LMHeadModel on its own loss, rows from a datasets folder")
    sys.path.insert(0, HERE)
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args()
    if args.steps % args.warmup:
        raise SystemExit("--steps must be a multiple of --warmup (ray-ddp's clock reads its metrics rows)")
    from ray_ddp.data.synth_files import write_synthetic

    data = tempfile.mkdtemp(prefix="bench_gpt_data_")
    # exactly one epoch of steps, so ray-ddp's derived steps per epoch equal the arms' steps
    rows = args.workers * args.batch_size * (args.warmup + args.steps)
    if args.hf:
        write_hf(data, rows, args)
    else:
        write_synthetic(data, rows=rows, features=1, targets=1, task="lm", seq_len=args.seq_len,
                        vocab_size=args.vocab_size)
    results: dict[str, list[float]] = {"torchrun": [], "ray-ddp": []}
    for round_no in range(args.rounds):
        arms = ["torchrun", "ray-ddp"] if round_no % 2 == 0 else ["ray-ddp", "torchrun"]
        for arm in arms:
            results[arm].append(run_arm(arm, args, data))
            print(f"round {round_no + 1}/{args.rounds} {arm}: {results[arm][-1]:,.0f} tokens/s", flush=True)
    shutil.rmtree(data, ignore_errors=True)
    base = statistics.median(results["torchrun"])
    name = "hf GPT2LMHeadModel (its own loss, datasets rows)" if args.hf else "gpt"
    where = f"{args.workers} workers on GPUs" if args.gpus_per_worker else f"{args.workers} workers"
    setup = (f"{name} {args.width}x{args.depth} (heads {args.heads}), seq {args.seq_len}, "
             f"{args.batch_size} sequences/worker, {where}, {os.cpu_count()} CPUs")
    print(f"\n{setup}")
    print("| arm | tokens/s (median) | x torchrun | rounds |")
    print("|---|---|---|---|")
    for arm in ("torchrun", "ray-ddp"):
        med = statistics.median(results[arm])
        print(f"| {arm} | {med:,.0f} | {med / base:.3f} | {', '.join(f'{v:,.0f}' for v in results[arm])} |")
    # paired: each round's ray-ddp run against the torchrun run beside it
    paired = [d / t for t, d in zip(results["torchrun"], results["ray-ddp"])]
    per_round = [{"round": i + 1, "order": ["torchrun", "ray-ddp"] if i % 2 == 0 else ["ray-ddp", "torchrun"],
                  "arms": {arm: {"tokens_per_s": results[arm][i]} for arm in results}, "paired_ratio": paired[i]}
                 for i in range(args.rounds)]
    save_result(args, "gpt_tokens", {
        "setup": setup,
        "baseline": "torchrun", "paired_rounds": args.rounds,
        "tokens_per_s": {arm: statistics.median(v) for arm, v in results.items()},
        "ratio": statistics.median(results["ray-ddp"]) / base,
        "paired_ratio": statistics.median(paired), "paired_ratio_all": paired,
    }, per_round)


if __name__ == "__main__":
    main()
