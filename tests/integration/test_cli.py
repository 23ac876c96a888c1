"""The ray-ddp command as a user runs it: a real process, a real local Ray it starts."""

import json
import os
import subprocess
import sys

import pytest

from ray_ddp.cli import main

pytestmark = pytest.mark.ray


def test_train_with_no_flags_runs_the_default_toy_job(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "ray_ddp", "train", "--json"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "2 workers x 1 CPU, backend gloo, model toy" in lines[0]
    assert any(line.startswith("epoch 3/3  step 60/60") for line in lines)
    summary = json.loads(lines[-1])
    assert set(summary) >= {"run", "path", "world_size", "gpus_per_worker", "epochs_completed",
                            "final_loss", "samples_per_s", "checkpoint", "metrics", "resumed_from"}
    assert (summary["world_size"], summary["epochs_completed"], summary["resumed_from"]) == (2, 3, None)
    assert summary["path"].startswith(str(tmp_path / "ray_ddp_runs"))
    assert os.path.isfile(summary["metrics"]) and os.path.isdir(summary["checkpoint"])
    assert "Traceback" not in proc.stderr
