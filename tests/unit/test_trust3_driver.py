"""The driver's own watchers, third round of trust (issue 56, items 11 and 13), no Ray:
- the progress poll on a storage whose reads fail: a failed read is tried again at the
  next poll, the last read after a fit cannot change how the fit ended, and an error the
  poll did not expect is one warning line, after which it goes on;
- a worker killed by Ray's memory monitor, as Ray 2.60 tells it (its typed
  OutOfMemoryError, or an ActorDiedError whose exit type is NODE_OUT_OF_MEMORY and whose
  detail names the raylet), is an out-of-memory kill, not a lost node, and an elastic run
  does not restart it."""

from __future__ import annotations

import time

import pytest
from flaky_fs import flaky_fs
from pyarrow.fs import LocalFileSystem

import ray_ddp.storage as storage
from ray_ddp.record.failures import describe_loss, summarize_failure
from ray_ddp.record.progress import show_progress
from ray_ddp.driver.restart_decision import RestartPolicyConfig, RestartState, decide_restart
from ray_ddp.errors import StorageError, TrainingError
from ray_ddp.storage import Storage, write_json
from ray_ddp.record.folder import RunFolder

# --- item 11: the progress poll ---------------------------------------------------------


def progress(step, **extra):
    return {"epoch": 1, "epochs": 2, "step": step, "total_steps": 20, "loss": 0.5,
            "samples_per_s": 1234.0, "world_size": 2, "checkpoint": None, "time": time.time(),
            "straggler": None, **extra}


@pytest.fixture
def flaky(tmp_path, monkeypatch):
    """A run folder on a real filesystem whose reads of progress.json fail on demand
    (``handler.fail_opens``), each storage read tried once (no backoff to wait out)."""
    monkeypatch.setattr(storage, "RETRIES", 1)
    fs = flaky_fs(0, match="progress.json")
    return Storage(uri=str(tmp_path), fs=fs, path=str(tmp_path)), fs.handler, str(tmp_path)


def fail_reads(handler, count):
    handler.failed, handler.fail_opens = 0, count


def wait_for(condition, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_failed_last_read_after_a_fit_does_not_fail_it(flaky):
    """The fit returned: the display's last read of progress.json fails (a dropped
    connection), and the block still ends as the fit did, with no StorageError."""
    store, handler, path = flaky
    lines = []
    with show_progress(RunFolder(store.fs, path), lines.append, enabled=True, every_s=60):
        write_json(store.fs, f"{path}/progress.json", progress(10))
        fail_reads(handler, 100)  # every read from here on fails
    assert handler.failed >= 1  # the last read was made, and failed
    assert all(line.startswith("epoch") or line.startswith("warning") for line in lines)


def test_a_failed_first_read_does_not_stop_the_fit_from_starting(flaky):
    store, handler, path = flaky
    write_json(store.fs, f"{path}/progress.json", progress(5))
    fail_reads(handler, 1)
    ran = []
    with show_progress(RunFolder(store.fs, path), lambda line: None, enabled=True, every_s=60):
        ran.append(True)
    assert ran == [True] and handler.failed == 1


def test_a_fit_that_failed_keeps_its_own_error_when_the_last_read_fails(flaky):
    store, handler, path = flaky
    with pytest.raises(TrainingError, match="rank 1"):
        with show_progress(RunFolder(store.fs, path), lambda line: None, enabled=True, every_s=60):
            fail_reads(handler, 100)
            raise TrainingError("training failed on rank 1: boom")


def test_a_transient_read_error_in_the_poll_is_tried_again_at_the_next_poll(flaky):
    store, handler, path = flaky
    lines = []
    with show_progress(RunFolder(store.fs, path), lines.append, enabled=True, every_s=0.05):
        write_json(store.fs, f"{path}/progress.json", progress(5))
        assert wait_for(lambda: len(lines) == 1)
        fail_reads(handler, 3)  # three polls in a row fail (the controller's writes go through)
        write_json(LocalFileSystem(), f"{path}/progress.json", progress(10, time=time.time() + 1))
        assert wait_for(lambda: handler.failed == 3)
        # while the fit still runs: the poll survived its failed reads and shows the report
        assert wait_for(lambda: len(lines) == 2), lines
    assert lines == ["epoch 1/2  step 5/20  loss 0.5000  1,234 samples/s",
                     "epoch 1/2  step 10/20  loss 0.5000  1,234 samples/s"]


def test_an_unexpected_error_in_the_poll_is_one_warning_line_and_the_poll_goes_on(flaky):
    """A progress.json the display cannot show (a straggler record without its figures,
    from another version's controller): one warning line, never a silent dead thread,
    and the next report is shown while the fit runs."""
    store, _, path = flaky
    lines = []
    with show_progress(RunFolder(store.fs, path), lines.append, enabled=True, every_s=0.05):
        write_json(store.fs, f"{path}/progress.json", progress(5, straggler={"rank": 1, "since_step": 5}))
        assert wait_for(lambda: len(lines) >= 1)
        time.sleep(0.2)  # polls that read the same file again
        write_json(store.fs, f"{path}/progress.json", progress(10, time=time.time() + 1))
        assert wait_for(lambda: any("step 10/20" in line for line in lines)), lines
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "\n" not in warnings[0], lines
    assert "KeyError" in warnings[0] and "progress" in warnings[0]
    assert lines[-1] == "epoch 1/2  step 10/20  loss 0.5000  1,234 samples/s"


def test_a_storage_error_is_still_a_storage_error_to_the_other_readers(flaky):
    """Only the display forgives a failed read: read_progress keeps its contract."""
    from ray_ddp.record.progress import read_progress

    store, handler, path = flaky
    write_json(store.fs, f"{path}/progress.json", progress(5))
    fail_reads(handler, 1)
    with pytest.raises(StorageError):
        read_progress(RunFolder(store.fs, path))


# --- item 13: a worker Ray's memory monitor killed --------------------------------------

# What Ray 2.60's raylet writes when its memory monitor kills workers (its format
# strings, filled in): the kill's first line, the node's memory, and the pointer to the
# raylet's log, whose word "raylet" made it a lost node.
OOM_DETAIL = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node "
    "(IP: 10.0.0.7, ID: 6c3d1f0a9b8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6b5a49382) was 7.61GB used / "
    "7.75GB limit (0.982000)\nRay killed 1 worker(s) based on the killing policy\nConsidered workers: "
    "[(Worker with no lease granted: job ID=01000000, lease ID=ab, task name=RayTrainWorker.__init__, "
    "required resources={CPU: 1}, pid=4711, actual memory used=6.12GB, worker ID=9f)]\n"
    "To see more information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.7`\n"
    "Refer to the documentation on how to address the out of memory issue: "
    "https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html. Consider "
    "provisioning more memory on this node or reducing task parallelism by requesting more CPUs per task. "
    "To adjust the kill threshold, set the environment variable `RAY_memory_usage_threshold` when "
    "starting Ray. To disable worker killing, set the environment variable "
    "`RAY_memory_monitor_refresh_ms` to zero.")
# The GCS's words for an actor whose worker died, as Ray 2.60 writes them.
DIED = "The actor is dead because its worker process has died. Worker exit type: {} Worker exit detail: {}"
SIGKILLED = DIED.format("SYSTEM_ERROR", "Worker unexpectedly exits with a connection error code 2. End of "
                        "file. Some common causes include: (1) the process was killed by the OOM killer due "
                        "to high memory usage, (2) ray stop --force was called, or (3) the worker crashed "
                        "unexpectedly due to SIGSEGV or another unexpected error.")


def actor_died(message: str, pid: int = 4711, ip: str = "10.0.0.7"):
    """Ray's ActorDiedError for a worker that died, as the controller's health check
    hands it to Ray Train (wrapped in WorkerHealthCheckFailedError)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    context = ActorDiedErrorContext(error_message=message, pid=pid, node_ip_address=ip,
                                    class_name="RayTrainWorker", actor_id=bytes(16))
    return health_check(ActorDiedError(cause=context))


def health_check(error: Exception):
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: Worker(rank=1)", error)


def oom_errors():
    from ray.exceptions import OutOfMemoryError

    return {"actor died, NODE_OUT_OF_MEMORY": actor_died(DIED.format("NODE_OUT_OF_MEMORY", OOM_DETAIL)),
            "typed OutOfMemoryError": health_check(OutOfMemoryError(OOM_DETAIL))}


@pytest.mark.parametrize("kind", ["actor died, NODE_OUT_OF_MEMORY", "typed OutOfMemoryError"])
def test_a_worker_the_memory_monitor_killed_is_out_of_memory_not_a_lost_node(kind):
    survivor = RuntimeError("RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer")
    failure = summarize_failure({0: survivor, 1: oom_errors()[kind]}, {"0": "a" * 40, "1": "b" * 40})
    assert (failure.rank, failure.node, failure.lost) == (1, "10.0.0.7", "oom")
    line = describe_loss(failure, 37)
    assert "\n" not in line
    assert line.startswith("rank 1 on node 10.0.0.7 ran out of host memory at step 37"), line
    for words in ("7.61GB used / 7.75GB limit", "--loader-workers", "--batch-size", "--strategy fsdp"):
        assert words in line, line


@pytest.mark.parametrize("kind", ["actor died, NODE_OUT_OF_MEMORY", "typed OutOfMemoryError"])
def test_an_elastic_run_does_not_restart_an_out_of_memory_kill(kind):
    """The same options run out of memory again: an elastic run, which restarts after a
    lost worker or node, stops at once, and no flag is offered as the way on."""
    failure = summarize_failure({1: oom_errors()[kind]}, {"1": "b" * 40})
    for policy in (RestartPolicyConfig(elastic=True, max_failures=None, max_preemptions=-1),
                   RestartPolicyConfig(elastic=False, max_failures=None, max_preemptions=-1)):
        decision = decide_restart(failure, policy, RestartState(), set(), {"b" * 40}, "step-00000010")
        assert (decision.restart, decision.reason, decision.preemption) == (False, "", False)


def test_a_sigkill_and_a_lost_node_are_told_as_before():
    """Ray's words for a killed process name the kernel's OOM killer among its guesses:
    still a lost process; a node that died is still a lost node."""
    failure = summarize_failure({1: actor_died(SIGKILLED)}, {})
    assert (failure.lost, failure.cause) == ("process", "its process 4711 died")
    node = summarize_failure({1: actor_died(DIED.format("NODE_DIED", "The node running this actor died "
                                                        "(missing too many heartbeats)"))}, {})
    assert (node.lost, node.cause) == ("node", "its node died")


def test_a_worker_whose_node_ray_holds_dead_is_a_lost_node_whatever_its_words():
    """Ray's node table first: the words of a process's death on a node Ray has marked
    dead are a lost node (a restart then looks for that node's notice), and the same
    words on a live node are a lost process."""
    nodes = {"1": "b" * 40}
    failure = summarize_failure({1: actor_died(SIGKILLED)}, nodes, dead_nodes={"b" * 40: "10.0.0.7"})
    assert (failure.lost, failure.cause, failure.node_id) == ("node", "its node died", "b" * 40)
    alive = summarize_failure({1: actor_died(SIGKILLED)}, nodes, dead_nodes={"c" * 40: "10.0.0.9"})
    assert (alive.lost, alive.cause) == ("process", "its process 4711 died")


def test_a_survivors_failure_names_its_nodes_whole_address():
    """A peer's broken connection names no IP: the rank's own, whole (not cut as an ID)."""
    survivor = RuntimeError("RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer")
    failure = summarize_failure({0: survivor}, {"0": "a" * 40}, ips={"0": "192.168.100.200"})
    assert (failure.lost, failure.node) == ("peer", "192.168.100.200")
    assert summarize_failure({0: survivor}, {"0": "a" * 40}).node == "a" * 12  # no address known: the ID's head


def test_when_only_survivors_spoke_a_rank_on_a_node_ray_holds_dead_is_named():
    """The gloo error of a survivor arrives before the dead rank's: if Ray already holds
    that rank's node dead, the line names it, not the survivor's broken connection."""
    survivor = RuntimeError("RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer")
    nodes, ips = {"0": "a" * 40, "1": "b" * 40}, {"0": "10.0.0.6", "1": "10.0.0.7"}
    failure = summarize_failure({0: survivor}, nodes, {"b" * 40: "10.0.0.7"}, ips)
    assert (failure.rank, failure.node, failure.lost, failure.node_id) == (1, "10.0.0.7", "node", "b" * 40)
    assert describe_loss(failure, 37) == "rank 1 on node 10.0.0.7 was lost (its node died) at step 37"
    assert summarize_failure({0: survivor}, nodes, {"b" * 40: "10.0.0.7"}).node == "10.0.0.7"  # Ray's address of it
    assert summarize_failure({0: survivor}, nodes, {}, ips).lost == "peer"  # nothing known dead yet


def test_a_cuda_out_of_memory_error_is_an_error_in_training():
    """torch's CUDA OOM is raised in the training code (the process lives): not host memory."""
    error = RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    failure = summarize_failure({0: error}, {})
    assert failure.lost is None
