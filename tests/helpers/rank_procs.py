"""Processes for the ranks of a plain gloo group in the tests (gloo_run.py's harness,
dist_matrix.py's matrices), forked from one server process that has already imported
torch and ray_ddp's worker modules: a rank then costs a fork, not a new interpreter that
imports torch again.

A forked rank gets the server's environment and working folder, those of the moment
the server started: ``start_rank`` hands it the caller's own, as a spawned process
would have had them."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.multiprocessing as mp

# imported once, in the fork server (one missing here is skipped: transformers is an
# extra). torch._dynamo: DistributedDataParallel's constructor imports it, ~1 CPU-s a
# rank; ray.cloudpickle: what the plan's objects are pickled with.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "ray.cloudpickle",
           "ray_ddp.worker.loop", "transformers"]


def rank_context():
    """The multiprocessing context the ranks start from (its queues too)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first rank
    return ctx


def start_rank(ctx, target: Callable[..., Any], *args) -> Any:
    """A started process running ``target(*args)`` in the caller's environment and folder."""
    proc = ctx.Process(target=_in_callers_env, args=(dict(os.environ), os.getcwd(), target, args))
    proc.start()
    return proc


def _in_callers_env(env: dict[str, str], cwd: str, target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)
