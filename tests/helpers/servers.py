"""A server process for tests: started in a session of its own, waited for until a URL
answers, and stopped by that process group (exactly the processes the test started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(argv: list[str], log: Path, ready_url: str, env: Optional[dict] = None) -> Iterator[None]:
    """Run ``argv`` (output to ``log``) until the block ends; enter once ``ready_url`` answers."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        # a live server is waited for: on a loaded 2-core machine (the suite's clusters
        # starting beside it) importing MLflow alone has taken over a minute
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(ready_url, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[2]} did not start: " + log.read_text()[-2000:])
                time.sleep(0.2)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: its pgid is its pid
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
