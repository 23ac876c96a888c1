"""RestartRecorder: every worker group Ray Train starts, and every failure it restarts the
group after, recorded the moment it happens. Runs inside Ray Train's controller, beside
MetricsCallback.

Without it a restart was only noticed at the new group's first report, and told from
the reports alone: a failure before the first report left no event and no line, and
named no rank or node. Ray Train tells the controller's callbacks each group it starts
(its ranks' nodes and processes), each poll that found a rank's error, and then what its
failure policy decided. On RETRY this records one event (record/events.py's
``restart_event``): the failed rank and its node, the last step any rank finished (the
hang watch's heartbeats, or the last report), the checkpoint the new group loads (this
fit's newest, else the one the fit started from, else none: from scratch) and the
steps to redo. On RAISE the run ends and the driver records it (driver/fit.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from ray_ddp.cluster.nodes import dead_nodes
from ray_ddp.record.names import checkpoint_step
from ray_ddp.record.events import restart_event
from ray_ddp.record.failures import summarize_failure
from ray_ddp.observe.ray_hooks import ControllerCallback, FailureDecision, WorkerGroupCallback


logger = logging.getLogger(__name__)


def never_fails(hook: Callable) -> Callable:
    """Ray Train routes an error raised in a controller hook through its failure policy:
    the record of a run must never be what ends it."""
    @functools.wraps(hook)
    def guarded(self, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except Exception:
            logger.exception("ray_ddp could not record a worker-group event")
    return guarded


class RestartRecorder(WorkerGroupCallback, ControllerCallback):
    """``metrics``: the fit's MetricsCallback (pickled with this one into the controller,
    so both hold the same object), which keeps the events and writes progress.json;
    ``watch``: the driver's HangWatch actor or None; ``resumed_from``: the checkpoint
    this fit started from (None: a new run)."""

    def __init__(self, metrics: Any, watch: Any = None, resumed_from: Optional[str] = None):
        self.metrics, self.watch, self.resumed_from = metrics, watch, resumed_from
        self._ips: dict[str, str] = {}  # rank -> its node's IP, for the group now running
        self._node_ids: dict[str, str] = {}  # rank -> its node's ID
        self._processes: list[tuple[str, int]] = []  # its (node ID, pid)s: whose heartbeats count
        self._start_step = 0  # the step of the checkpoint it started from
        self._failed: Optional[tuple[Any, int]] = None  # (FailureSummary, last step) of that group

    @never_fails
    def after_worker_group_start(self, worker_group) -> None:
        workers = worker_group.get_workers()
        self._ips = {str(w.distributed_context.world_rank): w.metadata.node_ip for w in workers}
        self._node_ids = {str(w.distributed_context.world_rank): w.metadata.node_id for w in workers}
        self._processes = [(w.metadata.node_id, w.metadata.pid) for w in workers]
        self._start_step = checkpoint_step(self.metrics.last_checkpoint_name() or self.resumed_from)
        self._failed = None
        self.metrics.note_group(self._node_ids)

    @never_fails
    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if worker_group_status.errors and self._failed is None:
            failure = summarize_failure(worker_group_status.errors, self._node_ids, dead_nodes(), self._ips)
            self._failed = (failure, self._last_step())

    @never_fails
    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if self._failed is None:
            return
        failure, step = self._failed
        self._failed = None
        if failure_decision != FailureDecision.RETRY:  # RAISE: the run ends here, and the driver
            self.metrics.note_last_step(step)  # records why, at the step its heartbeats reached
            return
        checkpoint = self.metrics.last_checkpoint_name() or self.resumed_from
        # a node that died after its preemption notice, once its checkpoint was saved
        preempted = failure.preempted or self.metrics.preempted_at(checkpoint_step(checkpoint))
        self.metrics.add_event(restart_event(failure, step, checkpoint, preempted))

    def _last_step(self) -> int:
        """The last step any rank of the failed group finished, as far as this group told:
        its heartbeats (every few seconds, so also between reports), its last report, and
        never less than the checkpoint it started from. An earlier group's steps never
        count (a group restarted from scratch redoes them)."""
        reported = max(self.metrics.group_step() or 0, self._start_step)
        if self.watch is None:
            return reported
        try:
            import ray

            return max(reported, ray.get(self.watch.last_step.remote(self._processes), timeout=5))
        except Exception:  # the watch is the driver's: without it, the reports say enough
            return reported
