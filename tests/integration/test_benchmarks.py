"""The GPU user's benchmark, in its smallest form: it runs here (CPU sizes) and prints
its table. What it measures is not asserted: timings belong in benchmarks, not tests."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_preset_runs_on_cpu_and_prints_its_table(ray_address, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_address}  # its ray-ddp arm attaches to the shared Ray
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "throughput.py"), "--preset", "gpu",
                           "--workers", "1", "--rounds", "1", "--warmup", "10", "--steps", "10",
                           "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "MLP 256-256x256-16, bf16, batch 64/worker" in proc.stdout  # the CPU sizes, in bf16
    assert "| workers | arm | steady samples/s | x torchrun |" in lines[-4]
    assert lines[-2].startswith("| 1 | torchrun | ") and lines[-1].startswith("| 1 | ray-ddp | ")
    # its result file, with the paired rounds, went where it was told (never into the repo)
    [result] = tmp_path.glob("throughput-*.json")
    assert '"rounds"' in result.read_text()
