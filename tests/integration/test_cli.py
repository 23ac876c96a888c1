"""The ray-ddp command as a user runs it: a real process, a real local Ray it starts."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ONLY_ENV


pytestmark = pytest.mark.ray


def start_default_job(home):
    """The command as a process of its own, started (conftest.py's ``default_job`` starts
    it with the first integration test: most of its wall time is its own Ray's start-up
    and Ray Train's production polling, which the other tests fill)."""
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    # Ray Train's production settings (its preemption watcher on), as users get them
    for name in TEST_ONLY_ENV:
        env.pop(name, None)
    with open(home / "stdout", "w") as out, open(home / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "ray_ddp", "train", "--json"], env=env,
                                stdout=out, stderr=err, text=True, cwd=home), home


def test_train_with_no_flags_runs_the_default_toy_job(default_job):
    started, tmp_path = default_job
    try:
        started.wait(timeout=300)
    except subprocess.TimeoutExpired:  # say where it stood: its own lines, its run's status
        status = sorted(tmp_path.glob("ray_ddp_runs/*/status.json"))
        pytest.fail("the default job did not end in 300 s; its stdout ends:\n" + (tmp_path / "stdout").read_text()[-2000:]
                    + "\nits stderr ends:\n" + (tmp_path / "stderr").read_text()[-4000:]
                    + "".join(f"\n{path}: {path.read_text()[:1000]}" for path in status))
    proc = subprocess.CompletedProcess(started.args, started.returncode, (tmp_path / "stdout").read_text(),
                                       (tmp_path / "stderr").read_text())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    # a Ray of its own: the 2 CPU workers share the machine's real cores (this test process
    # reports 16, see conftest; the command is a process of its own)
    cores = os.sysconf("SC_NPROCESSORS_ONLN")
    assert f"2 workers x {max(1, cores // 2)} CPU, backend gloo, model toy" in lines[0]
    assert any(line.startswith("epoch 3/3  step 60/60") for line in lines)
    summary = json.loads(lines[-1])
    assert set(summary) >= {"run", "path", "world_size", "gpus_per_worker", "epochs_completed",
                            "final_loss", "samples_per_s", "checkpoint", "metrics", "resumed_from"}
    assert (summary["world_size"], summary["epochs_completed"], summary["resumed_from"]) == (2, 3, None)
    assert summary["path"].startswith(str(tmp_path / "ray_ddp_runs"))
    assert os.path.isfile(summary["metrics"]) and os.path.isdir(summary["checkpoint"])
    assert "Traceback" not in proc.stderr
    # every window of every rank reached the table, however the sends were batched
    rows = pq.read_table(summary["metrics"]).to_pylist()
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in range(10, 61, 10) for r in (0, 1)]
    done = next(line for line in lines if line.startswith("done: 3/3 epochs"))
    assert (f"{summary['samples_per_s']:,.0f} samples/s in training steps, "
            f"{summary['train_samples_per_s']:,.0f} samples/s from the first step to the last, "
            f"{summary['wall_samples_per_s']:,.0f} samples/s over the wall time") in done
