"""Shared test fixtures. Unit tests need none of these and never start Ray."""

from __future__ import annotations

import os
import sys

import pytest

# Every single-node Ray these tests start (in-process, or by the ray-ddp processes they
# run) listens on loopback only. Ray reads this at import, so it is set before any import
# of ray; it also makes Ray refuse a second node, which the jobs test (its own network
# namespace) drops again.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray Train's controller polls its workers every 2 s, so a finished run is noticed up to
# 2 s late; with ~40 short runs in the suite, polling faster saves about a minute.
os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.25"
# Ray Train starts a preemption watcher actor (a process of its own, ~2 s of CPU) with
# every worker group. Only the multinode story drains a node for preemption, and its
# cluster's processes get Ray's default back (_cluster.py), as does the default-job CLI
# test; every other run saves the process.
os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
# Variables set here for in-process runs that a production-like subprocess must not get.
TEST_ONLY_ENV = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")

# The suite must pass on any machine, and in-process runs must not size themselves from
# the machine when Ray was already running (a notebook's ray.init, the shared Ray below):
# this process reports 16 cores, so a default taken from the machine would ask the 12-CPU
# Ray for 2 x 8 CPUs and fail. Subprocesses (the CLI runs) see the real machine.
os.cpu_count = lambda: 16

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/helpers holds user models/datasets that workers import as package.module:callable;
# Ray ships the driver's sys.path to its workers, so this reaches them too.
sys.path.insert(0, os.path.join(HERE, "helpers"))


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2` in pyproject.toml), every test in tests/integration (the
    `ray` lane) goes to one pytest process, in order: they share one Ray (below) and its
    background stories (tests/integration/conftest.py), which a second process would
    start again. The other process takes the unit tests meanwhile. (xdist's own
    `--dist loadgroup` would say this with a mark, but it stopped grouping under pytest
    9.2: pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationInOneProcess(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/integration" if nodeid.startswith("tests/integration/") else nodeid

    return IntegrationInOneProcess(config, log)


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray for every in-process integration test (starting Ray costs ~10 s).
    12 CPU slots on any machine: room for the stories that run in the background
    (conftest.py's EARLY_STORIES, 2 workers each) beside 6 workers of the test at hand
    (test_data's and test_fsdp's runs side by side)."""
    import ray

    ray.init(address="local", num_cpus=12, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_local):
    """The shared local Ray's address, for a ray-ddp command run as a process of its own
    that has no reason to start a Ray of its own (its token is the one in ~/.ray)."""
    return ray_local.get_runtime_context().gcs_address
