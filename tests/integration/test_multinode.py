"""A real two-node Ray cluster on this machine (a 1-CPU head and a 1-CPU worker node "b" on
loopback, with Ray's token authentication on; see _cluster.py), and what runs on it:
- `ray job submit` of a training job across both nodes (under HSDP), and of one that cannot fit;
- an elastic run (`--workers 1-2`) that loses node b without notice and shrinks, then a
  later run that grows back onto a new node b, where b is then drained for preemption
  the way the autoscaler does it (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`)
  and taken before the deadline. One story, two runs: each start of Ray Train costs ~20 s here.
The story takes about 3 minutes, most of them waiting (a 30-s drain deadline, Ray's
restarts), so it starts with the first integration test, in a thread (conftest.py's
``multinode``), and runs beside the others; the jobs follow in the same thread, once it
is over, on a new node b, and `ray-ddp doctor` over both nodes, b slowed (named); the
tests read what they saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from ray_ddp import TrainConfig
from ray_ddp.checkpoint.format import MODEL_FILE
from ray_ddp.checkpoint.snapshots import SNAPSHOT_DIR_ENV
from ray_ddp.worker.probes import DELAY_ENV

from gloo_run import train_in_gloo

from ._cluster import LoopbackCluster, loopback_cluster
from ._runs import run_in_thread, summary_of

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELPERS = os.path.join(ROOT, "tests", "helpers")
GCS_PORT, DASHBOARD_PORT = 46379, 48265
STEPS = 40  # per epoch of the elastic story
# slow_toy's sleep per micro-batch on the cluster's nodes. The drain comes early in run B's
# third epoch, and B checkpoints every 2 epochs (--checkpoint-every 2), so a checkpoint at
# any step from the drain to the end of epoch 4 (40 s at 0.5 s a step) is the preemption's,
# not one that would come anyway; the test allows 15 s from the drain to the checkpoint, so
# a slow notice fails that bound, not this one by chance. On a busy 2-core machine the
# notice took up to 10 s, and with B checkpointing every epoch it once fell on epoch 3's
# last step. Sleeping costs no CPU.
STEP_S = 0.5
ELASTIC = ["--model", "user_models:slow_toy", "--workers", "1-2", "--steps-per-epoch", str(STEPS),
           "--batch-size", "16", "--report-every", "5", "--warmup-steps", "3", "--clip-grad", "1.0"]


def cluster_and_story(tmp_path_factory):
    """A head and one worker node b, 1 CPU each, and the elastic story started on them
    (a generator for conftest.py's session fixture)."""
    # Ray Train's preemption watcher polls drains every second (5 s by default); the GCS
    # declares a silent node dead after ~3 s (15 s by default); right after a node is lost
    # Ray's resource view can still count it (it refreshes every 20 s), and Ray Train
    # then waits for a worker group that cannot start before it tries a smaller one:
    # 20 s here instead of 60 (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), still room for a
    # start on a busy 2-core machine. A test needs no patience.
    # Each process that connects as a driver (a probe, a `ray job submit` job, a training
    # command) would make the raylets start idle workers for it, which this story never
    # asks for: RAY_prestart_worker_first_driver=0.
    env = {"RAY_prestart_worker_first_driver": "0",
           "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", "RAY_health_check_period_ms": "1000",
           "RAY_health_check_failure_threshold": "3", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
           "PYTHONPATH": HELPERS, "SLOW_TOY_STEP_S": str(STEP_S)}
    cluster_gen = loopback_cluster(str(tmp_path_factory.mktemp("home")), GCS_PORT, DASHBOARD_PORT, env)
    c = next(cluster_gen)
    try:
        c.start_head()
        c.add_node("b", env=own_memory(tmp_path_factory))
        story = Story(c, tmp_path_factory.mktemp("story"))
        yield c, story
        story.result()  # never leave its thread running past the cluster
    finally:
        cluster_gen.close()


def own_memory(tmp_path_factory) -> dict[str, str]:
    """Node b's environment for its own in-memory snapshots: both nodes of this cluster
    share the machine's /dev/shm, where a real node b's would go with it."""
    import tempfile

    folder = tmp_path_factory.mktemp("b-memory") if tmp_path_factory else tempfile.mkdtemp(prefix="b-memory-")
    return {SNAPSHOT_DIR_ENV: str(folder)}


@pytest.fixture(scope="module")
def story(multinode):
    return multinode[1].result()


def job_status(c: LoopbackCluster, job_id: str) -> str:
    code = ("from ray.job_submission import JobSubmissionClient as C; "
            f"print(C({c.dashboard!r}).get_job_status({job_id!r}).value)")
    return c.run([sys.executable, "-c", code], timeout=60).stdout.strip()


def submitted_job_id(output: str) -> str:
    for line in output.splitlines():
        if "Job '" in line and "submitted successfully" in line:
            return line.split("Job '")[1].split("'")[0]
    raise AssertionError(f"no job id in:\n{output}")


def submit_jobs(c: LoopbackCluster, storage) -> dict:
    """After the story, on a new node b: `ray job submit` of a job across both nodes, and
    of one that cannot fit; what each printed, Ray's status of it, and how long it took."""
    if "b" not in c.procs:  # it comes late to each of the doctor's all-reduces (after the jobs)
        c.add_node("b", env={DELAY_ENV: "0.4", **own_memory(None)})
    jobs = {}
    # job1 under HSDP: each node's ranks a shard group (here one rank each), the two nodes
    # replicas whose gradients are all-reduced
    for name, args in (("job1", ["--workers", "2", "--epochs", "2", "--steps-per-epoch", "10",
                                 "--report-every", "5", "--strategy", "hsdp", "--json"]),
                       ("nofit", ["--gpus-per-worker", "1", "--workers", "8"])):
        env = {**c.env, "RAY_ADDRESS": c.dashboard, "STORAGE": str(storage), "NAME": name}
        started = time.time()
        out = subprocess.run(c.prefix + ["bash", os.path.join(ROOT, "examples", "submit_job.sh"), *args],
                             env=env, capture_output=True, text=True, timeout=600)
        took = time.time() - started
        status = job_status(c, submitted_job_id(out.stdout)) if "submitted successfully" in out.stdout else None
        jobs[name] = dict(out=out, took=took, status=status)
    return jobs


def doctor_with_a_slowed_node(c: LoopbackCluster, storage) -> dict:
    """`ray-ddp doctor` over the head and node b, which comes 0.4 s late to each of the
    doctor's all-reduces (what a slow node does to a whole group; submit_jobs started it
    so): its JSON and exit code, and which node is b."""
    storage.mkdir()
    out = c.run([sys.executable, "-m", "ray_ddp", "doctor", "--address", c.address, "--workers", "2",
                 "--storage", str(storage), "--json"], timeout=400)
    return {"out": out, "b": [n["id"] for n in ray_nodes(c) if not n["head"]], "storage": storage}


def test_doctor_names_the_slowed_node_and_says_not_to_start(story):
    doctor = story["doctor"]
    out = doctor["out"]
    assert out.returncode == 1, out.stdout + out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    assert not found["ok"] and found["workers"] == 2 and len(found["nodes"]) == 2
    [slowed] = doctor["b"]
    late = {n["node_id"]: [p for p in n["problems"] if "late to each all-reduce" in p] for n in found["nodes"]}
    assert late.pop(slowed) and not any(late.values()), found
    # every node's figures, the link between the two nodes, and the storage left as it was
    assert all(n["storage"]["write_mb_s"] > 0 and n["matmul_tflops"][0] > 0 for n in found["nodes"])
    assert len(found["pairs"]) == 1 and found["pairs"][0]["busbw_gb_s"] > 0 and found["group_busbw_gb_s"] > 0
    assert list(doctor["storage"].iterdir()) == []


def test_submit_job_trains_across_two_nodes(story):
    storage, job = story["jobs_storage"], story["jobs"]["job1"]
    out = job["out"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert job["status"] == "SUCCEEDED"
    summary = json.loads([l for l in out.stdout.splitlines() if l.startswith('{"run"')][-1])
    assert (summary["world_size"], summary["epochs_completed"]) == (2, 2)
    # hsdp's checkpoints: DCP's shards, and the last one gathered into model.pt
    assert os.path.isfile(os.path.join(summary["checkpoint"], ".metadata"))
    assert os.path.isfile(os.path.join(summary["checkpoint"], "model.pt"))
    rows = pq.read_table(storage / "job1" / "metrics.parquet").to_pylist()
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in (5, 10, 15, 20) for r in (0, 1)]
    assert len({r["node_id"] for r in rows}) == 2, "one worker on each of the two Ray nodes"


def test_job_that_cannot_fit_fails_fast_with_one_line(story):
    storage, job = story["jobs_storage"], story["jobs"]["nofit"]
    out = job["out"]
    assert out.returncode == 1
    assert ("needs 8 workers x 1 GPU = 8 GPU; the cluster has 0 GPU and no autoscaler; "
            "pass --gpus-per-worker 0 to train on CPU") in out.stdout
    assert "Traceback" not in out.stdout
    assert job["status"] == "FAILED"
    assert not (storage / "nofit").exists()
    assert job["took"] < 60  # generous: the job itself fails in seconds


# ------------------------------------------------------------------ the elastic story
def start_training(c: LoopbackCluster, storage, name, log, *extra):
    argv = [sys.executable, "-m", "ray_ddp", "train", *ELASTIC, "--address", c.address,
            "--storage", str(storage), "--name", name, "--json", *extra]
    return c.popen(argv, log)


def finish(proc, log, timeout=300) -> dict:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = open(log).read()
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    return json.loads([line for line in out.splitlines() if line.startswith('{"run"')][-1])


def wait_for(predicate, what, proc, timeout=120, log=None):
    """``predicate()``'s first true value; a timeout or the training's end is an error that
    carries the end of the training's ``log``, so that a failure in CI explains itself."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"training ended while waiting for {what}{log_tail(log)}"
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} ({timeout} s){log_tail(log)}")


def log_tail(log, lines=40) -> str:
    if log is None or not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        return "; the training's log ends:\n" + "".join(f.readlines()[-lines:])


def progress(run_dir) -> dict:
    try:
        return json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def metrics_rows(run_dir):
    return pq.read_table(run_dir / "metrics.parquet").to_pylist()


class Story:
    """Run A (`--workers 1-2 --epochs 2 --max-failures 1`) starts on both nodes; node b is
    killed (raylet and workers, no notice) once epoch 1's checkpoint is Ray's; A finishes on
    the head alone. A new node b joins; run B (the same run, `--epochs 4 --max-failures 0
    --checkpoint-every 2`) grows back to 2 workers; b is drained for preemption with a 30 s
    deadline, and killed 10 s into it, after the preemption checkpoint; B finishes on the
    head. Beside it, in the gloo harness (no Ray), the reference: the same global batch on
    a fixed world of 2, never resized. Runs in a thread from its creation, and the jobs
    after it; ``result()`` waits for both (and raises what they raised)."""

    def __init__(self, cluster: LoopbackCluster, storage):
        self.cluster, self.storage = cluster, storage
        self.thread, self.outcome = run_in_thread(None, self._tell_then_submit)

    def _tell_then_submit(self) -> dict:
        """The story, then the jobs on a new node b, then `ray-ddp doctor` naming b, slowed;
        then the cluster stops, so its daemons idle beside no other test."""
        try:
            told = self._tell()
            jobs_storage = self.storage / "jobs"
            jobs = submit_jobs(self.cluster, jobs_storage)
            return {**told, "jobs": jobs, "jobs_storage": jobs_storage,
                    "doctor": doctor_with_a_slowed_node(self.cluster, self.storage / "doctor")}
        finally:
            self.cluster.stop()

    def result(self) -> dict:
        return summary_of(self.thread, self.outcome)

    def _tell(self) -> dict:
        cluster, storage = self.cluster, self.storage
        run_dir = storage / "story-spot"
        # the reference is ray_ddp's own loop on a fixed world, nothing of Ray: the gloo harness
        reference = run_in_thread(None, lambda: train_in_gloo(TrainConfig(
            model="user_models:slow_toy", workers=2, epochs=4, steps_per_epoch=STEPS, batch_size=16,
            report_every=5, warmup_steps=3, clip_grad=1.0, storage=str(storage), name="story-reference", quiet=True)))
        # the head's node ID, read before run A: a probe is a Ray driver's start (seconds, more
        # on a loaded machine), and between "epoch 2 reached" and the kill it let run A finish
        out = {"a_head": [n["id"] for n in ray_nodes(cluster) if n["head"]][0]}
        log = str(storage / "a.log")
        proc = start_training(cluster, storage, "story-spot", log, "--epochs", "2", "--max-failures", "1")
        try:
            # epoch 1's checkpoint, once Ray has it (the metrics table is written then)
            # 240 s: the story starts with the suite, beside the unit lane and three other
            # stories on 2 cores (a CI run once took more than 120 s to this checkpoint)
            wait_for(lambda: (run_dir / "metrics.parquet").exists(), "epoch 1's checkpoint", proc, 240, log)
            out["a_nodes"] = {r["rank"]: r["node_id"] for r in metrics_rows(run_dir)}
            # the node goes mid-epoch 2, two windows past epoch 1's checkpoint
            wait_for(lambda: progress(run_dir).get("step", 0) >= STEPS + 10, "run A in epoch 2", proc, 120, log)
            cluster.kill_node("b")
            out["a"], out["a_log"] = finish(proc, log), log
            # what a failure's line reads first: Ray's table of dead nodes (cluster/nodes.py)
            out["a_dead"] = json.loads(cluster.probe("import json; from ray_ddp.cluster.nodes import "
                                                     "dead_nodes; print(json.dumps(dead_nodes()))"))
        finally:
            if proc.poll() is None:
                proc.kill()

        cluster.add_node("b", env=own_memory(None))  # the autoscaler brings a node back
        log = out["b_log"] = str(storage / "b.log")
        proc = start_training(cluster, storage, "story-spot", log, "--epochs", "4", "--max-failures", "0",
                              "--checkpoint-every", "2")
        try:
            wait_for(lambda: progress(run_dir).get("world_size") == 2 and progress(run_dir)["step"] > 2 * STEPS,
                     "run B on 2 workers", proc, log=log)
            b_node = [n for n in ray_nodes(cluster) if not n["head"]][0]["id"]
            drain = cluster.run(["ray", "drain-node", "--address", cluster.address, "--node-id", b_node,
                                 "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                                 "--deadline-remaining-seconds", "30"], timeout=60)
            assert drain.returncode == 0, drain.stdout + drain.stderr
            noticed = time.time()
            out["event"] = wait_for(lambda: progress(run_dir).get("preemptions"), "the preemption checkpoint",
                                    proc, timeout=30, log=log)[0]
            out["notice_to_checkpoint_s"] = time.time() - noticed
            out["b_node"] = b_node
            # the cloud takes the machine 10 s into its 30 s notice, after the checkpoint:
            # a preemption still, not a failure (--max-failures 0)
            time.sleep(max(0.0, noticed + 10 - time.time()))
            cluster.kill_node("b")
            out["b"] = finish(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
        out["reference"] = summary_of(*reference)
        out["rows"] = metrics_rows(run_dir)
        out["status"] = json.loads((run_dir / "status.json").read_text())
        return out


def ray_nodes(c: LoopbackCluster) -> list[dict]:
    code = ("import json; print(json.dumps([{'id': n['NodeID'], 'head': 'node:__internal_head__' in "
            "n['Resources']} for n in ray.nodes() if n['Alive']]))")
    return json.loads(c.probe(code))


def test_an_elastic_run_shrinks_when_a_node_dies_and_grows_when_one_joins(story):
    a, b = story["a"], story["b"]
    assert len(set(story["a_nodes"].values())) == 2, "run A started on both nodes"
    # A lost node b without notice mid-epoch 2: a failure (--max-failures 1), then the head
    # alone, from the state the head held (its survivor's save, or its newest snapshot: DDP's
    # state is whole at any world size), never epoch 1's checkpoint in storage
    assert [s["world_size"] for s in a["world_sizes"]] == [2, 1]
    assert a["epochs_completed"] == 2 and a["preemptions"] == []
    [lost] = [e for e in a["events"] if e["type"] == "failure"]
    assert lost["from_node"] == story["a_head"] and lost["restarted"], lost  # (rank 0 may be b's)
    assert lost["step"] >= STEPS + 10 and lost["steps_lost"] <= 1, lost
    b_node = {n for n in story["a_nodes"].values() if n != story["a_head"]}
    assert b_node <= set(story["a_dead"]) and story["a_head"] not in story["a_dead"], story["a_dead"]
    assert set(story["a_dead"].values()) == {"127.0.0.1"}, story["a_dead"]  # its address: what a line names
    resumed = int(lost["from_checkpoint"][5:])
    assert f"restarted from the snapshot of step {resumed} on node {lost['from_node'][:8]}…" in \
        open(story["a_log"]).read()
    assert a["world_sizes"][0]["to_step"] <= resumed < a["world_sizes"][0]["to_step"] + 5
    # every window of A once (each rank's), the one the node's loss cut short redone on the head
    a_rows = [(r["step"], r["rank"]) for r in story["rows"] if r["step"] <= 2 * STEPS]
    assert sorted(a_rows) == [(step, rank) for step in range(5, 2 * STEPS + 1, 5)
                              for rank in ((0, 1) if step <= a["world_sizes"][0]["to_step"] else (0,))]
    # B, a later run, grew back to 2 on the new node
    assert [s["world_size"] for s in b["world_sizes"]][:3] == [2, 1, 2]
    assert b["world_sizes"][2]["from_step"] == 2 * STEPS
    # the global batch never changed, so the weights are the unresized run's, to float rounding
    expected = torch.load(os.path.join(story["reference"].checkpoint, MODEL_FILE), weights_only=True)
    got = torch.load(os.path.join(b["checkpoint"], MODEL_FILE), weights_only=True)
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


def test_a_preempted_node_gets_a_checkpoint_at_once_and_the_run_goes_on_without_it(story):
    b, event, rows = story["b"], story["event"], story["rows"]
    step = event["step"]
    assert story["notice_to_checkpoint_s"] < 15  # the watcher polls every 1 s, the loop asks every 1 s
    assert step % (2 * STEPS), "a checkpoint between B's own (every 2 epochs), not one of them"
    out = open(story["b_log"]).read()
    assert (f"node {story['b_node'][:12]} is being preempted (deadline in " in out
            and f"checkpoint step-{step:08d} saved" in out), out
    # b died before its deadline: the driver restarted from the preemption checkpoint
    assert (f"restarting from step-{step:08d} (its node was being preempted; preemption 1, "
            "not a failure)") in out, out
    # B went on with the head alone from that checkpoint and finished: the preemption did
    # not use up --max-failures 0
    assert b["epochs_completed"] == 4 and b["steps"] == 4 * STEPS
    assert b["world_sizes"][2:] == [{"world_size": 2, "from_step": 2 * STEPS, "to_step": step},
                                    {"world_size": 1, "from_step": step, "to_step": 4 * STEPS}]
    assert [(p["step"], p["node_id"]) for p in b["preemptions"]] == [(step, story["b_node"])]
    # each change of world size was said as it happened, and recorded
    assert f"resize after step {2 * STEPS}: world size 1 -> 2" in out, out
    assert f"resize after step {step}: world size 2 -> 1" in out, out
    assert [(e["step"], e["cause"]) for e in b["events"] if e["type"] == "resize"][-2:] == \
        [(2 * STEPS, "world size 1 -> 2"), (step, "world size 2 -> 1")], b["events"]
    # its death before the deadline is recorded as a preemption event, not a failure
    assert [e["type"] for e in b["events"] if e["type"] != "resize"][-1:] == ["preemption"], b["events"]
    assert not [e for e in b["events"] if e["type"] == "failure" and e["step"] > 2 * STEPS]
    # no step trained after the preemption checkpoint was lost: the workers stopped there
    assert max(r["step"] for r in rows if r["world_size"] == 2) == step
    assert {r["world_size"] for r in rows if r["step"] > step} == {1}
    assert [r["step"] for r in rows if r.get("preempted_node")] == [step, step]  # both ranks' rows
    assert story["status"]["state"] == "complete" and story["status"]["world_sizes"] == b["world_sizes"]
