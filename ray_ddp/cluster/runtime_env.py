"""The environment Ray gives the training workers and Ray Train's controller: the one
place that names it. Runs on the driver (the runtime_env goes to Ray with the trainer).
"""

from __future__ import annotations

import functools
import os
import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence
from ray_ddp.config.choices import SHARDED_STRATEGIES
from ray_ddp.config.train import TrainConfig


# FSDP on CPU gathers each unit's parameters (and reduces its gradients) through fresh
# host buffers, layer after layer. glibc raises its mmap threshold to the largest block
# freed so far, so from the second step on these buffers come from the heap, which holds
# on to them: FSDP then peaks above DDP on host memory, the one thing it is for. A fixed
# threshold returns every block of 1 MiB or more on free (benchmarks/fsdp_memory.py
# shows both figures); on GPU the buffers live in CUDA memory and nothing is set. A value
# in the driver's environment wins.
FSDP_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def worker_runtime_env(cfg: TrainConfig, gpus_per_worker: Optional[int], objects: Sequence[Any] = ()) -> dict[str, Any]:
    """The one place that sets workers' environment: a user model, dataset, loss or
    collate function (``package.module:callable``, or an object the Python API passed:
    object_modules) must import on the workers as it did here; under FSDP on CPU,
    glibc's mmap threshold is fixed (FSDP_MALLOC_ENV); under --hang-timeout, PyTorch's
    flight recorder records (flight_recorder_env); with snapshots on GPUs, NCCL's errors
    raise where a survivor can save (nccl_error_env). ``gpus_per_worker``: the plan's
    (the placement's), not the flag's."""
    modules = user_modules(cfg) + [m for obj in objects for m in object_modules(obj)]
    env = importable_env(*modules) if modules else {}
    extra = {**flight_recorder_env(cfg.name, cfg.hang_timeout), **nccl_error_env(cfg, gpus_per_worker)}
    if cfg.strategy in SHARDED_STRATEGIES and not gpus_per_worker and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        extra.update(FSDP_MALLOC_ENV)
    if extra:
        env = {**env, "env_vars": {**env.get("env_vars", {}), **extra}}
    return env


# With the hang watch on, PyTorch's flight recorder keeps each rank's last collectives
# (a ring of this many; a few hundred KB) for the watch to dump next to the stacks
# (worker/collectives.py). On NCCL it also dumps itself when the process group times out
# (a hang the watch missed), to a file on the rank's node.
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_env(name: str, hang_timeout: float) -> dict[str, str]:
    """The workers' flight recorder settings under --hang-timeout (none where the user's
    environment sets the recorder's size: theirs is kept)."""
    if hang_timeout <= 0 or {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        return {}
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": f"/tmp/ray_ddp_collectives_{safe}_rank_"}


# NCCL's watchdog, by default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), ends the process when
# a collective fails or times out: a survivor of a lost peer never gets to save the step
# it holds (worker/snapshotting.py). 2 aborts the communicators and raises the error in
# the training thread instead, where the survivor's save runs; Ray Train then ends the
# group as it would have. Set only where a survivor would save (snapshots on, GPUs); a
# value in the driver's environment wins.
def nccl_error_env(cfg: TrainConfig, gpus_per_worker: Optional[int]) -> dict[str, str]:
    if not gpus_per_worker or cfg.snapshot_every_steps == 0 or cfg.strategy != "ddp" \
            or "TORCH_NCCL_ASYNC_ERROR_HANDLING" in os.environ:
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def user_modules(cfg: TrainConfig) -> list[str]:
    """The modules of the user's ``package.module:callable`` specs in ``cfg``."""
    return [spec.split(":")[0] for spec in (cfg.model, cfg.dataset, cfg.loss, cfg.collate)
            if spec and ":" in spec and not spec.startswith(("python:", "hf:"))]


def user_module_paths(cfg: TrainConfig) -> list[str]:
    """The folders a process needs on its sys.path to import the user's modules in
    ``cfg`` as this one does (a Tune trial's actor, which runs a driver of its own)."""
    env = importable_env(*user_modules(cfg))
    return [p for p in env.get("env_vars", {}).get("PYTHONPATH", "").split(os.pathsep) if p]


def object_modules(obj: Any, depth: int = 2) -> list[str]:
    """The modules a worker must import to unpickle ``obj``: where it (or, for an
    instance, its class) was defined, and where its base classes were. A class or
    function cloudpickle ships by value (one defined in a notebook, a script's
    ``__main__`` or a function's body) still refers to what it names by module, so for a
    function the modules of the functions, classes and modules it names as globals or
    holds in its closure count too (``depth`` levels down): a notebook's subclass of the
    user's own ``mymodels.Base``, or a wrapper that calls ``mytrain.train``, needs
    ``mymodels`` or ``mytrain`` on the workers' path as it is here."""
    found: dict[str, None] = {}
    _collect_modules(obj, depth, found, set())
    return list(found)


def _collect_modules(obj: Any, depth: int, found: dict[str, None], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.MethodType):  # a bound method: its function and its object's class
        parts = [obj.__func__, obj.__self__]
    elif isinstance(obj, types.ModuleType):
        found.setdefault(obj.__name__)
        return
    elif isinstance(obj, types.FunctionType):
        if obj.__module__:  # None for a function made from code with no module
            found.setdefault(obj.__module__)
        parts = _referred_to(obj) if depth > 0 else []
        depth -= 1
    else:  # a class, or an instance of one: where it and its bases were defined
        for base in (obj if isinstance(obj, type) else type(obj)).__mro__:
            if base.__module__ != "builtins":
                found.setdefault(base.__module__)
        return
    for part in parts:
        _collect_modules(part, depth, found, seen)


def _referred_to(fn: types.FunctionType) -> list[Any]:
    """The functions, classes, modules and partials a function names as globals or holds
    in its closure (in a tuple or list there too): what its pickle refers to by module."""
    named = [fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__]
    held = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    held += [item for value in held if isinstance(value, (tuple, list)) for item in value]
    kinds = (type, types.FunctionType, types.ModuleType, functools.partial, types.MethodType)
    return [value for value in named + held if isinstance(value, kinds)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


# Ray Train's controller polls the workers (their status, their reports) every 2 s by
# default, so a run's end is seen up to 2 s late, and a report sent sooner than a poll
# waits for it. ray-ddp polls every second: the cost is one small call per worker per
# second, the gain a second off the end of every run. Ray hands it from the driver to the
# controller and the workers; a value in the driver's environment wins.
TRAIN_CONTROLLER_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1"}


# On NCCL, --hang-timeout also turns on Ray Train's own NCCL hang detector (experimental,
# off by default in Ray), which reads NCCL's RAS view of every communicator; it is told
# to confirm a hang over the same time. RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR=0 in the
# driver's environment turns it off again.
def nccl_hang_env(backend: str, hang_timeout: float) -> dict[str, str]:
    """On NCCL with the hang watch on: Ray Train's NCCL hang detector too (it reads NCCL's
    RAS view of every communicator), confirming over the same time, and only observing
    (logging, stacks): ray_ddp's watch owns the kill, so a hang is never ended twice."""
    if backend != "nccl" or hang_timeout <= 0:
        return {}
    return {"RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR": "1",
            "RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S": str(hang_timeout),
            "RAY_TRAIN_NCCL_RAS_ACTION": "observe"}


@contextmanager
def train_controller_env(extra: dict[str, str] | None = None) -> Iterator[None]:
    """TRAIN_CONTROLLER_ENV (and ``extra``) in this process's environment while a trainer
    is made and runs (where Ray reads it), as it was before afterwards."""
    added = {k: v for k, v in {**TRAIN_CONTROLLER_ENV, **(extra or {})}.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def importable_env(*module_names: str) -> dict[str, Any]:
    """A runtime_env that puts the folder ``module_name`` was imported from on workers'
    PYTHONPATH (Ray does not ship the driver's sys.path). Under ``ray job submit`` the
    job's working_dir is there already; on a multi-node cluster the folder must exist on
    every node, as a shared filesystem or the job's working_dir provides."""
    import importlib
    import sysconfig

    # what this interpreter has by installation, the workers' has too (Ray runs them in
    # the same environment): only the user's own folders need to go on their path
    installed = {os.path.realpath(path) for key, path in sysconfig.get_paths().items()
                 if key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots = []
    for module_name in module_names:
        top = module_name.split(".")[0]
        if top == "__main__":
            continue  # cloudpickle ships __main__'s functions by value
        origin = getattr(importlib.import_module(top), "__file__", None)
        if origin is None:
            continue
        root = os.path.dirname(os.path.abspath(origin))
        if os.path.basename(origin) == "__init__.py":
            root = os.path.dirname(root)  # a package: its parent folder goes on the path
        if os.path.realpath(root) not in installed:
            roots.append(root)
    if not roots:
        return {}
    paths = roots + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}
