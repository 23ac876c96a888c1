"""``--model hf:DIR``: a Hugging Face ``save_pretrained`` folder (config.json and its
weights), local or on the run's storage, built as the architecture its config.json
names and loaded offline (``local_files_only``: no network is ever needed). Runs on the
driver (on the meta device, to check it) and on workers. transformers is imported only
here, and only when a model needs it. A folder on a URI is copied once per node
(``node_copy``), whatever the number of workers there, and kept for a restart; the
driver reads only its config.json (models/remote.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import torch
from torch import nn

from ray_ddp.errors import ConfigError
from ray_ddp.models.remote import child_uri, is_file, is_uri, small_files
from ray_ddp.storage import resolve_storage

PREFIX = "hf:"


def is_hf_model(spec: str) -> bool:
    return spec.startswith(PREFIX)


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face models need transformers and safetensors: "
                          "pip install 'ray_ddp[hf]'") from None
    return transformers


def local_path(path: str) -> str:
    """A local path as given (``~`` expanded), absolute."""
    return os.path.abspath(os.path.expanduser(path))


@contextlib.contextmanager
def local_folder(path: str) -> Iterator[str]:
    """The folder (or file) on the local disk: itself, or this node's copy of a URI's."""
    yield node_copy(path) if is_uri(path) else local_path(path)


def cache_root() -> str:
    """Where a node keeps its copies of hf:URI folders and --init-from URIs:
    $RAY_DDP_HF_CACHE, else ray_ddp_hf_cache-<uid> in the system's temporary folder (one
    per user: another user's would not be writable)."""
    return os.environ.get("RAY_DDP_HF_CACHE") or \
        os.path.join(tempfile.gettempdir(), f"ray_ddp_hf_cache-{os.getuid()}")


def node_copy(uri: str) -> str:
    """One copy per node of the files at ``uri``, however many workers ask: the first to
    take the node's lock copies them (into a folder beside, renamed into place once
    whole), the others wait and read the same copy; a rerun or a restart on that node
    copies nothing. The copy's name comes from the URI and each file's size and
    modification time, so a folder changed since is copied again; copies are kept until
    the cache folder is removed."""
    import fcntl  # not at the top: only a URI needs them (a local folder is read where it is)
    import glob
    import hashlib

    import pyarrow.fs as pafs

    store = resolve_storage(uri)
    info = store.fs.get_file_info(store.path)
    files = store.fs.get_file_info(pafs.FileSelector(store.path, recursive=True)) \
        if info.type == pafs.FileType.Directory else [info]
    stamp = "\n".join(sorted(f"{f.path}:{f.size}:{f.mtime_ns}" for f in files if f.type == pafs.FileType.File))
    key = hashlib.sha256(f"{uri}\n{stamp}".encode()).hexdigest()[:24]
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    name = os.path.basename(store.path.rstrip("/")) or "model"  # a file keeps its name (.safetensors)
    folder = os.path.join(root, key)
    with open(os.path.join(root, f"{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not os.path.isdir(folder):
            for left in glob.glob(os.path.join(root, f"{key}.partial-*")):  # a copier that died
                shutil.rmtree(left, ignore_errors=True)
            partial = tempfile.mkdtemp(prefix=f"{key}.partial-", dir=root)
            try:
                target = os.path.join(partial, name)
                if info.type == pafs.FileType.Directory:
                    os.mkdir(target)  # copy_files fills a folder, it does not make one
                pafs.copy_files(store.path, target, source_filesystem=store.fs)
                try:
                    os.rename(partial, folder)
                except OSError:  # another host's copy, where the cache is shared and flock is not
                    if not os.path.isdir(folder):
                        raise
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return os.path.join(folder, name)


def check_hf_folder(spec: str) -> None:
    """One line if the folder cannot be an hf: model (driver, before Ray starts; a URI's
    folder is asked, not copied)."""
    require_transformers()
    path = spec[len(PREFIX):]
    found = is_file(child_uri(path, "config.json")) if is_uri(path) else \
        os.path.isfile(os.path.join(local_path(path), "config.json"))
    if not found:
        raise ConfigError(f"--model {spec}: {path} has no config.json; give a folder written by "
                          "save_pretrained (model.save_pretrained(DIR))")


@contextlib.contextmanager
def config_folder(path: str) -> Iterator[str]:
    """A folder holding the model's config.json: the folder itself, or (a URI's) a
    temporary one with config.json alone (the driver's meta-device build needs no weights)."""
    if not is_uri(path):
        yield local_path(path)
        return
    with small_files(path, ["config.json"]) as folder:
        yield folder


def build_hf_model(spec: str, device: torch.device) -> nn.Module:
    """The architecture ``config.json`` names, with the folder's weights; on the meta
    device only the architecture (the driver's checks)."""
    transformers = require_transformers()
    path = spec[len(PREFIX):]
    with (config_folder if device.type == "meta" else local_folder)(path) as folder:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        architecture = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, architecture, None) if architecture else None
        if cls is None:
            raise ConfigError(f"--model {spec}: config.json names no architecture transformers has "
                              f"({architecture!r}); save it with model.save_pretrained")
        if device.type == "meta":
            with torch.device("meta"):
                return cls(config)
        # fp32 parameters whatever dtype the checkpoint was saved in (transformers 5 loads
        # the checkpoint's): training in pure bf16 would round small updates away and keep
        # AdamW's state in bf16; --amp bf16 computes in bf16 over fp32 weights
        dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
        model = cls.from_pretrained(folder, local_files_only=True, **dtype)
    # from_pretrained hands the model over in eval mode (dropout off), as for inference;
    # training wants it on, as the model built from its config (the other ranks') has it
    return model.train().to(device)
