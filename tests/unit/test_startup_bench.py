"""benchmarks/startup.py's CPU breakdown: each process counted as what it is, whatever
title it had when it was sampled first or last."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

from _procs import better_title  # noqa: E402
from startup import KINDS, cpu_by_kind, process_kind  # noqa: E402

WORKER_START = "/venv/bin/python /venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py --x"


def test_a_worker_is_named_by_the_actor_it_became_not_its_start_or_its_last_call():
    title = ""
    for seen in (WORKER_START, "ray::IDLE", "ray::RayTrainWorker", "ray::execute._shutdown_torch"):
        title = better_title(title, seen)
    assert title == "ray::RayTrainWorker" and process_kind(title, False) == "workers"
    assert better_title("", "ray::TrainController.run") == "ray::TrainController.run"


def test_each_kind():
    assert process_kind("ray::TrainController.run", False) == "controller"
    assert process_kind("ray::PlacementGroupCleaner", False) == "Ray Train's helpers"
    assert process_kind("ray::DatasetManager", False) == "Ray Train's helpers"
    assert process_kind("ray::HangWatch.beat", False) == "ray-ddp's actors"
    assert process_kind("ray::_kill", False) == "ray-ddp's actors"  # the hang watch's task on a node
    assert process_kind("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --a", False) == \
        "Ray's own processes"
    assert process_kind(WORKER_START, False) == "Ray's own processes"  # an idle worker never used
    assert process_kind("/usr/bin/python -m ray_ddp train", True) == "the command"
    assert process_kind("sshd: root", False) == "other"


def test_cpu_is_what_each_process_spent_since_the_start():
    before = {1: (5.0, "/usr/bin/python -m ray_ddp train"), 2: (1.0, "ray::IDLE")}
    seen = {1: (7.5, "/usr/bin/python -m ray_ddp train"), 2: (4.0, "ray::RayTrainWorker"),
            3: (2.0, "ray::RayTrainWorker"), 4: (0.5, "ray::TrainController")}
    kinds = cpu_by_kind(before, seen, command_pid=1)
    assert set(kinds) == set(KINDS)
    assert kinds["the command"] == 2.5 and kinds["workers"] == 5.0 and kinds["controller"] == 0.5


def test_the_suites_processes_are_counted_by_kind_and_its_ray_train_runs_by_controller():
    from suite_time import cpu_by_suite_kind

    spent = {1: (5.0, "ray::RayTrainWorker"), 2: (4.0, "ray::RayTrainWorker"), 3: (3.0, "ray::TrainController"),
             4: (2.0, "ray::TrainController.run"), 5: (1.5, "ray::SynchronizationActor"),
             6: (30.0, "/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))"),
             7: (2.5, "/venv/bin/python -m ray_ddp train --storage /tmp/pytest-of-root/pytest-3/runs0"),
             8: (1.0, "ray::FooterReader"), 11: (0.5, "/venv/bin/python -m pytest -q"),
             9: (9.0, "/venv/bin/python -m pip install --quiet -e .[test]"),
             10: (0.5, "/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --a")}
    by = cpu_by_suite_kind(spent)
    assert by["ray_train_fits"] == 2
    rows = {r["process"]: (r["processes"], r["cpu_s"]) for r in by["cpu_by_process"]}
    assert rows == {"pytest (and the runs it drives in-process)": (2, 30.5), "Ray Train workers": (2, 9.0),
                    "the install": (1, 9.0), "Ray Train controllers": (2, 5.0), "ray-ddp commands": (1, 2.5),
                    "Ray Train's helper actors": (1, 1.5), "other Ray actors and tasks": (1, 1.0),
                    "Ray's own processes": (1, 0.5)}
    assert by["cpu_by_process"][0]["process"].startswith("pytest")  # largest first
