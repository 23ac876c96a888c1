"""The suite's shared local Ray, as a process of its own (tests/conftest.py's ``ray_local``
under pytest-xdist). The first pytest process that needs Ray starts this; both attach to
it as drivers; the xdist controller stops it after both are done (a pytest process cannot
stop a Ray the other still uses, nor wait for it without stalling xdist's shutdown).

    python shared_ray.py ADDRESS_FILE NUM_CPUS CONTROLLER_PID

Starts Ray as ``ray.init(address="local")`` does in-process, writes its GCS address to
ADDRESS_FILE, and shuts Ray down on SIGTERM, or once the controller process is gone."""

from __future__ import annotations

import os
import signal
import sys
import time


QUIET = dict(log_to_driver=False, logging_level="ERROR")  # the suite reads runs' files, not their logs


def start_local_ray(num_cpus: int):
    """The suite's Ray, in this process: the same in shared_ray.py's process and in a
    pytest process alone (``-n 0``)."""
    import ray

    from servers import free_port

    # its Prometheus endpoint on a port of the suite's choosing (test_observe.py reads
    # ray_ddp's series there), exported every 5 s, not Ray's 10: a run of the suite is seconds long
    os.environ.setdefault("RAY_metrics_report_interval_ms", "5000")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _metrics_export_port=free_port(), **QUIET)
    return ray


def main(address_file: str, num_cpus: int, controller: int) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    ray = start_local_ray(num_cpus)
    with open(address_file + ".part", "w") as f:
        f.write(ray.get_runtime_context().gcs_address)
    os.replace(address_file + ".part", address_file)  # whole, or not there
    while not stop and alive(controller):
        time.sleep(1)
    ray.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
