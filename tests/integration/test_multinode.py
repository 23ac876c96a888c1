"""`ray job submit` to a real two-node Ray cluster (both nodes on this machine), with
Ray's token authentication on. The cluster lives in a network namespace of its own
(only loopback inside), so nothing it starts listens beyond this machine; the test
stops exactly the process groups it started."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
GCS_PORT, DASHBOARD_PORT = 46379, 48265


@dataclass
class Cluster:
    prefix: list[str]  # runs a command inside the cluster's network namespace
    env: dict[str, str]
    dashboard: str

    def run(self, argv, timeout=300, **kw):
        return subprocess.run(self.prefix + argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)


def _start(prefix, argv, env, log_path):
    log = open(log_path, "w")
    return subprocess.Popen(prefix + argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, stopped below


def _stop(procs):
    """SIGTERM every process group at once (each node shuts down in parallel), then wait."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5  # one bound for all: a test cluster needs no slow graceful stop
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    temp_dir = tempfile.mkdtemp(prefix="rd")  # short: Ray's socket paths must stay < 108 chars
    token = secrets.token_hex(16)
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "PATH": BIN + os.pathsep + os.environ["PATH"], "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # this cluster has two nodes
    netns = f"ray_ddp_test_{os.getpid()}"
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("ip") and \
            subprocess.run(["ip", "netns", "add", netns], capture_output=True).returncode == 0:
        prefix = ["ip", "netns", "exec", netns]
        subprocess.run(prefix + ["ip", "link", "set", "lo", "up"], check=True)
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--temp-dir", temp_dir]
    procs = []
    try:
        procs.append(_start(prefix, ["ray", "start", "--head", f"--port={GCS_PORT}",
                                     "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}",
                                     "--dashboard-agent-listen-port=48300",
                                     "--ray-client-server-port=48001", *common],
                            env, home / "head.log"))
        c = Cluster(prefix, env, f"http://127.0.0.1:{DASHBOARD_PORT}")
        _wait_for_nodes(c, 1, procs)
        procs.append(_start(prefix, ["ray", "start", f"--address=127.0.0.1:{GCS_PORT}",
                                     "--dashboard-agent-listen-port=48301", *common],
                            env, home / "node.log"))
        _wait_for_nodes(c, 2, procs)
        yield c
    finally:
        _stop(procs)
        if prefix:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_nodes(c: Cluster, count: int, procs, timeout=120):
    probe = ("import ray; ray.init(address='127.0.0.1:%d', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))" % GCS_PORT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert all(p.poll() is None for p in procs), "a ray start process exited"
        out = c.run([sys.executable, "-c", probe], timeout=60)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise AssertionError(f"the cluster never had {count} nodes")


def job_status(c: Cluster, job_id: str) -> str:
    code = ("from ray.job_submission import JobSubmissionClient as C; "
            f"print(C({c.dashboard!r}).get_job_status({job_id!r}).value)")
    return c.run([sys.executable, "-c", code], timeout=60).stdout.strip()


def submitted_job_id(output: str) -> str:
    for line in output.splitlines():
        if "Job '" in line and "submitted successfully" in line:
            return line.split("Job '")[1].split("'")[0]
    raise AssertionError(f"no job id in:\n{output}")


def test_submit_job_trains_across_two_nodes(cluster, tmp_path):
    storage = tmp_path / "runs"
    env = {**cluster.env, "RAY_ADDRESS": cluster.dashboard, "STORAGE": str(storage), "NAME": "job1"}
    out = subprocess.run(cluster.prefix + ["bash", os.path.join(ROOT, "examples", "submit_job.sh"),
                                           "--workers", "2", "--epochs", "2", "--steps-per-epoch", "10",
                                           "--report-every", "5", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert job_status(cluster, submitted_job_id(out.stdout)) == "SUCCEEDED"
    summary = json.loads([l for l in out.stdout.splitlines() if l.startswith('{"run"')][-1])
    assert (summary["world_size"], summary["epochs_completed"]) == (2, 2)
    assert os.path.isfile(os.path.join(summary["checkpoint"], "model.pt"))
    rows = pq.read_table(storage / "job1" / "metrics.parquet").to_pylist()
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in (5, 10, 15, 20) for r in (0, 1)]
    assert len({r["node_id"] for r in rows}) == 2, "one worker on each of the two Ray nodes"


def test_job_that_cannot_fit_fails_fast_with_one_line(cluster, tmp_path):
    env = {**cluster.env, "RAY_ADDRESS": cluster.dashboard, "STORAGE": str(tmp_path), "NAME": "nofit"}
    started = time.time()
    out = subprocess.run(cluster.prefix + ["bash", os.path.join(ROOT, "examples", "submit_job.sh"),
                                           "--gpus-per-worker", "1", "--workers", "8"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert ("needs 8 workers x 1 GPU = 8 GPU; the cluster has 0 GPU and no autoscaler; "
            "pass --gpus-per-worker 0 to train on CPU") in out.stdout
    assert "Traceback" not in out.stdout
    assert job_status(cluster, submitted_job_id(out.stdout)) == "FAILED"
    assert not (tmp_path / "nofit").exists()
    assert time.time() - started < 60  # generous: the job itself fails in seconds
