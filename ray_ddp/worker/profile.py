"""``--profile START-END``: a torch.profiler trace of those global steps on this rank,
written as Chrome/Perfetto JSON to ``<run>/profile/rank-<r>.pt.trace.json`` (the name
TensorBoard's profiler plugin looks for; chrome://tracing and ui.perfetto.dev open it
too). Runs on workers.

The profiler starts before step START's first micro-batch is fetched and stops after
step END's optimizer step, so a trace holds whole steps: data, forward, backward (with
DDP's all-reduce), the optimizer. Steps before START are the warm-up a profiler
wants (the first steps pay for allocations and, with --compile, compilation).
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch

from ray_ddp.config.checks import parse_profile_steps
from ray_ddp.record.folder import RunFolder


class ProfileState:
    """Whether this rank is profiling, and the trace it writes when the range ends."""

    def __init__(self, spec: Optional[str], rank: int, folder: Optional[RunFolder], device: torch.device):
        self.range = parse_profile_steps(spec) if spec else None
        self.rank, self.folder, self.device = rank, folder, device  # folder: the run's, where traces go
        self._profiler = None
        self._step_mark = None  # the record_function that names the step in the trace
        self.written: Optional[str] = None  # the trace's path in run storage

    def before_step(self, step: int) -> None:
        """``step``: the global step about to run (1: the run's first)."""
        if self.range is None or not (self.range[0] <= step <= self.range[1]):
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        if self._profiler is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.start()
        # the run's own step number, where the profiler's schedule would count from 0
        self._step_mark = record_function(f"ProfilerStep#{step}")
        self._step_mark.__enter__()

    def after_step(self, step: int) -> None:
        """Close the step's mark; at the range's end, write the trace."""
        if self._profiler is None:
            return
        if self._step_mark is not None:
            self._step_mark.__exit__(None, None, None)
            self._step_mark = None
        if step >= self.range[1]:
            self.finish()

    def finish(self) -> None:
        """Stop and write the trace (also when the run ends inside the range)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self._step_mark is not None:
            self._step_mark.__exit__(None, None, None)
            self._step_mark = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps' kernels end inside the trace
        profiler.stop()
        fs, folder = self.folder.fs, self.folder.profile
        # the profiler writes a local file; run storage may be a bucket
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "trace.json")
            profiler.export_chrome_trace(local)
            fs.create_dir(folder, recursive=True)
            self.written = f"{folder}/rank-{self.rank}.pt.trace.json"
            with open(local, "rb") as src, fs.open_output_stream(self.written) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        self.range = None  # once per run attempt: a restart inside the range does not redo it
