"""A real S3 API server for tests: moto's standalone server on 127.0.0.1, one bucket made,
stopped by the process group this helper started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from mlflow_server import free_port

# moto accepts any credentials; they ride in the URI (s3://KEY:SECRET@bucket/...), so the
# Ray workers (whose environment was fixed when the shared Ray started) can use them too
KEY = SECRET = "testing"


@contextmanager
def s3_server(root, bucket: str = "runs"):
    """Yield ``(endpoint, bucket)`` of a server holding an empty ``bucket``."""
    port = free_port()
    with open(root / "s3.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start: " + (root / "s3.log").read_text()[-2000:])
                time.sleep(0.2)
        urllib.request.urlopen(urllib.request.Request(f"http://{endpoint}/{bucket}", method="PUT"), timeout=10).close()
        yield endpoint, bucket
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: its pgid is its pid
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
