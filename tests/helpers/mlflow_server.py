"""A real MLflow tracking server for tests: sqlite store, artifacts served by the server,
listening on 127.0.0.1 only, stopped by the process group this helper started."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from servers import free_port, served


@contextmanager
def mlflow_server(root):
    """Yield the URI of a tracking server keeping its state under ``root``."""
    port = free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner to start
    uri = f"http://127.0.0.1:{port}"
    with served([sys.executable, "-m", "mlflow", "server",
                 "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                 "--serve-artifacts", "--artifacts-destination", str(root / "artifacts"),
                 "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                root / "server.log", uri + "/health", env=env):
        yield uri
