"""Does every test that meets Ray pass every time? The Ray lane, N times in a row.

Runs `python -m pytest -m ray` (the integration tests and every other test marked `ray`,
as the README's test command runs them: pytest-xdist, the shared Ray) in this checkout
--rounds times one after the other, each round with a JUnit report, and records each
round's wall time and counts, and every test that failed or errored in any round with how
many rounds it failed in and its first message. A test that fails in some rounds and
passes in others is a flake; one that fails in every round is broken.

    python benchmarks/flakes.py --rounds 5
    python benchmarks/flakes.py --rounds 2 -- tests/integration/test_tune.py   # some tests only

Runs on the machine it checks (an otherwise idle one: a busy machine makes timing-bound
tests fail that would pass in CI, which is worth knowing too, but it is not this figure).
The figures also go to benchmarks/results/flakes-<machine>-<date>.json (--results-dir,
--no-save), rendered into docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from suite_time import read_junit  # noqa: E402


def run_round(number: int, selection: list[str]) -> dict:
    """One `pytest -m ray` in this checkout: its wall time, counts and failures."""
    with tempfile.TemporaryDirectory(prefix="flakes_") as root:
        report = os.path.join(root, "junit.xml")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "ray", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *selection], cwd=REPO, env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
        wall = time.monotonic() - started
        if not os.path.exists(report):
            raise SystemExit(f"round {number}: pytest wrote no JUnit report (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        suite = read_junit(report)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"round {number}: {wall:.1f} s, exit {proc.returncode}, {last}", flush=True)
    return {"round": number, "wall_s": wall, "exit": proc.returncode, "summary": last, "tests": suite["tests"],
            "failed": suite["failed"], "skipped": suite["skipped"], "failures": suite["failures"]}


def tally(rounds: list[dict]) -> dict:
    """Every test that failed in any round: in how many rounds, and its first message."""
    failed: dict[str, dict] = {}
    for r in rounds:
        for line in r["failures"]:
            test, _, message = line.partition(" (")  # read_junit's "<test> (<kind>): <message>"
            entry = failed.setdefault(test, {"test": test, "rounds_failed": 0, "first": "(" + message})
            entry["rounds_failed"] += 1
    ran = len(rounds)
    return {"rounds_run": ran, "tests_per_round": max((r["tests"] for r in rounds), default=0),
            "rounds_all_passed": sum(1 for r in rounds if r["exit"] == 0 and r["failed"] == 0),
            "round_wall_s": [r["wall_s"] for r in rounds],
            "failed_tests": sorted(failed.values(), key=lambda e: (-e["rounds_failed"], e["test"])),
            "flaky": sum(1 for e in failed.values() if e["rounds_failed"] < ran),
            "broken": sum(1 for e in failed.values() if e["rounds_failed"] == ran)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="how many times in a row (default 5)")
    parser.add_argument("selection", nargs="*", help="after --: test paths or node ids (default: the whole lane)")
    from _results import add_result_args, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    rounds = [run_round(i, args.selection) for i in range(1, args.rounds + 1)]
    result = {"setup": f"pytest -m ray in this checkout, {args.rounds} times in a row; {os.cpu_count()} CPUs",
              **tally(rounds)}
    print("\n| round | s | exit | pytest said |\n|---|---|---|---|")
    for r in rounds:
        print(f"| {r['round']} | {r['wall_s']:.1f} | {r['exit']} | {r['summary']} |")
    print(f"\n{result['rounds_all_passed']} of {args.rounds} rounds passed every test "
          f"({result['tests_per_round']} tests a round); flaky: {result['flaky']}, broken: {result['broken']}")
    for entry in result["failed_tests"]:
        print(f"  failed in {entry['rounds_failed']} of {args.rounds}: {entry['test']} {entry['first'][:200]}")
    save_result(args, "flakes", result, rounds)
    return 0 if not result["failed_tests"] else 1


if __name__ == "__main__":
    sys.exit(main())
