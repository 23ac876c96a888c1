"""The test suite's own time: both lanes, measured as a newcomer and CI meet them.

  fast lane   `python -m pytest -m "not ray"` in this checkout (no Ray, no server, no
              process that trains): its wall time
  CI          `bash .ci/run` in a fresh clone of this checkout's HEAD, exactly as CI runs
              it (CI=true): the whole wall time, the install within it, pytest's own
              time, the counts, and the ten slowest tests (setup, call and teardown
              together, from pytest's JUnit report, which PYTEST_ADDOPTS asks for)

  --by-process  also where the CI run's CPU seconds went: the whole machine's busy
              seconds while it ran, and each process's own (/proc, sampled every 0.5 s),
              by kind: Ray Train's workers, controllers and helper actors, ray-ddp's
              actors, other Ray actors and tasks, Ray's own daemons, pytest (which
              drives the in-process runs), ray-ddp commands, the install; and how many
              Ray Train runs (controllers) the suite started. Linux only.

The budget (docs/testing.md): the fast lane at most 60 s, the pytest run of a fresh
clone's `bash .ci/run` at most 12 minutes on 2 cores. One measurement, not paired
rounds: there is no baseline to pair it with.

    python benchmarks/suite_time.py
    python benchmarks/suite_time.py --by-process
    python benchmarks/suite_time.py --skip-ci     # only the fast lane
Runs on the machine it measures (an otherwise idle one). The figures also go to
benchmarks/results/suite_time-<machine>-<date>.json (--results-dir, --no-save),
rendered into docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _procs import ProcessSampler, busy_cpu_s, ray_name  # noqa: E402
from startup import process_kind  # noqa: E402


def time_fast_lane() -> dict:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "not ray", "-q", "-p", "no:cacheprovider"],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"fast lane: {wall:.1f} s, {last}", flush=True)
    return {"fast_lane_s": wall, "fast_lane_summary": last, "fast_lane_exit": proc.returncode}


def time_ci(by_process: bool = False) -> dict:
    """`bash .ci/run` in a fresh clone of HEAD, with a JUnit report of the suite."""
    root = tempfile.mkdtemp(prefix="suite_time_")
    clone, report = os.path.join(root, "clone"), os.path.join(root, "junit.xml")
    try:
        subprocess.run(["git", "clone", "--quiet", REPO, clone], check=True)
        env = {**os.environ, "CI": "true", "PYTEST_ADDOPTS": f"--junitxml={report}"}
        for name in ("VIRTUAL_ENV", "RAY_ADDRESS"):
            env.pop(name, None)
        sampler = ProcessSampler(every_s=0.5).start() if by_process else None
        cpu_before = busy_cpu_s()
        started = time.monotonic()
        proc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        wall = time.monotonic() - started
        cpu = busy_cpu_s() - cpu_before if cpu_before is not None else None
        if sampler is not None:
            sampler.stop()
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        print(f"bash .ci/run: {wall:.1f} s, exit {proc.returncode}, {tail[0]}", flush=True)
        if not os.path.exists(report):
            raise SystemExit(f".ci/run wrote no JUnit report (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")
        suite = read_junit(report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    by_kind = cpu_by_suite_kind(sampler.spent()) if sampler is not None else {}
    return {"ci_run_s": wall, "ci_exit": proc.returncode, "install_s": wall - suite.pop("wall_s"), **suite,
            **({"ci_cpu_s": cpu} if by_process else {}), **by_kind}


# what the suite's processes are, beyond startup.py's kinds of one job's
SUITE_KINDS = {"workers": "Ray Train workers", "controller": "Ray Train controllers",
               "Ray Train's helpers": "Ray Train's helper actors"}


def suite_kind(title: str) -> str:
    kind = process_kind(title, False)
    if kind != "other":
        return SUITE_KINDS.get(kind, kind)
    if ray_name(title) is not None:
        return "other Ray actors and tasks"
    # (not any title naming "pytest": a command the tests start names its pytest-of-* folders)
    if " -m pytest" in title or "exec(eval(sys.stdin.readline()))" in title:  # pytest-xdist's workers
        return "pytest (and the runs it drives in-process)"
    if " pip " in title or "compileall" in title:
        return "the install"
    return "ray-ddp commands" if "ray_ddp" in title or "ray-ddp" in title else "other"


def cpu_by_suite_kind(spent: dict[int, tuple[float, str]]) -> dict:
    """The sampled processes' CPU seconds by kind, largest first, and the Ray Train runs."""
    kinds: dict[str, list] = {}
    for cpu, title in spent.values():
        entry = kinds.setdefault(suite_kind(title), [0, 0.0])
        entry[0] += 1
        entry[1] += cpu
    rows = [{"process": kind, "processes": n, "cpu_s": cpu} for kind, (n, cpu) in kinds.items()]
    return {"cpu_by_process": sorted(rows, key=lambda r: -r["cpu_s"]),
            "ray_train_fits": sum(1 for _, title in spent.values() if ray_name(title) == "TrainController")}


def read_junit(path: str) -> dict:
    """Counts, pytest's own time and the ten slowest tests of a JUnit report."""
    tree = ET.parse(path).getroot()
    suite = tree if tree.tag == "testsuite" else tree.find("testsuite")
    cases, broken = [], []
    for case in suite.iter("testcase"):
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{file}::{case.get('name')}"
        cases.append({"test": name, "s": float(case.get("time") or 0)})
        for kind in ("failure", "error"):
            for found in case.findall(kind):
                broken.append(f"{name} ({kind}): {(found.get('message') or '').splitlines()[0][:300]}")
    cases.sort(key=lambda c: -c["s"])
    return {"suite_s": float(suite.get("time")), "wall_s": float(suite.get("time")),
            "tests": int(suite.get("tests")), "failed": int(suite.get("failures")) + int(suite.get("errors")),
            "skipped": int(suite.get("skipped")), "slowest": cases[:10], "failures": broken}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-ci", action="store_true", help="measure the fast lane only")
    parser.add_argument("--by-process", action="store_true",
                        help="also the CI run's CPU seconds by kind of process (Linux)")
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    result = {"setup": f"this checkout's fast lane; a fresh clone's bash .ci/run; {os.cpu_count()} CPUs",
              **time_fast_lane(), **({} if args.skip_ci else time_ci(args.by_process))}
    print("\n| lane | s |\n|---|---|")
    print(f"| pytest -m \"not ray\" | {result['fast_lane_s']:.1f} |")
    if "ci_run_s" in result:
        print(f"| bash .ci/run (fresh clone) | {result['ci_run_s']:.1f} |")
        print(f"| of which pytest | {result['suite_s']:.1f} |")
    for case in result.get("slowest", []):
        print(f"{case['s']:7.1f} s  {case['test']}")
    if result.get("cpu_by_process"):
        print(f"\nCPU s while it ran: {result['ci_cpu_s']:.0f}; Ray Train runs: {result['ray_train_fits']}")
        for row in result["cpu_by_process"]:
            print(f"{row['cpu_s']:8.1f} CPU s  {row['processes']:5d} processes  {row['process']}")
    for line in result.get("failures", []):
        print(f"FAILED {line}")
    save_result(args, "suite_time", result, [{"round": 1, **{k: v for k, v in result.items() if k != "setup"}}])


if __name__ == "__main__":
    main()
