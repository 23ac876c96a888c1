"""How long `bash scripts/install.sh` takes into a new virtual environment, against the
same packages installed the way it used to (pip compiling every file as it installs).

Two arms, each into a new venv in a temporary folder, in paired rounds that alternate
which goes first:
  pip-compiles  pip install torch==2.13.0, then pip install -e '.[test]' (pip's default:
                each installed file compiled to bytecode, one at a time)
  script        `VENV=<new venv> bash scripts/install.sh`: the same installs with
                --no-compile, then compileall on every core
Measured: the install's wall time, and then the first import of what a training worker
imports (torch, Ray Train, transformers, pyarrow, mlflow, datasets) in the new venv: a
file left uncompiled would be compiled there, at every process start where
PYTHONDONTWRITEBYTECODE is set. Both arms install from pip's cache after the first
round, as CI on a machine that installed before does.

    python benchmarks/install_time.py --rounds 2
Runs on the machine it measures. The figures also go to
benchmarks/results/install_time-<machine>-<date>.json (--results-dir, --no-save; see
benchmarks/_results.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _results import add_result_args, rounds_by, save_result  # noqa: E402

ARMS = ("pip-compiles", "script")
IMPORTS = "import torch, ray, ray.train.torch, transformers, pyarrow.parquet, mlflow, datasets"


def install(arm: str, venv: str) -> None:
    if arm == "script":
        subprocess.run(["bash", os.path.join(REPO, "scripts", "install.sh")], check=True,
                       env={**os.environ, "VENV": venv, "PYTHON": sys.executable}, cwd=REPO,
                       stdout=subprocess.DEVNULL)  # the interpreter of the other arm
        return
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = os.path.join(venv, "bin", "python")
    for args in (["--upgrade", "pip"], ["torch==2.13.0"], ["-e", ".[test]"]):
        subprocess.run([py, "-m", "pip", "install", "--quiet", *args], check=True, cwd=REPO)


def run_arm(arm: str) -> dict:
    folder = tempfile.mkdtemp(prefix="install_time_")
    venv = os.path.join(folder, "venv")
    try:
        started = time.perf_counter()
        install(arm, venv)
        install_s = time.perf_counter() - started
        started = time.perf_counter()
        subprocess.run([os.path.join(venv, "bin", "python"), "-c", IMPORTS], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return {"arm": arm, "install_s": install_s, "first_import_s": time.perf_counter() - started}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    add_result_args(parser)
    args = parser.parse_args(argv)
    runs = []
    for round_no in range(args.rounds):
        order = ARMS if round_no % 2 == 0 else ARMS[::-1]
        for arm in order:
            r = {**run_arm(arm), "round": round_no}
            runs.append(r)
            print(f"round {round_no + 1}/{args.rounds} {arm}: install {r['install_s']:.1f} s, "
                  f"first import {r['first_import_s']:.1f} s", flush=True)
    rounds = rounds_by(runs)
    med = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm)
                 for k in ("install_s", "first_import_s")} for arm in ARMS}
    paired = [e["arms"]["script"]["install_s"] / e["arms"]["pip-compiles"]["install_s"] for e in rounds]
    result = {"setup": f"{os.cpu_count()} CPUs, a new venv per arm and round",
              "install_s": {a: round(m["install_s"], 1) for a, m in med.items()},
              "first_import_s": {a: round(m["first_import_s"], 2) for a, m in med.items()},
              "paired_ratio": round(statistics.median(paired), 3), "paired_ratio_all": [round(p, 3) for p in paired]}
    print("\n| arm | install s | first import s |\n|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {med[arm]['install_s']:.1f} | {med[arm]['first_import_s']:.2f} |")
    print(f"install.sh x pip compiling, paired: {result['paired_ratio']:.3f}")
    command = None if argv is None else ["python", "benchmarks/install_time.py", *argv]
    save_result(args, "install_time", result, rounds, command=command)


if __name__ == "__main__":
    main()
