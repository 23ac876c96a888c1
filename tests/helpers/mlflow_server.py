"""A real MLflow tracking server for tests: sqlite store, artifacts served by the server,
listening on 127.0.0.1 only, stopped by the process group this helper started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def mlflow_server(root):
    """Yield the URI of a tracking server keeping its state under ``root``."""
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner to start
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server",
             "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlflow server did not start: " + (root / "server.log").read_text()[-2000:])
                time.sleep(0.2)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: its pgid is its pid
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
