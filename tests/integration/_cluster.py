"""A real multi-node Ray cluster on this machine, for tests: a head and worker nodes, each a
`ray start --block` process group of its own, with Ray's token authentication on. The
cluster lives in a network namespace of its own when the test runs as root (only
loopback inside), so nothing it starts listens beyond this machine; the test stops
exactly the process groups it started (one node can be stopped, or killed, alone)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

BIN = os.path.dirname(sys.executable)


@dataclass
class LoopbackCluster:
    prefix: list[str]  # runs a command inside the cluster's network namespace
    env: dict[str, str]
    gcs_port: int
    dashboard_port: int
    home: str
    temp_dir: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def run(self, argv, timeout=300, **kw):
        return subprocess.run(self.prefix + argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)

    def popen(self, argv, log_path, env=None):
        log = open(log_path, "w")
        return subprocess.Popen(self.prefix + argv, env=env or self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start_head(self, cpus: int = 1) -> None:
        log = f"{self.home}/head.log"
        self.procs["head"] = self.popen(
            ["ray", "start", "--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={self.dashboard_port}", "--dashboard-agent-listen-port=48300",
             "--ray-client-server-port=48001", *self._common(cpus)], log)
        self.wait_started("head", log)

    def add_node(self, name: str, cpus: int = 1, attempts: int = 3, env: Optional[dict[str, str]] = None) -> None:
        """Start a worker node and wait until the cluster counts it. A node whose raylet
        did not register within Ray's fixed 30 s (`ray start` then exits: "timed out
        during startup", seen on a loaded 2-core machine, twice in a row on one slow
        period of it) is started again, up to ``attempts`` times in all, as an autoscaler
        launches again a node that failed to come up; any other exit fails."""
        for attempt in range(attempts):
            port = 48301 + len(self.procs) + 10 * attempt  # not a late raylet's
            log = f"{self.home}/{name}-{time.time():.0f}-{attempt}.log"
            self.procs[name] = self.popen(
                ["ray", "start", f"--address={self.address}", f"--dashboard-agent-listen-port={port}",
                 *self._common(cpus)], log, env={**self.env, **env} if env else None)
            try:
                self.wait_started(name, log)
                return
            except AssertionError:
                with open(log) as f:
                    timed_out = "timed out during startup" in f.read()
                if attempt + 1 == attempts or not timed_out or self.procs[name].poll() is None:
                    raise
                try:  # what is left of it (its raylet, should it register late): its whole group
                    os.killpg(self.procs.pop(name).pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait_started(self, name: str, log: str, timeout=120) -> None:
        """Wait for `ray start` to say "Ray runtime started.": it says so once the node's
        raylet has registered with the GCS (a worker node's start waits for that), so the
        cluster counts the node. Reading the line costs nothing; asking the GCS means a
        new driver process each time (~1.6 CPU-s, and the idle workers Ray starts for it)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(log, errors="replace") as f:
                if "Ray runtime started." in f.read():
                    return
            assert self.procs[name].poll() is None, f"`ray start` of node {name} exited (its log: {log})"
            time.sleep(0.25)
        raise AssertionError(f"node {name} did not start in {timeout} s (its log: {log})")

    def _common(self, cpus: int) -> list[str]:
        return ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--temp-dir", self.temp_dir]

    def stop_node(self, name: str) -> None:
        """Stop one node as an operator would: SIGTERM to its process group."""
        stop_process_groups([self.procs.pop(name)])

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of one node (its raylet, its workers) at once: a machine
        that vanished."""
        proc = self.procs.pop(name)
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)

    def probe(self, code: str, timeout=60) -> str:
        script = f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); {code}"
        out = self.run([sys.executable, "-c", script], timeout=timeout)
        return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""

    def stop(self) -> None:
        stop_process_groups(list(self.procs.values()))
        self.procs.clear()


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_process_groups(procs) -> None:
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


def loopback_cluster(home: str, gcs_port: int, dashboard_port: int, extra_env=None):
    """A generator for a fixture: the cluster (head only; add nodes with ``add_node``),
    stopped and its namespace removed afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="rd")  # short: Ray's socket paths must stay < 108 chars
    env = {**os.environ, "HOME": home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": BIN + os.pathsep + os.environ["PATH"], "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # this cluster has several nodes
    env.pop("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", None)  # its story drains a node for preemption
    netns = f"ray_ddp_test_{os.getpid()}_{gcs_port}"
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("ip") and \
            subprocess.run(["ip", "netns", "add", netns], capture_output=True).returncode == 0:
        prefix = ["ip", "netns", "exec", netns]
        subprocess.run(prefix + ["ip", "link", "set", "lo", "up"], check=True)
    cluster = LoopbackCluster(prefix, env, gcs_port, dashboard_port, home, temp_dir)
    try:
        yield cluster
    finally:
        cluster.stop()
        if prefix:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
