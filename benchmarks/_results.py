"""A benchmark's result as data: one JSON file per run in ``benchmarks/results/``.

Every top-level benchmark ends with ``write_result`` (through ``save_result``): what it
printed, as figures, beside where and on what it ran. ``scripts/render_benchmarks.py``
renders docs/performance.md's tables from these files, and
``tests/unit/test_benchmarks_render.py`` keeps the page in sync with them.

A file is ``benchmarks/results/<bench>-<machine>-<date>.json`` and holds:

  bench     the script's name (``throughput``, ``ray_cpu``, ...)
  machine   a short slug of the hardware: ``<arch>-<cores>cpu``, plus
            ``-gpu-<name>`` (``-gpu-<n>x-<name>`` for n > 1) where CUDA is present
  cores     ``os.cpu_count()``
  date      the UTC date of the run, ISO (``2026-12-01``)
  commit    ``{"sha": <git rev-parse HEAD>, "dirty": <anything changed but results/>}``
  command   the argv that ran, as a list (``["python", "benchmarks/throughput.py", ...]``)
  env       the settings in the environment that the benchmarks or Ray read (``RAY_*``,
            thread counts, ``CUDA_VISIBLE_DEVICES``), nothing named like a secret
  versions  ``{"python", "torch", "ray"}`` (None for a package that is not installed)
  result    the summary figures the script printed (medians, ratios to the baseline,
            paired ratios)
  rounds    every paired round's figures, one entry per round (``round`` counts from 1)
  written_at  the UTC time the file was written

A second run on the same machine and day never overwrites the first: it gets the next
free suffix, ``<bench>-<machine>-<date>-2.json``, ``-3``, ... (a result is a
measurement; keeping both shows the run-to-run spread). Delete a file to retract it.

Figures transcribed from the README's hand-pasted tables also carry
``"source": "README.md at commit <sha> (transcribed)"`` and ``"rounds_recorded": false``:
their ``rounds`` hold only what the README stated per round, if anything.

As a command (for benchmarks/ray_cpu.sh):

    python benchmarks/_results.py --bench ray_cpu --result-file totals.json \\
        --command 'WORKERS=1 bash benchmarks/ray_cpu.sh' [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")

# every result file has these keys (tests/unit/test_benchmarks_render.py checks them)
REQUIRED_KEYS = ("bench", "machine", "cores", "date", "commit", "command", "versions", "result", "rounds")
# what of the environment is worth keeping: what Ray and the thread pools read
ENV_PREFIXES = ("RAY_",)
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpus() -> tuple[int, str | None]:
    """How many CUDA devices there are, and the first one's name (0, None without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0, None
    if not torch.cuda.is_available():
        return 0, None
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def machine_slug() -> str:
    name = f"{platform.machine() or 'unknown'}-{os.cpu_count()}cpu"
    count, gpu = gpus()
    if count:
        name += f"-gpu-{count}x-{slug(gpu)}" if count > 1 else f"-gpu-{slug(gpu)}"
    return name


def git_commit() -> dict:
    """HEAD's sha, and whether anything but the results folder differs from it (tracked
    changes or untracked, not ignored, files). ``sha`` is None outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return {"sha": sha.strip() if sha else None, "dirty": None if status is None else bool(status.strip())}


def version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def this_command() -> list[str]:
    """The argv that ran, the script as a path from the repository root where it is in it."""
    argv = list(sys.argv)
    if argv and argv[0]:
        script = os.path.abspath(argv[0])
        if script.startswith(REPO + os.sep):
            argv[0] = os.path.relpath(script, REPO)
    return ["python", *argv]


def kept_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items())
            if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and not SECRET.search(k)}


def result_path(out_dir: str, bench: str, machine: str, date: str, seq: int) -> str:
    suffix = "" if seq == 1 else f"-{seq}"
    return os.path.join(out_dir, f"{bench}-{machine}-{date}{suffix}.json")


def write_result(bench: str, result: dict, rounds: list[dict], out_dir: str | None = None,
                 command: list[str] | None = None) -> str:
    """Write one run's result as ``<out_dir>/<bench>-<machine>-<date>.json`` (the next free
    ``-2``, ``-3``, ... suffix if that day's file exists) and return its path.

    ``result``: the summary figures; ``rounds``: one dict per paired round; ``command``:
    the argv that ran (default: this process's, see ``this_command``)."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_slug()
    record = {
        "bench": bench,
        "machine": machine,
        "cores": os.cpu_count(),
        "date": now.date().isoformat(),
        "commit": git_commit(),
        "command": list(command) if command is not None else this_command(),
        "env": kept_env(),
        "versions": {"python": platform.python_version(), "torch": version("torch"), "ray": version("ray")},
        "result": result,
        "rounds": rounds,
        "written_at": now.isoformat(timespec="seconds"),
    }
    text = json.dumps(record, indent=1, sort_keys=False, default=float) + "\n"
    seq = 1
    while True:
        path = result_path(out_dir, bench, machine, record["date"], seq)
        try:
            with open(path, "x") as f:  # never overwrite: a rerun takes the next suffix
                f.write(text)
            return path
        except FileExistsError:
            seq += 1


def add_result_args(parser: argparse.ArgumentParser) -> None:
    """``--results-dir`` and ``--no-save``, for every benchmark that writes a result."""
    parser.add_argument("--results-dir", default=RESULTS_DIR,
                        help="where the result file goes (default: benchmarks/results/)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no result file")


def save_result(args, bench: str, result: dict, rounds: list[dict],
                command: list[str] | None = None) -> str | None:
    """``write_result`` unless ``--no-save``; says where the file went on stderr (stdout
    keeps the benchmark's own output)."""
    if getattr(args, "no_save", False):
        return None
    path = write_result(bench, result, rounds, out_dir=args.results_dir, command=command)
    shown = os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path
    print(f"result written to {shown}", file=sys.stderr)
    return path


def rounds_by(runs: list[dict], keys: tuple[str, ...] = ("round",), arm_key: str = "arm") -> list[dict]:
    """Per-run figure dicts (each with ``round`` counting from 0 and an ``arm``) as one
    entry per round (and per the other ``keys``): ``{"round": n (from 1), ..., "order":
    [arms in the order they ran], "arms": {arm: its figures}}``."""
    grouped: dict[tuple, dict] = {}
    for run in runs:
        key = tuple(run[k] for k in keys)
        entry = grouped.setdefault(key, {**{k: run[k] for k in keys}, "order": [], "arms": {}})
        entry["order"].append(run[arm_key])
        entry["arms"][run[arm_key]] = {k: v for k, v in run.items() if k not in keys and k != arm_key}
    out = list(grouped.values())
    for entry in out:
        entry["round"] += 1
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="write a result file from a shell benchmark's figures")
    parser.add_argument("--bench", required=True)
    parser.add_argument("--result-file", required=True,
                        help="a JSON object: the figures of one measurement, which is also its one round "
                             "(unless the object has its own 'rounds' list)")
    parser.add_argument("--command", required=True, help="the command that ran, as a shell line")
    add_result_args(parser)
    args = parser.parse_args(argv)
    with open(args.result_file) as f:
        result = json.load(f)
    rounds = result.pop("rounds", None)
    if rounds is None:
        rounds = [{"round": 1, **{k: v for k, v in result.items() if k != "setup"}}]
    save_result(args, args.bench, result, rounds, command=shlex.split(args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def paired_arms(results: list[dict], arms: list[str], baseline: str, rounds: int) -> tuple[list[dict], list[dict]]:
    """Runs of {"arm", "round" (from 0), "samples_per_s", "wall_s"} as (one entry per round
    with each arm's figures and its paired ratio to ``baseline`` in that round, one row
    per arm: medians, the ratio of medians, the median paired ratio and every round's)."""
    import statistics

    per_round = []
    for round_no in range(rounds):
        mine = [r for r in results if r["round"] == round_no]
        runs = {r["arm"]: {"samples_per_s": r["samples_per_s"], "wall_s": r["wall_s"]} for r in mine}
        per_round.append({"round": round_no + 1, "order": [r["arm"] for r in mine], "arms": runs,
                          "paired_ratio": {a: runs[a]["samples_per_s"] / runs[baseline]["samples_per_s"]
                                           for a in runs}})
    median = {a: statistics.median(r["samples_per_s"] for r in results if r["arm"] == a) for a in arms}
    rows = []
    for arm in arms:
        paired = [r["paired_ratio"][arm] for r in per_round]
        rows.append({"arm": arm, "samples_per_s": median[arm], "baseline_samples_per_s": median[baseline],
                     "x_baseline": median[arm] / median[baseline], "paired_ratio": statistics.median(paired),
                     "paired_ratio_all": paired,
                     "wall_s": statistics.median(r["wall_s"] for r in results if r["arm"] == arm)})
    return per_round, rows
