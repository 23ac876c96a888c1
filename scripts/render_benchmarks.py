"""Render docs/performance.md's result tables (and docs/testing.md's, for the suite's own
time) from benchmarks/results/*.json.

Each benchmark has one section in its page, between two marker lines:

    <!-- bench:throughput:start -->
    ... (generated: do not edit by hand) ...
    <!-- bench:throughput:end -->

and everything between them is rewritten from the result files of that benchmark
(``"bench": "throughput"``): one table, every result, newest first (by date, then by the
file's same-day suffix), each row giving the date, machine, cores, commit, the command that
ran (its arguments and environment settings: the script is the section's), the headline
figures of ``result`` and how many paired rounds it holds. A section
with no result file says so and gives the command to run. Text outside the markers is
the page's own and is left alone.

    .venv/bin/python scripts/render_benchmarks.py           # rewrite the pages
    .venv/bin/python scripts/render_benchmarks.py --check   # exit 1 if a page is stale

Exit status: 0 in sync (or rewritten), 1 stale under --check, 2 a result file or the
page is malformed (a file without the required keys, a bench with no section).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _results import REQUIRED_KEYS  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCS = os.path.join(ROOT, "docs")
PAGE = os.path.join(DOCS, "performance.md")
SECTION = re.compile(r"(<!-- bench:([a-z0-9_]+):start -->\n)(.*?)(<!-- bench:\2:end -->)", re.DOTALL)
FILE_NAME = re.compile(r"-(\d{4}-\d{2}-\d{2})(?:-(\d+))?\.json$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class Malformed(Exception):
    """A result file or the page is not what the renderer can render."""


def _num(digits: int) -> Callable:
    return lambda v: f"{v:.{digits}f}"


def _list(digits: int) -> Callable:
    return lambda v: ", ".join(f"{x:.{digits}f}" for x in v)


FORMATS: dict[str, Callable] = {
    "n0": _num(0), "n1": _num(1), "n2": _num(2), "r3": _num(3),
    "r3list": _list(3), "n1list": _list(1),
    "M": lambda v: f"{v / 1e6:.1f}M",
    "str": str,
    "strlist": lambda v: ", ".join(f"`{x}`" for x in v) if v else "Ray's defaults",
}


EXACT = {"n0", "n1", "n2", "r3", "r3list", "n1list"}


def as_stated(v) -> str:
    """A transcribed figure as the README gave it: no digits added (0.94, not 0.940)."""
    if isinstance(v, list):
        return ", ".join(as_stated(x) for x in v)
    return repr(v) if isinstance(v, float) else str(v)


@dataclasses.dataclass
class Table:
    columns: list[tuple[str, str, str]]  # (header, key path in the row, format)
    rows: str | None = None           # a list in ``result`` giving a row each; None: one row per file
    skip_baseline: bool = False          # leave out the row whose arm is result["baseline"]
    when: str | None = None           # a key path: only files where it is set get a row
    row_when: str | None = None       # a key path in a row: only rows where it is set
    title: str | None = None


@dataclasses.dataclass
class Bench:
    rerun: str
    tables: list[Table]
    page: str = "performance.md"  # the page under docs/ that holds its section


BENCHES: dict[str, Bench] = {
    "throughput": Bench("python benchmarks/throughput.py --workers 1,2 --rounds 3", [Table(
        rows="arms", skip_baseline=True, columns=[
        ("workers", "workers", "str"), ("arm", "arm", "str"), ("steady samples/s", "samples_per_s", "n0"),
        ("torchrun samples/s", "baseline_samples_per_s", "n0"), ("x torchrun", "x_baseline", "r3"),
        ("paired", "paired_ratio", "r3"), ("paired per round", "paired_ratio_all", "r3list")])]),
    "checkpoint_stall": Bench("python benchmarks/checkpoint_stall.py --rounds 3", [Table(columns=[
        ("parameters", "parameters", "M"), ("no checkpoints samples/s", "samples_per_s.no checkpoints", "n1"),
        ("checkpoint every epoch samples/s", "samples_per_s.checkpoint every epoch", "n1"),
        ("x no checkpoints", "ratio", "r3"), ("paired", "paired_ratio", "r3"),
        ("paired per round", "paired_ratio_all", "r3list")])]),
    "data_throughput": Bench("python benchmarks/data_throughput.py --rounds 2", [Table(
        rows="arms", skip_baseline=True, columns=[
        ("data", "arm", "str"), ("steady samples/s", "samples_per_s", "n0"),
        ("synthetic samples/s", "baseline_samples_per_s", "n0"), ("x synthetic", "x_baseline", "r3"),
        ("paired", "paired_ratio", "r3"), ("paired per round", "paired_ratio_all", "r3list"),
        ("wall s", "wall_s", "n1")])]),
    "fsdp_memory": Bench("python benchmarks/fsdp_memory.py --rounds 3", [Table(columns=[
        ("setup", "setup", "str"), ("parameters", "parameters", "M"), ("ddp peak MB/rank", "peak_mb.ddp", "n0"),
        ("fsdp peak MB/rank", "peak_mb.fsdp", "n0"), ("fsdp x ddp peak", "peak_ratio", "r3"),
        ("paired peak", "paired_peak_ratio", "r3"), ("ddp samples/s", "samples_per_s.ddp", "n2"),
        ("fsdp samples/s", "samples_per_s.fsdp", "n2"), ("paired samples/s", "paired_samples_ratio", "r3"),
        ("ddp ranks>0 start-up x model", "others_setup_share.ddp", "n2"),
        ("fsdp ranks>0 start-up x model", "others_setup_share.fsdp", "n2"),
        ("fsdp ranks>0 peak x model", "others_peak_share.fsdp", "n2"), ("out of memory", "out_of_memory", "str")])]),
    "activation_memory": Bench("python benchmarks/activation_memory.py --rounds 3", [Table(columns=[
        ("parameters", "parameters", "M"), ("device", "device", "str"),
        ("saved MB off", "saved_mb.off", "n1"), ("saved MB on", "saved_mb.on", "n1"),
        ("on x off saved", "saved_ratio", "r3"), ("recompute MB", "recompute_mb", "n1"),
        ("GPU peak MB off", "gpu_peak_mb.off", "n0"), ("GPU peak MB on", "gpu_peak_mb.on", "n0"),
        ("paired GPU peak", "paired_gpu_peak_ratio", "r3"), ("step ms off", "step_ms.off", "n1"),
        ("step ms on", "step_ms.on", "n1"), ("paired step time", "paired_time_ratio", "r3"),
        ("paired per round", "paired_time_ratio_all", "r3list")])]),
    "loader": Bench("python benchmarks/loader.py --arms torchrun,ray-ddp,ray-ddp-in-thread --rounds 3", [Table(
        rows="arms", skip_baseline=True, columns=[
        ("setup", "setup", "str"), ("arm", "arm", "str"), ("steady samples/s", "samples_per_s", "n0"),
        ("torchrun samples/s", "baseline_samples_per_s", "n0"), ("x torchrun", "x_baseline", "r3"),
        ("paired", "paired_ratio", "r3"), ("paired per round", "paired_ratio_all", "r3list")])]),
    "zero_grad": Bench("python benchmarks/zero_grad.py --rounds 5", [Table(columns=[
        ("setup", "setup", "str"), ("step ms set_to_none", "step_ms.set_to_none", "n2"),
        ("step ms in place", "step_ms.in_place", "n2"), ("paired in place x set_to_none", "paired_ratio", "r3"),
        ("paired per round", "paired_ratio_all", "r3list"),
        ("grad addresses set_to_none", "grad_addresses_over_3_steps.set_to_none", "str"),
        ("grad addresses in place", "grad_addresses_over_3_steps.in_place", "str")])]),
    "worker_setup": Bench("python benchmarks/worker_setup.py --rounds 5", [Table(columns=[
        ("setup", "setup", "str"), ("CPU s collector on", "cpu_s.on", "n2"),
        ("CPU s paused", "cpu_s.paused", "n2"), ("paired paused x on", "paired_ratio", "r3"),
        ("paired per round", "paired_ratio_all", "r3list")])]),
    "gpt_tokens": Bench("python benchmarks/gpt_tokens.py --rounds 3", [Table(columns=[
        ("torchrun tokens/s", "tokens_per_s.torchrun", "n0"), ("ray-ddp tokens/s", "tokens_per_s.ray-ddp", "n0"),
        ("x torchrun", "ratio", "r3"), ("paired", "paired_ratio", "r3"),
        ("paired per round", "paired_ratio_all", "r3list")])]),
    "startup": Bench("python benchmarks/startup.py --rounds 3", [Table(rows="arms", skip_baseline=True, columns=[
        ("Ray", "cluster", "str"), ("arm", "arm", "str"), ("first step s", "first_step_s", "n1"),
        ("ray-train first step s", "baseline_first_step_s", "n1"), ("paired", "first_step_s_paired", "r3"),
        ("wall s", "wall_s", "n1"), ("ray-train wall s", "baseline_wall_s", "n1"),
        ("paired", "wall_s_paired", "r3"), ("CPU s", "cpu_s", "n1"), ("ray-train CPU s", "baseline_cpu_s", "n1"),
        ("paired", "cpu_s_paired", "r3")]),
        Table(title="CPU seconds by process (`--by-process`; medians)", rows="arms", row_when="by_process", columns=[
            ("Ray", "cluster", "str"), ("arm", "arm", "str"), ("CPU s", "cpu_s", "n1"),
            ("workers", "by_process.workers", "n1"), ("controller", "by_process.controller", "n1"),
            ("Ray Train's helpers", "by_process.Ray Train's helpers", "n1"),
            ("ray-ddp's actors", "by_process.ray-ddp's actors", "n1"),
            ("the command", "by_process.the command", "n1"),
            ("Ray's own processes", "by_process.Ray's own processes", "n1"), ("other", "by_process.other", "n1")])]),
    "default_job": Bench("python benchmarks/default_job.py --rounds 3", [Table(columns=[
        ("setup", "setup", "str"), ("ray-ddp wall s", "wall_s", "n1"), ("ray-train wall s", "baseline_wall_s", "n1"),
        ("paired ray-ddp x ray-train", "paired_ratio", "r3"), ("paired per round", "paired_ratio_all", "r3list")])]),
    "preemption": Bench("python benchmarks/preemption.py --rounds 3", [
        Table(title="The per-step cost of the check", rows="arms", skip_baseline=True, columns=[
            ("arm", "arm", "str"), ("ms per step", "ms_per_step", "n2"),
            ("no check ms per step", "baseline_ms_per_step", "n2"), ("x no check", "x_baseline", "r3"),
            ("paired", "paired_ratio", "r3"), ("calls per run", "calls", "n0"), ("ms per call", "ms_per_call", "n2")]),
        Table(title="Notice to checkpoint", when="notice", columns=[
            ("watcher poll s", "notice.poll_s", "n1"), ("median s", "notice.median_s", "n1"),
            ("each round s", "notice.each_s", "n1list")])]),
    "recovery": Bench("python benchmarks/recovery.py --rounds 3", [Table(rows="arms", columns=[
        ("setup", "setup", "str"), ("arm", "arm", "str"), ("steps redone", "steps_redone", "n1"),
        ("resumed from step", "resumed_from_step", "n1"), ("kill to first step s", "restart_s", "n1"),
        ("checkpoint MB read back", "mb_read", "n1"), ("all MB read", "all_mb_read", "n1"),
        ("paired steps redone x ray-train", "paired_steps_ratio", "r3"),
        ("paired s x ray-train", "paired_restart_ratio", "r3"),
        ("paired s per round", "paired_restart_ratio_all", "r3list"),
        ("paired MB x ray-train", "paired_mb_ratio", "r3")])]),
    "snapshot_cost": Bench("python benchmarks/snapshot_cost.py --rounds 2 --steps 2500", [Table(rows="arms", columns=[
        ("setup", "setup", "str"), ("arm", "arm", "str"), ("samples/s", "samples_per_s", "n0"),
        ("paired x off", "paired_ratio", "r3"), ("paired per round", "paired_ratio_all", "r3list")])]),
    "ray_idle_cpu": Bench("python benchmarks/ray_idle_cpu.py", [Table(columns=[
        ("Ray settings", "settings", "strlist"), ("total CPU-s", "total_cpu_s", "n2"),
        ("window s", "window_s", "str"), ("processes", "processes", "str")])]),
    "install_time": Bench("python benchmarks/install_time.py --rounds 2", [Table(columns=[
        ("setup", "setup", "str"), ("install.sh s", "install_s.script", "n1"),
        ("pip compiling s", "install_s.pip-compiles", "n1"), ("paired install.sh x pip", "paired_ratio", "r3"),
        ("paired per round", "paired_ratio_all", "r3list"), ("first import s", "first_import_s.script", "n2"),
        ("pip compiling first import s", "first_import_s.pip-compiles", "n2")])], page="testing.md"),
    "suite_time": Bench("python benchmarks/suite_time.py", [
        Table(columns=[("fast lane s", "fast_lane_s", "n1"), ("fast lane", "fast_lane_summary", "str"),
                       ("bash .ci/run s", "ci_run_s", "n1"), ("of which install and start s", "install_s", "n1"),
                       ("pytest s", "suite_s", "n1"), ("tests", "tests", "str"), ("failed", "failed", "str"),
                       ("skipped", "skipped", "str"), ("CPU s", "ci_cpu_s", "n0"),
                       ("Ray Train runs", "ray_train_fits", "str")]),
        Table(title="The ten slowest tests (setup, call and teardown)", rows="slowest",
              columns=[("test", "test", "str"), ("s", "s", "n1")]),
        Table(title="Where the CI run's CPU seconds went (`--by-process`)", rows="cpu_by_process",
              when="cpu_by_process", columns=[("process", "process", "str"), ("processes", "processes", "str"),
                                             ("CPU s", "cpu_s", "n1")])], page="testing.md"),
    "flakes": Bench("python benchmarks/flakes.py --rounds 5", [
        Table(columns=[("tests a round", "tests_per_round", "str"),
                       ("rounds with every test passed", "rounds_all_passed", "str"), ("flaky", "flaky", "str"),
                       ("broken", "broken", "str"), ("each round s", "round_wall_s", "n1list")]),
        Table(title="Tests that failed in any round", rows="failed_tests",
              columns=[("test", "test", "str"), ("rounds failed", "rounds_failed", "str"),
                       ("first failure", "first", "str")])], page="testing.md"),
    "ray_cpu": Bench("WORKERS=1 bash benchmarks/ray_cpu.sh", [Table(columns=[
        ("workers", "workers", "str"), ("training workers' ticks", "training_ticks", "str"),
        ("Ray's other processes", "other_processes", "str"), ("their ticks", "other_ticks", "str"),
        ("of ticks (cores x window)", "available_ticks", "str")])]),
}

LEADING = ("date", "machine", "cores", "commit", "arguments")
TRANSCRIBED_NOTE = ("† transcribed from README.md (the file's `source` names the commit): only the figures "
                    "the README stated, to no more digits than it gave; rounds it did not list are not recorded.")


def lookup(row: dict, path: str):
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def sequence(path: str) -> int:
    """A file's same-day number: 1 for ``...-2026-12-01.json``, n for ``...-2026-12-01-n.json``."""
    m = FILE_NAME.search(os.path.basename(path))
    return int(m.group(2)) if m and m.group(2) else 1


def check_record(path: str, record) -> None:
    name = os.path.basename(path)
    if not isinstance(record, dict):
        raise Malformed(f"{name}: not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise Malformed(f"{name}: missing {', '.join(missing)}")
    if record["bench"] not in BENCHES:
        raise Malformed(f"{name}: unknown bench {record['bench']!r} (known: {', '.join(BENCHES)})")
    if not isinstance(record["date"], str) or not DATE.match(record["date"]):
        raise Malformed(f"{name}: date {record['date']!r} is not YYYY-MM-DD")
    if not isinstance(record["result"], dict) or not isinstance(record["rounds"], list):
        raise Malformed(f"{name}: result must be an object and rounds a list")
    if not isinstance(record["commit"], dict) or "sha" not in record["commit"]:
        raise Malformed(f"{name}: commit must be an object with a sha")
    if not isinstance(record["command"], list):
        raise Malformed(f"{name}: command must be the argv, a list")


def load_results(results_dir: str) -> list[tuple[str, dict]]:
    """Every result file in ``results_dir``, checked, newest first."""
    found = []
    if os.path.isdir(results_dir):
        for name in sorted(os.listdir(results_dir)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(results_dir, name)
            try:
                with open(path) as f:
                    record = json.load(f)
            except ValueError as e:
                raise Malformed(f"{name}: not JSON ({e})") from e
            check_record(path, record)
            found.append((path, record))
    found.sort(key=lambda pr: (pr[1]["date"], sequence(pr[0])), reverse=True)
    return found


def leading_cells(record: dict) -> list[str]:
    commit = record["commit"]
    sha = (commit.get("sha") or "unknown")[:7]
    mark = f"`{sha}`" + (" (dirty)" if commit.get("dirty") else "") + (" †" if record.get("source") else "")
    args = arguments(record["bench"], record["command"])
    return [record["date"], record["machine"], str(record["cores"]), mark, f"`{args}`" if args else "(defaults)"]


def arguments(bench: str, command: list[str]) -> str:
    """What set this run apart from the defaults: the environment settings before the
    command and the arguments after the benchmark's script (the whole command if the
    script is not in it)."""
    for i, word in enumerate(command):
        if os.path.basename(word) in (f"{bench}.py", f"{bench}.sh"):
            env = [w for w in command[:i] if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]
            return shlex.join(env + command[i + 1:])
    return shlex.join(command)


def rounds_cell(record: dict) -> str:
    stated = record["result"].get("paired_rounds")
    if record.get("rounds_recorded") is False:  # transcribed: the count the README stated
        where = "partly recorded" if record["rounds"] else "not recorded"
        return f"{stated} ({where})" if stated else where
    return str(len({r.get("round", i) for i, r in enumerate(record["rounds"])}))


def render_table(table: Table, records: list[tuple[str, dict]]) -> str | None:
    lines = []
    for _, record in records:
        result = record["result"]
        if table.when and lookup(result, table.when) is None:
            continue
        rows = [{}] if table.rows is None else (result.get(table.rows) or [])
        for row in rows:
            if table.skip_baseline and row.get("arm") == result.get("baseline"):
                continue
            if table.row_when and lookup(row, table.row_when) is None:
                continue
            merged = {**result, **row}
            cells = leading_cells(record)
            for _, key, fmt in table.columns:
                value = lookup(merged, key)
                if value is None:
                    cells.append("")
                elif record.get("source") and fmt in EXACT:
                    cells.append(as_stated(value))
                else:
                    cells.append(FORMATS[fmt](value))
            cells.append(rounds_cell(record))
            lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    if not lines:
        return None
    headers = [*LEADING, *(h for h, _, _ in table.columns), "rounds"]
    head = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(([f"*{table.title}*", ""] if table.title else []) + head + lines)


def render_section(bench: str, records: list[tuple[str, dict]]) -> str:
    mine = [(p, r) for p, r in records if r["bench"] == bench]
    spec = BENCHES[bench]
    if not mine:
        return f"No result recorded yet; run: `{spec.rerun}`\n"
    parts = [t for t in (render_table(table, mine) for table in spec.tables) if t]
    if any(r.get("source") for _, r in mine):
        parts.append(TRANSCRIBED_NOTE)
    return "\n\n".join(parts) + "\n"


def render_page(text: str, records: list[tuple[str, dict]], page: str = "performance.md") -> str:
    """``text`` (the page ``page`` under docs/) with every marked section rewritten from
    ``records``."""
    seen = set()
    mine = {bench for bench, spec in BENCHES.items() if spec.page == page}

    def replace(m: re.Match) -> str:
        bench = m.group(2)
        if bench not in mine:
            raise Malformed(f"{page} has a section for bench {bench!r}, which is not one of its benches")
        seen.add(bench)
        return m.group(1) + render_section(bench, records) + m.group(4)

    new = SECTION.sub(replace, text)
    orphans = sorted({r["bench"] for _, r in records} & mine - seen)
    if orphans:
        raise Malformed(f"results for {', '.join(orphans)} have no <!-- bench:NAME:start --> section in the page")
    return new


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from its rendering")
    parser.add_argument("--results", default=RESULTS, help="the folder of result files")
    parser.add_argument("--page", help="one page to render into, named like the one under docs/ it "
                                       "stands for (default: every page that holds a bench)")
    args = parser.parse_args(argv)
    pages = [args.page] if args.page else \
        [os.path.join(DOCS, name) for name in sorted({spec.page for spec in BENCHES.values()})]
    stale = False
    try:
        records = load_results(args.results)
        for path in pages:
            with open(path) as f:
                text = f.read()
            new = render_page(text, records, os.path.basename(path))
            if new == text:
                continue
            if args.check:
                print(f"{os.path.relpath(path)} is stale: run python scripts/render_benchmarks.py", file=sys.stderr)
                stale = True
                continue
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {os.path.relpath(path)}")
    except (Malformed, OSError) as e:
        print(f"render_benchmarks: {e}", file=sys.stderr)
        return 2
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
