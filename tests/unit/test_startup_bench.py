"""benchmarks/startup.py's CPU breakdown: each process counted as what it is, whatever
title it had when it was sampled first or last."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

from startup import KINDS, better_title, cpu_by_kind, process_kind  # noqa: E402

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
