"""A worker lost mid-epoch: what the restart redoes, how long it takes, what it reads back.

One job, two arms, side by side on one local Ray that this script starts (loopback only)
and in paired rounds alternating which goes first:
  ray-train  plain Ray Train as its documentation writes it: TorchTrainer, prepare_model,
             rank 0 saving model and optimizer with ray.train.report(checkpoint=...) at
             each epoch's end, FailureConfig(max_failures=1), and on (re)start the
             checkpoint of ray.train.get_checkpoint() loaded by every rank
  ray-ddp    ray_ddp.run with checkpoint_every_steps=5, snapshot_every_steps=0 and
             max_failures=1 (what `ray-ddp train --checkpoint-every-steps 5
             --snapshot-every-steps 0 --max-failures 1` runs; the Python API, so that the
             killing model below reaches the workers): checkpoints in run storage only
  ray-ddp-snapshots  ray_ddp.run with its in-memory snapshots (by default at the cadence
             their cost allows; --snapshot-every K: every K steps) and no step checkpoints:
             rank 0, rank 1's survivor, saves the state of step 44 as rank 1 dies, and the
             restart loads it from the node's memory
The job: an mlp (10 inputs, 2 hidden layers of 1024, 5 outputs), 2 CPU workers, 2 epochs
of 30 steps of 32 rows per worker (ray-ddp's synthetic rows of seed 0, which the plain
loop takes too), SGD (lr 0.05, momentum 0.9), the same initial weights; each training
forward sleeps --step-s so that a step is long against Ray Train's poll of its workers.
In the first life of the worker group, rank 1 SIGKILLs itself (as the OOM killer does) in
the forward of step --kill-at (45: the 15th of epoch 2), once (a marker file, as the
tests' DiesOnRankOne). Each arm's figures, from one hook on both (a global
optimizer-step hook that logs each finished step of rank 0 per process):
  steps redone     steps rank 0 had finished when rank 1 died, less the step the new group
                   resumed from (total steps less those the new group ran)
  kill to step s   from the kill (the time rank 1 wrote into the marker just before it)
                   to the new group's first finished optimizer step on rank 0
  MB read back     bytes of the checkpoint files (files in a Ray `checkpoint_*` or ray-ddp
                   `step-*` folder) read from run storage between the kill and that first
                   step, by any process: Linux inotify reports every close of a file
                   opened read-only under the storage folder, and each counts as the
                   file's whole size at its opening (torch.load and a CRC check read all
                   of it). Every rank reads for itself, so two ranks loading one file
                   count twice; inotify merges two like events in a row that were
                   not yet read, so two closes of one file at the same instant count
                   once: a lower bound. `all MB` is every file read in that window,
                   the checkpoints included.
The figures are medians over the rounds, and each ray-ddp figure's paired ratio to
ray-train's. Snapshots live in the node's /dev/shm, outside run storage: the snapshot arm
reads back no checkpoint from storage.

    python benchmarks/recovery.py --rounds 3
Linux only (inotify). The figures also go to benchmarks/results/recovery-<machine>-<date>.json
(--results-dir, --no-save; see benchmarks/_results.py), rendered into docs/performance.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import select
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _procs import start_ray  # noqa: E402

ARMS = ("ray-train", "ray-ddp", "ray-ddp-snapshots")
INPUT_DIM, OUTPUT_DIM, SEED, LR = 10, 5, 0, 0.05  # ray-ddp's synthetic task and defaults
CHECKPOINT_DIR = re.compile(r"checkpoint_.*|step-\d+")  # Ray Train's and ray-ddp's folders


# ---------------------------------------------------------------------------------------
# the model both arms train (on the workers)


def step_log(control: str) -> dict:
    """This process's count of finished optimizer steps, kept by a global optimizer-step
    hook registered once per process; rank 0 also appends each step's end time to
    ``control/steps-<pid>.log``. The count starts again for another run's ``control`` or
    where the rank was unknown (a process outside Ray Train, the driver, has none)."""
    state = getattr(sys, "_recovery_bench_steps", None)
    if state is None:
        state = sys._recovery_bench_steps = {}

        def finished(_optimizer, _args, _kwargs):
            state["steps"] += 1
            if state["rank"] == 0:
                with open(state["path"], "a") as f:
                    f.write(f"{time.time()}\n")

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(finished)
    if state.get("control") != control or state.get("rank") is None:
        try:
            import ray.train

            rank = ray.train.get_context().get_world_rank()
        except (ImportError, RuntimeError):
            rank = None
        state.update(control=control, steps=0, rank=rank, path=os.path.join(control, f"steps-{os.getpid()}.log"))
    return state


class SlowMLP(nn.Module):
    """ray-ddp's mlp whose training forward sleeps ``step_s``; rank 1 SIGKILLs itself in
    the forward of step ``kill_at`` of its first life (the marker file says it died)."""

    def __init__(self, control: str, kill_at: int, step_s: float, width: int):
        super().__init__()
        from ray_ddp.models.builtin import build_mlp

        torch.manual_seed(SEED)  # the same initial weights in both arms
        self.net = build_mlp(INPUT_DIM, OUTPUT_DIM, width, 2)
        self.control, self.kill_at, self.step_s = control, kill_at, step_s
        self.steps = step_log(control)

    def forward(self, x):
        if self.training:
            marker = os.path.join(self.control, "killed")
            if (self.steps["rank"] == 1 and self.steps["steps"] == self.kill_at - 1
                    and not os.path.exists(marker)):
                with open(marker, "w") as f:
                    f.write(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.step_s)
        return self.net(x)


def build_model(job: dict) -> nn.Module:
    return SlowMLP(job["control"], job["kill_at"], job["step_s"], job["width"])


# ---------------------------------------------------------------------------------------
# the two arms


def plain_train_func(job: dict) -> None:
    """On each Ray Train worker: the loop as Ray's documentation writes it."""
    import ray.train
    import ray.train.torch

    from ray_ddp.data.synth import synthetic_rows, teacher_weights

    rank = ray.train.get_context().get_world_rank()
    model = build_model(job)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"] + 1
    model = ray.train.torch.prepare_model(model)
    teacher = teacher_weights(SEED, INPUT_DIM, OUTPUT_DIM)
    for epoch in range(start_epoch, job["epochs"]):
        for step in range(job["steps_per_epoch"]):
            x, y = synthetic_rows(teacher, SEED, epoch, step, rank * job["batch"], job["batch"])
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(folder, "checkpoint.pt"))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"epoch": epoch, "loss": loss.item()}, checkpoint=saved)


def run_plain(job: dict, storage: str) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(plain_train_func, train_loop_config=job, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=storage, name="plain",
                                      failure_config=FailureConfig(max_failures=1))).fit()
    return {}


def run_ray_ddp(job: dict, storage: str, snapshots: bool = False) -> dict:
    import functools

    from ray_ddp import TrainConfig, run

    cfg = TrainConfig(workers=2, epochs=job["epochs"], steps_per_epoch=job["steps_per_epoch"],
                      batch_size=job["batch"], lr=LR, seed=SEED,
                      checkpoint_every_steps=None if snapshots else job["every"],
                      snapshot_every_steps=job["snapshot_every"] if snapshots else 0,
                      max_failures=1, storage=storage, name="ray-ddp", quiet=True)
    lines: list[str] = []
    summary = run(cfg, echo=lines.append, model=functools.partial(build_model, job))
    return {"events": [{k: e.get(k) for k in ("type", "rank", "step", "from_checkpoint", "steps_lost")}
                       for e in summary.events or []]}


# ---------------------------------------------------------------------------------------
# what the restart reads


class StorageReads:
    """Every file under ``root`` opened read-only and closed, with when and its size at
    its opening (Linux inotify; a thread reads the events and watches new folders)."""

    IN_CLOSE_NOWRITE, IN_OPEN, IN_CREATE, IN_MOVED_TO, IN_ISDIR = 0x10, 0x20, 0x100, 0x80, 0x40000000

    def __init__(self, root: str):
        self.root = root
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise SystemExit(f"inotify_init1 failed (errno {ctypes.get_errno()}): this benchmark needs Linux")
        self._dirs: dict[int, str] = {}
        self._sizes: dict[str, int] = {}
        self.reads: list[tuple[float, str, int]] = []  # (when, path under root, bytes)
        self._done = threading.Event()
        self._watch_tree()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _watch_tree(self) -> None:
        mask = self.IN_CLOSE_NOWRITE | self.IN_OPEN | self.IN_CREATE | self.IN_MOVED_TO
        for folder, _, _ in os.walk(self.root):
            if folder not in self._dirs.values():
                wd = self._libc.inotify_add_watch(self._fd, folder.encode(), mask)
                if wd >= 0:
                    self._dirs[wd] = folder

    def _follow(self) -> None:
        rescanned = 0.0
        while not self._done.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if ready:
                self._take(os.read(self._fd, 1 << 16), time.time())
            if time.monotonic() - rescanned > 0.2:  # folders made before their parent's watch
                self._watch_tree()
                rescanned = time.monotonic()

    def _take(self, buffer: bytes, now: float) -> None:
        offset = 0
        while offset < len(buffer):
            wd, mask, _, length = struct.unpack_from("iIII", buffer, offset)
            name = buffer[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
            offset += 16 + length
            path = os.path.join(self._dirs.get(wd, ""), name)
            if mask & self.IN_ISDIR:
                if mask & (self.IN_CREATE | self.IN_MOVED_TO):
                    self._watch_tree()
                continue
            if mask & self.IN_OPEN:
                try:
                    self._sizes[path] = os.stat(path).st_size
                except OSError:
                    pass
            elif mask & self.IN_CLOSE_NOWRITE:
                self.reads.append((now, os.path.relpath(path, self.root), self._sizes.get(path, 0)))

    def between(self, start: float, end: float) -> list[tuple[str, int]]:
        return [(path, size) for when, path, size in self.reads if start <= when <= end]

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        os.close(self._fd)


# ---------------------------------------------------------------------------------------
# one run, and the figures


def run_arm(arm: str, job: dict) -> dict:
    """One run of ``arm`` in a fresh folder: its figures (see the module's docstring)."""
    folder = tempfile.mkdtemp(prefix=f"bench_recovery_{arm}_")
    storage, control = os.path.join(folder, "storage"), os.path.join(folder, "control")
    os.makedirs(storage)
    os.makedirs(control)
    job = {**job, "control": control}
    reads = StorageReads(storage)
    started = time.time()
    try:
        extra = run_plain(job, storage) if arm == "ray-train" else \
            run_ray_ddp(job, storage, snapshots=arm == "ray-ddp-snapshots")
        wall = time.time() - started
        time.sleep(0.2)  # the watcher's last events
    finally:
        reads.close()
    try:
        return {"arm": arm, **figures(job, control, reads), "wall_s": wall, **extra}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def figures(job: dict, control: str, reads: StorageReads) -> dict:
    total = job["epochs"] * job["steps_per_epoch"]
    try:
        with open(os.path.join(control, "killed")) as f:
            killed_at = float(f.read())
    except OSError:
        raise SystemExit("rank 1 was never killed: is --kill-at within the run?") from None
    lives = []
    for name in os.listdir(control):
        if name.startswith("steps-"):
            with open(os.path.join(control, name)) as f:
                lives.append([float(line) for line in f if line.strip()])
    lives = sorted((life for life in lives if life), key=lambda life: life[0])
    if len(lives) != 2:
        raise SystemExit(f"expected rank 0 to live twice (before and after the kill), found {len(lives)} lives")
    before, after = lives
    first_step = after[0]
    window = reads.between(killed_at, first_step)
    checkpoint_bytes = sum(size for path, size in window
                           if CHECKPOINT_DIR.fullmatch(os.path.basename(os.path.dirname(path))))
    files: dict[str, int] = {}
    for path, _ in window:
        shown = re.sub(r"checkpoint_[^/]*", "checkpoint_*", path)
        files[shown] = files.get(shown, 0) + 1
    return {"steps_at_kill": len(before), "resumed_from_step": total - len(after),
            "steps_redone": len(before) - (total - len(after)), "restart_s": first_step - killed_at,
            "mb_read": checkpoint_bytes / 1e6, "all_mb_read": sum(size for _, size in window) / 1e6,
            "files_read": files}


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


FIGURES = (("steps_redone", "steps"), ("restart_s", "restart"), ("mb_read", "mb"))


def summarize(results: list[dict], per_round: list[dict], setup: str, rounds: int) -> dict:
    arms = []
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]
        row = {"arm": arm, **{key: statistics.median(r[key] for r in mine)
                              for key in ("steps_redone", "resumed_from_step", "restart_s", "mb_read",
                                          "all_mb_read", "wall_s")}}
        for key, short in FIGURES:
            paired = [ratio(entry["arms"][arm][key], entry["arms"]["ray-train"][key]) for entry in per_round]
            known = [p for p in paired if p is not None]
            row[f"paired_{short}_ratio"] = statistics.median(known) if known else None
            row[f"paired_{short}_ratio_all"] = paired
        arms.append(row)
    return {"setup": setup, "baseline": "ray-train", "paired_rounds": rounds, "arms": arms}


def print_table(result: dict) -> None:
    print(f"\n{result['setup']}; medians of {result['paired_rounds']} paired rounds")
    print("| arm | steps redone | resumed from step | kill to first step s | checkpoint MB read back | all MB read |"
          " paired x ray-train: steps, s, MB |")
    print("|---|---|---|---|---|---|---|")
    for row in result["arms"]:
        shown = ", ".join("" if row[f"paired_{s}_ratio"] is None else f"{row[f'paired_{s}_ratio']:.3f}"
                          for _, s in FIGURES)
        print(f"| {row['arm']} | {row['steps_redone']:.1f} | {row['resumed_from_step']:.1f} | "
              f"{row['restart_s']:.1f} | {row['mb_read']:.2f} | {row['all_mb_read']:.2f} | {shown} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=45, help="the global step (from 1) rank 1 dies in")
    parser.add_argument("--step-s", type=float, default=0.3, help="seconds each training forward sleeps")
    parser.add_argument("--every", type=int, default=5, help="ray-ddp's --checkpoint-every-steps")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="the snapshot arm's --snapshot-every-steps (default: ray-ddp's own cadence)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    from _results import add_result_args, rounds_by, save_result

    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.exit(2, f"--rounds {args.rounds}: give 1 or more\n")
    total = args.epochs * args.steps_per_epoch
    if not 1 < args.kill_at <= total:
        parser.exit(2, f"--kill-at {args.kill_at}: give a step from 2 to {total} (--epochs x --steps-per-epoch)\n")
    job = {"epochs": args.epochs, "steps_per_epoch": args.steps_per_epoch, "kill_at": args.kill_at,
           "step_s": args.step_s, "every": args.every, "snapshot_every": args.snapshot_every, "width": args.width, "batch": args.batch_size}
    stop_ray = start_ray()
    results = []
    try:
        for round_no in range(args.rounds):
            for arm in (ARMS if round_no % 2 == 0 else ARMS[::-1]):
                results.append({**run_arm(arm, job), "round": round_no})
                r = results[-1]
                print(f"round {round_no + 1}/{args.rounds} {arm}: {r['steps_redone']} steps redone (from step "
                      f"{r['resumed_from_step']}), {r['restart_s']:.1f} s kill to first step, "
                      f"{r['mb_read']:.2f} MB of checkpoints read back", flush=True)
    finally:
        stop_ray()
    per_round = rounds_by(results)
    setup = (f"mlp {INPUT_DIM}-{args.width}x2-{OUTPUT_DIM}, 2 CPU workers, {args.epochs} epochs of "
             f"{args.steps_per_epoch} steps of {args.batch_size} rows, {args.step_s:g} s per step; rank 1 "
             f"SIGKILLed in step {args.kill_at}; ray-train: a checkpoint per epoch; ray-ddp: "
             f"--checkpoint-every-steps {args.every}; ray-ddp-snapshots: "
             + (f"--snapshot-every-steps {args.snapshot_every}" if args.snapshot_every else "the default snapshots")
             + f"; one local Ray, {os.cpu_count()} CPUs")
    result = summarize(results, per_round, setup, args.rounds)
    print_table(result)
    save_result(args, "recovery", result, per_round)


if __name__ == "__main__":
    main()
