"""benchmarks/flakes.py's tally: a test that failed in some rounds is flaky, in every
round broken, read from real JUnit reports of the shape pytest writes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

from flakes import main, tally  # noqa: E402
from suite_time import read_junit  # noqa: E402

CASE = '<testcase classname="tests.integration.test_a" name="{name}" time="1.5">{body}</testcase>'


def junit_round(tmp_path, number: int, failing: dict[str, str]) -> dict:
    """A round whose JUnit report has tests one to three, ``failing`` naming the failed
    ones and their message, as flakes.run_round records it."""
    names = ("test_one", "test_two", "test_three[x]")
    cases = "".join(CASE.format(name=n, body=f'<failure message="{failing[n]}">tb</failure>' if n in failing else "")
                    for n in names)
    path = tmp_path / f"round-{number}.xml"
    path.write_text(f'<testsuites><testsuite name="pytest" errors="0" failures="{len(failing)}" skipped="0" '
                    f'tests="3" time="9.0">{cases}</testsuite></testsuites>')
    suite = read_junit(str(path))
    return {"round": number, "wall_s": 9.0, "exit": 1 if failing else 0, "tests": suite["tests"],
            "failed": suite["failed"], "failures": suite["failures"]}


def test_a_test_failing_in_some_rounds_is_flaky_and_in_all_broken(tmp_path):
    rounds = [junit_round(tmp_path, 1, {"test_two": "timed out (a)"}),
              junit_round(tmp_path, 2, {"test_two": "timed out (b)", "test_three[x]": "AssertionError: 1 == 2"}),
              junit_round(tmp_path, 3, {"test_two": "timed out (c)"})]
    told = tally(rounds)
    assert (told["rounds_run"], told["tests_per_round"], told["rounds_all_passed"]) == (3, 3, 0)
    assert (told["flaky"], told["broken"]) == (1, 1)
    assert [(e["test"], e["rounds_failed"]) for e in told["failed_tests"]] == [
        ("tests/integration/test_a.py::test_two", 3), ("tests/integration/test_a.py::test_three[x]", 1)]
    assert told["failed_tests"][0]["first"] == "(failure): timed out (a)"


def test_rounds_that_all_pass_have_nothing_to_tell(tmp_path):
    told = tally([junit_round(tmp_path, n, {}) for n in (1, 2)])
    assert (told["rounds_all_passed"], told["flaky"], told["broken"], told["failed_tests"]) == (2, 0, 0, [])
    assert told["round_wall_s"] == [9.0, 9.0]


def test_rounds_below_one_is_one_line_and_runs_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--rounds", "0", "--results-dir", str(tmp_path / "results")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--rounds 0: give 1 or more")
    assert not (tmp_path / "results").exists()
