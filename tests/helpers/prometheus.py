"""Read Ray's Prometheus endpoint over 127.0.0.1 while a run trains: every ray_ddp series
seen, with its labels (Ray drops a process's gauges when it ends, so they are read live)."""

from __future__ import annotations

import contextlib
import re
import threading
import urllib.request

SAMPLE = re.compile(r'^(ray_ddp_\w+)\{(.*)\} (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The ray_ddp samples of one scrape: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            samples.append((match[1], dict(LABEL.findall(match[2])), float(match[3])))
    return samples


@contextlib.contextmanager
def scraping(port: int, every_s: float = 0.5):
    """Scrape http://127.0.0.1:PORT/metrics until the block ends; yields the list that
    collects every sample seen."""
    seen: list[tuple[str, dict[str, str], float]] = []
    stop = threading.Event()

    def scrape():
        while not stop.wait(every_s):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                    seen.extend(parse_samples(answer.read().decode()))
            except OSError:
                pass  # the endpoint comes up with Ray's agent, and may be busy

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=10)
