"""DDP against FSDP on the same model and batches: peak memory per rank and samples/s.

The model is an mlp whose weights and AdamW state dominate memory (the default is 30M
parameters: 120 MB of weights, and with gradients and AdamW's two moments about 480 MB
of training state, which DDP holds whole on every rank and FSDP splits across them), or
with ``--model hf-llama`` a Llama-shaped Hugging Face model (``LlamaForCausalLM`` from a
config, random weights, saved with ``save_pretrained`` and trained as ``--model hf:DIR``
on synthetic token rows; 161M parameters by default), which FSDP shards by the blocks it
names in ``_no_split_modules``. Each arm is a `python -m ray_ddp train` subprocess; the
rounds alternate the arms.

- peak memory: the largest ``max_rss_mb`` of any rank in the metrics (a process's peak
  resident memory; on a GPU, use ``gpu_max_mb`` the same way: ``--gpus-per-worker 1``);
- samples/s: all ranks' samples after the first metrics window over rank 0's wall time
  for them, the median over the rounds;
- start-up and training peaks of rank 0 and of the other ranks (the largest of them):
  ``setup_max_rss_mb`` (the peak when the model, optimizer and checkpoint were ready,
  before the first step) and ``max_rss_mb``. Only rank 0 builds the whole model (#59):
  the others' start-up peak above the libraries' floor is given as a share of the
  model's fp32 bytes. The floor: the same run (strategy, workers, optimizer) of a tiny
  model of the same kind, once (``--hidden 64 --layers 2`` for hf-llama, ``--width 16
  --depth 2`` for the mlp).

    python benchmarks/fsdp_memory.py                     # the README's figures
    python benchmarks/fsdp_memory.py --width 512 --depth 2 --rounds 1   # seconds (CI)
    python benchmarks/fsdp_memory.py --model hf-llama --rounds 2        # needs transformers
    python benchmarks/fsdp_memory.py --model hf-llama --layers 22 --optimizer sgd --workers 4 --rounds 1

The figures also go to benchmarks/results/fsdp_memory-<machine>-<date>.json
(--results-dir, --no-save; see benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ARMS = ("ddp", "fsdp")


def write_llama(folder: str, args) -> int:
    """A Llama-shaped model saved as a Hugging Face folder, and token rows to train it on
    (``folder``/data); returns its parameter count."""
    import torch
    import transformers

    from ray_ddp.data.synth_files import write_synthetic

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=args.hidden * 11 // 4, num_attention_heads=8,
                                      num_key_value_heads=8, max_position_embeddings=args.seq_len)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(os.path.join(folder, "model"))
    write_synthetic(os.path.join(folder, "data"), rows=args.batch_size * args.workers * args.steps, features=1, targets=1,
                    task="lm", seq_len=args.seq_len, vocab_size=args.vocab, seed=0)
    return sum(p.numel() for p in model.parameters())


def tiny_args(args):
    """The floor's model: the same kind, almost no parameters."""
    return argparse.Namespace(**{**vars(args), "hidden": 64, "layers": 2, "width": 16, "depth": 2})


def model_args(args, folder: str) -> list[str]:
    if args.model == "hf-llama":
        return ["--model", f"hf:{folder}/model", "--data", f"{folder}/data", "--task", "lm",
                "--seq-len", str(args.seq_len)]
    return ["--model", "mlp", "--width", str(args.width), "--depth", str(args.depth), "--input-dim", "256",
            "--output-dim", "16"]


def run_arm(strategy: str, args, folder: str) -> dict:
    import pyarrow.parquet as pq

    storage = tempfile.mkdtemp(prefix="bench_fsdp_")
    steps = args.steps
    cmd = [sys.executable, "-m", "ray_ddp", "train", "--strategy", strategy, *model_args(args, folder),
           "--batch-size", str(args.batch_size), "--optimizer", args.optimizer,
           "--lr", "1e-4", "--epochs", "1", "--steps-per-epoch", str(steps),
           "--report-every", str(max(1, steps // 3)), "--workers", str(args.workers),
           "--gpus-per-worker", str(args.gpus_per_worker), "--skip-final-model",
           "--storage", storage, "--name", "run", "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "ran out of host memory" in proc.stdout + proc.stderr:
            print(f"{strategy}: ran out of host memory on {args.workers} workers")
            return {"out_of_memory": True}
        if proc.returncode != 0:
            raise SystemExit(f"{strategy} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = pq.read_table(os.path.join(storage, "run", "metrics.parquet")).to_pylist()
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    memory_key = "gpu_max_mb" if args.gpus_per_worker else "max_rss_mb"
    first = min(r["step"] for r in rows)
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    later = [r for r in rows if r["step"] > first]
    seconds = rank0[-1]["time"] - rank0[0]["time"]
    others = [r for r in rows if r["rank"] > 0]

    def most(key: str, of: list) -> float:
        return max((r[key] for r in of if r.get(key) is not None), default=0.0)

    return {"peak_mb": max(r[memory_key] for r in rows),
            "samples_per_s": sum(r["samples"] for r in later) / seconds,
            "rank0_setup_mb": most(f"setup_{memory_key}", rank0), "others_setup_mb": most(f"setup_{memory_key}", others),
            "rank0_peak_mb": most(memory_key, rank0), "others_peak_mb": most(memory_key, others)}


def _mb(value) -> str:
    return "out of memory" if value is None else f"{value:,.0f}"


def _share(value) -> str:
    return "" if value is None else f"{value:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "hf-llama"), default="mlp")
    parser.add_argument("--hidden", type=int, default=1024, help="hf-llama: hidden size")
    parser.add_argument("--layers", type=int, default=10, help="hf-llama: decoder layers")
    parser.add_argument("--vocab", type=int, default=16000, help="hf-llama: vocabulary")
    parser.add_argument("--seq-len", type=int, default=32, help="hf-llama: tokens per row")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=None, help="per worker (mlp: 32, hf-llama: 2)")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 2 if args.model == "hf-llama" else 32
    folder = tempfile.mkdtemp(prefix="bench_fsdp_model_")
    try:
        if args.model == "hf-llama":
            params = write_llama(folder, args)
            what = (f"hf Llama ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}) "
                    f"{params / 1e6:.1f}M parameters, {args.seq_len} tokens per row")
        else:
            params = 256 * args.width + (args.depth - 1) * args.width ** 2 + args.width * 16
            what = f"mlp {params / 1e6:.1f}M parameters"
        tiny_folder = os.path.join(folder, "tiny")
        os.makedirs(tiny_folder)
        if args.model == "hf-llama":
            write_llama(tiny_folder, tiny_args(args))
        floor = run_arm("fsdp", tiny_args(args), tiny_folder)
        results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                results[arm].append(run_arm(arm, args, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    where = f"{args.gpus_per_worker} GPU" if args.gpus_per_worker else "CPU"
    setup = (f"{what}, {'AdamW' if args.optimizer == 'adamw' else 'SGD (momentum)'}, {args.workers} workers ({where}), batch {args.batch_size} per worker, "
             f"median of {args.rounds} round(s)")
    print(setup)
    print("| strategy | peak memory per rank (MB) | samples/s |")
    print("|---|---|---|")
    fit = {arm: [r for r in results[arm] if not r.get("out_of_memory")] for arm in ARMS}  # a DDP that did not fit: none
    keys = ("peak_mb", "samples_per_s", "rank0_setup_mb", "others_setup_mb", "rank0_peak_mb", "others_peak_mb")
    med = {arm: {k: statistics.median(r[k] for r in fit[arm]) if fit[arm] else None for k in keys} for arm in ARMS}
    peaks = {arm: med[arm]["peak_mb"] for arm in ARMS}
    rates = {arm: med[arm]["samples_per_s"] for arm in ARMS}
    for arm in ARMS:
        print(f"| {arm} | {_mb(peaks[arm])} | {_mb(rates[arm])} |")
    both = peaks["ddp"] is not None and peaks["fsdp"] is not None
    if both:
        print(f"FSDP's peak is {peaks['fsdp'] / peaks['ddp']:.2f} x DDP's "
              f"({peaks['ddp'] - peaks['fsdp']:,.0f} MB less per rank)")
    model_mb = params * 4 / 2**20
    ranks = {arm: {k: med[arm][k] for k in keys[2:]} for arm in ARMS}

    def above_floor(arm: str, key: str):  # the other ranks' peak above the floor's, as a share of the model
        return None if med[arm][key] is None else (med[arm][key] - floor[key]) / model_mb

    shares = {arm: {"setup": above_floor(arm, "others_setup_mb"), "peak": above_floor(arm, "others_peak_mb")}
              for arm in ARMS}
    print(f"model {model_mb:,.0f} MB in fp32; floor (tiny model, fsdp): start-up {floor['others_setup_mb']:,.0f} MB, "
          f"peak {floor['others_peak_mb']:,.0f} MB on ranks > 0")
    print("| strategy | rank 0 start-up MB | ranks > 0 start-up MB | x model above floor | rank 0 peak MB "
          "| ranks > 0 peak MB | x model above floor |")
    print("|---|---|---|---|---|---|---|")
    for arm in ARMS:
        r = ranks[arm]
        print(f"| {arm} | {_mb(r['rank0_setup_mb'])} | {_mb(r['others_setup_mb'])} | {_share(shares[arm]['setup'])} "
              f"| {_mb(r['rank0_peak_mb'])} | {_mb(r['others_peak_mb'])} | {_share(shares[arm]['peak'])} |")
    # paired: each round's fsdp run against the ddp run just before it
    paired = [i for i in range(args.rounds) if not any(results[arm][i].get("out_of_memory") for arm in ARMS)]
    per_round = [{"round": i + 1, "order": list(ARMS), "arms": {arm: results[arm][i] for arm in ARMS},
                  "peak_ratio": results["fsdp"][i]["peak_mb"] / results["ddp"][i]["peak_mb"] if i in paired else None,
                  "samples_ratio": results["fsdp"][i]["samples_per_s"] / results["ddp"][i]["samples_per_s"]
                  if i in paired else None}
                 for i in range(args.rounds)]
    out_of_memory = ", ".join(arm for arm in ARMS if not fit[arm])  # the arms that did not fit this host
    save_result(args, "fsdp_memory", {
        "setup": setup, "model": args.model, "parameters": params, "baseline": "ddp", "paired_rounds": args.rounds,
        "memory": "gpu_max_mb" if args.gpus_per_worker else "max_rss_mb",
        "peak_mb": peaks, "samples_per_s": rates, "out_of_memory": out_of_memory,
        "peak_ratio": peaks["fsdp"] / peaks["ddp"] if both else None,
        "peak_saved_mb": peaks["ddp"] - peaks["fsdp"] if both else None,
        "paired_peak_ratio": statistics.median(per_round[i]["peak_ratio"] for i in paired) if paired else None,
        "samples_ratio": rates["fsdp"] / rates["ddp"] if both else None,
        "paired_samples_ratio": statistics.median(per_round[i]["samples_ratio"] for i in paired) if paired else None,
        "workers": args.workers, "optimizer": args.optimizer, "model_mb": model_mb, "floor": floor, "ranks": ranks,
        "others_setup_share": {arm: shares[arm]["setup"] for arm in ARMS},
        "others_peak_share": {arm: shares[arm]["peak"] for arm in ARMS},
    }, per_round, command=None if argv is None else ["python", "benchmarks/fsdp_memory.py", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
