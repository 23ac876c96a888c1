"""ray-ddp against torchrun and plain Ray Train: one workload, one machine, one run.

Runs on the machine it measures (the driver of each arm is a subprocess of this script):
  torchrun   torchrun --standalone over benchmarks/workload.py (the baseline)
  ray-train  benchmarks/plain_ray_train.py: TorchTrainer + prepare_model, a report each
             "epoch" of --plain-report-every steps, as Ray's documentation shows
  ray-ddp    `python -m ray_ddp train --model mlp ...` with the same sizes
  ray-ddp-every-step   the same with --report-every 1: a metrics row every step, which
             bounds what metrics cost (not in the default arms)
  ray-ddp-plain-ddp    the same with --plain-ddp: DDP's defaults, as the torchrun script
             has them (no gradient_as_bucket_view; not in the default arms)
  ray-ddp-static-graph, ray-ddp-bucket-5, ray-ddp-bucket-100   the same with DDP's other
             fast paths: --static-graph, --bucket-mb 5 or 100 (not in the default arms)
Each arm trains the same MLP with the same batch per worker for --warmup + --steps
steps; rounds repeat the arms in rotated order and the table takes each figure's median.

  steady samples/s   all workers' samples over the timed steps / rank 0's wall time for
                     them (from the end of step --warmup to the end of the last step)
  first step s       from launching the arm's command to the end of rank 0's first step
  wall s             the arm's whole command, start to exit
  peak MiB/worker    the largest worker process's peak RSS (and GPU peak, on GPUs)
  paired             the median over rounds of the arm's steady samples/s / torchrun's in
                     the same round (paired rounds cancel some of a noisy machine's drift)

    python benchmarks/throughput.py                       # the README's table
    python benchmarks/throughput.py --workers 1,2         # scaling, 1 vs 2 workers
    python benchmarks/throughput.py --json results.json   # also keep the raw figures
    python benchmarks/throughput.py --preset gpu          # on a GPU machine: ray-ddp vs torchrun, bf16
The figures also go to benchmarks/results/throughput-<machine>-<date>.json (--results-dir,
--no-save; see benchmarks/_results.py), from which docs/performance.md is rendered.
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
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _results import add_result_args, rounds_by, save_result  # noqa: E402
from workload import add_workload_args  # noqa: E402

# each ray-ddp arm: the ray-ddp command with these flags added
RAY_DDP_ARMS = {
    "ray-ddp": [], "ray-ddp-every-step": ["--report-every", "1"], "ray-ddp-plain-ddp": ["--plain-ddp"],
    "ray-ddp-static-graph": ["--static-graph"], "ray-ddp-bucket-5": ["--bucket-mb", "5"],
    "ray-ddp-bucket-100": ["--bucket-mb", "100"],
}
ARMS = ("torchrun", "ray-train", *RAY_DDP_ARMS)
DEFAULT_ARMS = ARMS[:3]


def sizes(args) -> list[str]:
    return ["--width", str(args.width), "--depth", str(args.depth), "--input-dim", str(args.input_dim),
            "--output-dim", str(args.output_dim), "--batch-size", str(args.batch_size), "--amp", args.amp]


# `--preset gpu`: does ray-ddp cost anything on a GPU? A model that keeps one GPU busy, in
# bf16, ray-ddp against plain DDP under torchrun, one worker per GPU. Without CUDA the same
# command runs small sizes on the CPU. Flags given on the command line win over a preset.
GPU_PRESET = dict(width=4096, depth=8, input_dim=4096, output_dim=4096, batch_size=256, amp="bf16",
                  arms="torchrun,ray-ddp", warmup=20, steps=200)
CPU_FALLBACK = dict(width=256, depth=2, input_dim=256, output_dim=16, batch_size=64, warmup=10, steps=50)


def preset_defaults(argv) -> dict:
    """The defaults a ``--preset`` in ``argv`` sets (before the real parse)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=("gpu",))
    known, _ = pre.parse_known_args(argv)
    if known.preset != "gpu":
        return {}
    import torch

    if not torch.cuda.is_available():
        return {**GPU_PRESET, **CPU_FALLBACK}
    return {**GPU_PRESET, "workers": str(torch.cuda.device_count()), "gpus_per_worker": 1}


def arm_command(arm: str, args, workers: int, out: str) -> list[str]:
    py = sys.executable
    common = sizes(args) + ["--lr", str(args.lr), "--seed", str(args.seed)]
    timed = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    if arm == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                os.path.join(HERE, "workload.py"), *common, *timed, "--out", out]
    if arm == "ray-train":
        return [py, os.path.join(HERE, "plain_ray_train.py"), *common, *timed, "--out", out,
                "--workers", str(workers), "--gpus-per-worker", str(args.gpus_per_worker),
                "--report-every", str(args.plain_report_every), "--storage", os.path.join(out, "storage")]
    if arm in RAY_DDP_ARMS:
        return [py, "-m", "ray_ddp", "train", "--model", "mlp", *common, "--optimizer", "sgd",
                "--epochs", "1", "--steps-per-epoch", str(args.warmup + args.steps),
                "--report-every", str(args.report_every), *RAY_DDP_ARMS[arm], "--workers", str(workers),
                "--gpus-per-worker", str(args.gpus_per_worker), "--storage", out, "--name", "run",
                "--quiet", "--json"]
    raise ValueError(arm)


def read_worker_results(arm: str, out: str, args) -> list[dict]:
    """Every rank's timings: the JSON files the baselines write, or ray-ddp's own
    metrics table (the report at step --warmup starts the clock)."""
    if not arm.startswith("ray-ddp"):
        return [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))
                if f.startswith("rank_")]
    import pyarrow.parquet as pq

    rows = pq.read_table(os.path.join(out, "run", "metrics.parquet")).to_pylist()
    results = []
    for rank in sorted({r["rank"] for r in rows}):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
        at = {r["step"]: r["time"] for r in mine}
        results.append({
            "rank": rank, "world_size": mine[0]["world_size"], "steps": args.steps,
            "batch_size": args.batch_size, "first_step_at": mine[0]["first_step_at"],
            "warm_at": at[args.warmup], "end_at": at[args.warmup + args.steps],
            "max_rss_mb": max(r["max_rss_mb"] for r in mine),
            "gpu_max_mb": max((r["gpu_max_mb"] or 0) for r in mine) or None,
        })
    return results


def run_arm(arm: str, args, workers: int) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench_{arm}_")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray on loopback, as ray-ddp's
    launched = time.time()
    proc = subprocess.run(arm_command(arm, args, workers, out), env=env, capture_output=True, text=True)
    wall = time.time() - launched
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise SystemExit(f"{arm} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    ranks = read_worker_results(arm, out, args)
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if arm.startswith("ray-ddp") else None
    shutil.rmtree(out, ignore_errors=True)
    rank0 = min(ranks, key=lambda r: r["rank"])
    gpu = [r.get("gpu_max_mb") for r in ranks if r.get("gpu_max_mb")]
    return {
        "arm": arm, "workers": workers,
        "samples_per_s": workers * args.batch_size * args.steps / (rank0["end_at"] - rank0["warm_at"]),
        "first_step_s": rank0["first_step_at"] - launched,
        "wall_s": wall,
        "peak_rss_mb": max(r["max_rss_mb"] for r in ranks),
        "peak_gpu_mb": max(gpu) if gpu else None,
        "startup_s": summary.get("startup_s") if summary else None,
    }


def median_by_arm(results: list[dict]) -> dict[tuple, dict]:
    grouped: dict[tuple, list[dict]] = {}
    for r in results:
        grouped.setdefault((r["workers"], r["arm"]), []).append(r)
    baseline = {(r["round"], r["workers"]): r["samples_per_s"] for r in results if r["arm"] == "torchrun"}
    table = {}
    for key, runs in grouped.items():
        row = {"arm": key[1], "workers": key[0], "rounds": len(runs)}
        for field in ("samples_per_s", "first_step_s", "wall_s", "peak_rss_mb", "peak_gpu_mb"):
            values = [r[field] for r in runs if r[field] is not None]
            row[field] = statistics.median(values) if values else None
        row["samples_per_s_all"] = [round(r["samples_per_s"], 1) for r in runs]
        paired = [r["samples_per_s"] / baseline[(r["round"], r["workers"])] for r in runs
                  if (r["round"], r["workers"]) in baseline]
        row["paired_ratio"] = statistics.median(paired) if paired else None
        row["paired_ratio_all"] = [round(p, 3) for p in paired]
        table[key] = row
    return table


def render_table(table: dict[tuple, dict]) -> str:
    lines = ["| workers | arm | steady samples/s | x torchrun | paired | first step s | x torchrun | wall s "
             "| x torchrun | peak MiB/worker | x torchrun |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workers, arm), row in sorted(table.items(), key=lambda kv: (kv[0][0], ARMS.index(kv[0][1]))):
        base = table.get((workers, "torchrun"))

        def ratio(field: str) -> str:
            if base is None or not base[field] or row[field] is None:
                return ""
            return f"{row[field] / base[field]:.3f}"

        mem = f"{row['peak_rss_mb']:.0f}" + (f" (GPU {row['peak_gpu_mb']:.0f})" if row["peak_gpu_mb"] else "")
        paired = f"{row['paired_ratio']:.3f}" if row["paired_ratio"] is not None else ""
        lines.append(f"| {workers} | {arm} | {row['samples_per_s']:.0f} | {ratio('samples_per_s')} "
                     f"| {paired} | {row['first_step_s']:.1f} | {ratio('first_step_s')} | {row['wall_s']:.1f} "
                     f"| {ratio('wall_s')} | {mem} | {ratio('peak_rss_mb')} |")
    return "\n".join(lines)


def render_scaling(table: dict[tuple, dict]) -> Optional[str]:
    counts = sorted({w for w, _ in table})
    if len(counts) < 2:
        return None
    lo, hi = counts[0], counts[-1]
    lines = [f"scaling efficiency, {lo} -> {hi} workers (samples/s ratio / {hi // lo}):"]
    for arm in ARMS:
        if (lo, arm) in table and (hi, arm) in table:
            eff = table[(hi, arm)]["samples_per_s"] / table[(lo, arm)]["samples_per_s"] / (hi / lo)
            lines.append(f"  {arm}: {eff:.2f}")
    return "\n".join(lines)


def describe_machine(args) -> str:
    import platform

    import torch

    where = "CPU, gloo"
    if args.gpus_per_worker:
        where = f"{torch.cuda.get_device_name(0)}, nccl"
    return (f"{platform.node() or 'this machine'}: {os.cpu_count()} CPUs, {where}; python "
            f"{platform.python_version()}, torch {torch.__version__}; MLP {args.input_dim}-"
            f"{'x'.join([str(args.width)] * args.depth)}-{args.output_dim}"
            f"{', bf16' if args.amp == 'bf16' else ''}, batch {args.batch_size}/worker, "
            f"{args.warmup} warm-up + {args.steps} timed steps, ray-ddp --report-every {args.report_every}, "
            f"plain Ray Train reports every {args.plain_report_every} steps")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--workers", default="2", help="worker counts to measure, e.g. 1,2")
    parser.add_argument("--gpus-per-worker", type=int, default=None,
                        help="default: 1 if CUDA is available, else 0 (CPU, gloo)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"which of {','.join(ARMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="repeats of every arm; medians are shown")
    parser.add_argument("--report-every", type=int, default=10, help="ray-ddp's --report-every")
    parser.add_argument("--plain-report-every", type=int, default=110,
                        help="steps per ray.train.report in the plain Ray Train arm (its 'epoch')")
    parser.add_argument("--json", help="write every round's raw figures here")
    add_result_args(parser)
    parser.add_argument("--preset", choices=("gpu",),
                        help="gpu: an mlp 4096-4096x8-4096 in bf16, batch 256, ray-ddp against "
                             "torchrun on every GPU (small sizes on a machine without CUDA)")
    parser.set_defaults(**preset_defaults(argv))
    args = parser.parse_args(argv)
    if args.gpus_per_worker is None:
        import torch

        args.gpus_per_worker = 1 if torch.cuda.is_available() else 0
    if args.warmup % args.report_every or args.steps % args.report_every:
        raise SystemExit("--warmup and --steps must be multiples of --report-every "
                         "(ray-ddp's clock reads the metrics rows)")
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    worker_counts = [int(w) for w in args.workers.split(",")]

    results = []
    for round_no in range(args.rounds):
        for workers in worker_counts:
            shift = round_no % len(arms)  # rotate the order: no arm always runs first
            for arm in arms[shift:] + arms[:shift]:
                r = {**run_arm(arm, args, workers), "round": round_no}
                results.append(r)
                print(f"round {round_no + 1}/{args.rounds} workers {workers} {arm}: "
                      f"{r['samples_per_s']:.0f} samples/s, first step {r['first_step_s']:.1f} s, "
                      f"wall {r['wall_s']:.1f} s" + (f", startup {r['startup_s']}" if r["startup_s"] else ""),
                      flush=True)
    table = median_by_arm(results)
    print()
    print(describe_machine(args))
    print(render_table(table))
    scaling = render_scaling(table)
    if scaling:
        print(scaling)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(args), "args": vars(args), "rounds": results,
                       "median": list(table.values())}, f, indent=1)
    command = None if argv is None else ["python", "benchmarks/throughput.py", *argv]
    save_result(args, "throughput", summarize(table, args), paired_rounds(results), command=command)


def summarize(table: dict[tuple, dict], args) -> dict:
    """The table's figures: per (workers, arm) the medians, the ratio of the medians to
    torchrun's and the paired ratio (the median of each round's ratio)."""
    arms = []
    for (workers, arm), row in sorted(table.items(), key=lambda kv: (kv[0][0], ARMS.index(kv[0][1]))):
        base = table.get((workers, "torchrun"))
        arms.append({
            "workers": workers, "arm": arm,
            "samples_per_s": row["samples_per_s"],
            "baseline_samples_per_s": base["samples_per_s"] if base else None,
            "x_baseline": row["samples_per_s"] / base["samples_per_s"] if base else None,
            "paired_ratio": row["paired_ratio"], "paired_ratio_all": row["paired_ratio_all"],
            "first_step_s": row["first_step_s"], "wall_s": row["wall_s"],
            "peak_rss_mb": row["peak_rss_mb"], "peak_gpu_mb": row["peak_gpu_mb"],
        })
    counts = sorted({w for w, _ in table})
    scaling = {}
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        scaling = {arm: table[(hi, arm)]["samples_per_s"] / table[(lo, arm)]["samples_per_s"] / (hi / lo)
                   for arm in ARMS if (lo, arm) in table and (hi, arm) in table}
    return {"setup": describe_machine(args), "baseline": "torchrun", "paired_rounds": args.rounds,
            "arms": arms, "scaling": scaling}


def paired_rounds(results: list[dict]) -> list[dict]:
    """One entry per round and worker count: every arm's figures, and each arm's samples/s
    over torchrun's in that round."""
    rounds = rounds_by(results, keys=("round", "workers"))
    for entry in rounds:
        base = entry["arms"].get("torchrun")
        entry["paired_ratio"] = {arm: r["samples_per_s"] / base["samples_per_s"]
                                 for arm, r in entry["arms"].items()} if base else {}
    return rounds


if __name__ == "__main__":
    main()
