"""Shared test fixtures. Unit tests need none of these and never start Ray."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

# Every single-node Ray these tests start (in-process, or by the ray-ddp processes they
# run) listens on loopback only. Ray reads this at import, so it is set before any import
# of ray; it also makes Ray refuse a second node, which the jobs test (its own network
# namespace) drops again.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# The controller's poll is ray-ddp's own, every second (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
# in ray_ddp/cluster/runtime_env.py). The suite once polled every 0.25 s to notice each
# finished run sooner; now that its runs go side by side on both cores, the end of one is
# filled by another, and four polls a second cost each run CPU that the others need.
# Ray Train starts a preemption watcher actor (a process of its own, ~2 s of CPU) with
# every worker group. Only the multinode story drains a node for preemption, and its
# cluster's processes get Ray's default back (_cluster.py), as does the default-job CLI
# test; every other run saves the process.
os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
# W&B never goes online from a test: --wandb runs write their offline files, read back.
os.environ["WANDB_MODE"] = "offline"
# Variables set here for in-process runs that a production-like subprocess must not get.
TEST_ONLY_ENV = ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",)

# The suite must pass on any machine, and in-process runs must not size themselves from
# the machine when Ray was already running (a notebook's ray.init, the shared Ray below):
# this process reports 16 cores, so a default taken from the machine would ask the 14-CPU
# Ray for 2 x 8 CPUs and fail. Subprocesses (the CLI runs) see the real machine.
os.cpu_count = lambda: 16

HERE = os.path.dirname(os.path.abspath(__file__))
# tests/helpers holds user models/datasets that workers import as package.module:callable;
# Ray ships the driver's sys.path to its workers, so this reaches them too.
sys.path.insert(0, os.path.join(HERE, "helpers"))


# tests/integration modules that need none of the background stories, nor full_run's
# reference: under xdist they run in the second pytest process, beside the first (which
# runs the rest and the stories), on the same Ray (ray_local, below). A lone Ray Train run
# keeps ~1.5 of 2 cores busy; two side by side keep both.
# (test_tasks and test_trust run with the stories: measured with a timeline of one full run,
# the process beside them ended ~30 s after the stories' process, which had moved on to the
# unit tests; balanced, both end together.)
BESIDE_THE_STORIES = frozenset({"test_benchmarks", "test_cadence", "test_data", "test_fsdp", "test_hf", "test_loss_matrix",
                                "test_materialize", "test_ray_data", "test_s3", "test_spawn"})


# Tests that wait on a story that starts with the suite and ends late (the multinode
# story, then its jobs and its doctor): last in their process, so the other modules' runs
# fill the wait instead of the process sitting in it.
LAST_IN_THEIR_PROCESS = ("tests/integration/test_multinode.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.startswith(LAST_IN_THEIR_PROCESS))  # stable: the rest keep their order


def integration_group(nodeid: str) -> str:
    """The pytest process an integration test runs in: "stories" or "beside"."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "beside" if module in BESIDE_THE_STORIES else "stories"


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2` in pyproject.toml), the tests in tests/integration (the
    `ray` lane) go to the two pytest processes in two groups, each in order: those that
    share the background stories (tests/integration/conftest.py), which a second process
    would start again, and those beside them (BESIDE_THE_STORIES). Both share one Ray
    (ray_local). The unit tests fill in after, one at a time, wherever a process is
    free. (xdist's own `--dist loadgroup` would say this with a mark, but it stopped
    grouping under pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationInTwoGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("tests/integration/"):
                return f"tests/integration ({integration_group(nodeid)})"
            return nodeid

    return IntegrationInTwoGroups(config, log)


RAY_CPUS = 14  # ray_local's CPU slots


def pytest_configure(config):
    """The xdist controller names a folder the pytest processes share (for ray_local) and
    gives them its pid: the shared Ray stops when it is gone."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None and getattr(config.option, "numprocesses", None):
        os.environ["RAY_DDP_TESTS_SHARED"] = tempfile.mkdtemp(prefix="ray_ddp_tests_")
        os.environ["RAY_DDP_TESTS_CONTROLLER"] = str(os.getpid())
        # a driver attaching to a running Ray sends its token (~/.ray) only in this mode,
        # which Ray reads once, at import: before the pytest processes start
        os.environ["RAY_AUTH_MODE"] = "token"


def pytest_unconfigure(config):
    """The controller, after every pytest process is done: stop the shared Ray, if one
    started, exactly (by its pid)."""
    shared = os.environ.get("RAY_DDP_TESTS_SHARED")
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or not shared:
        return
    pid_file = os.path.join(shared, "ray.pid")
    if os.path.exists(pid_file):
        with open(pid_file) as f:
            pid = int(f.read())
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(300):  # ray.shutdown() stops its processes in a few seconds
                os.kill(pid, 0)
                time.sleep(0.1)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray for every in-process integration test (starting Ray costs ~10 s).
    Under xdist, both pytest processes share it: the first to need it starts it as a
    process of its own (tests/helpers/shared_ray.py), both attach to it as drivers, and
    the controller stops it at the end. 14 CPU slots on any machine: room for the stories
    that run in the background (conftest.py's EARLY_STORIES, 2 workers each), a run of
    the stories' group, and 6 workers of the group beside it (test_data's and test_fsdp's
    runs side by side); fewer than the 16 cores this process reports, so a run sized from
    them fails (above)."""
    import ray
    from shared_ray import QUIET, start_local_ray

    shared = os.environ.get("RAY_DDP_TESTS_SHARED")
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not shared:  # this process alone
        yield start_local_ray(RAY_CPUS)
        ray.shutdown()
        return
    from filelock import FileLock

    address = os.path.join(shared, "ray.address")
    with FileLock(os.path.join(shared, "ray.lock")):
        if not os.path.exists(os.path.join(shared, "ray.pid")):
            start_shared_ray(shared, address)
    with open(address) as f:
        ray.init(address=f.read(), **QUIET)
    yield ray
    ray.shutdown()  # this driver leaves; the controller stops the Ray


def start_shared_ray(shared: str, address: str, timeout_s: float = 120) -> None:
    with open(os.path.join(shared, "ray.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "shared_ray.py"), address,
                                 str(RAY_CPUS), os.environ["RAY_DDP_TESTS_CONTROLLER"]],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    with open(os.path.join(shared, "ray.pid"), "w") as f:
        f.write(str(proc.pid))
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the shared Ray did not start: {os.path.join(shared, 'ray.log')}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def ray_address(ray_local):
    """The shared local Ray's address, for a ray-ddp command run as a process of its own
    that has no reason to start a Ray of its own (its token is the one in ~/.ray)."""
    return ray_local.get_runtime_context().gcs_address
