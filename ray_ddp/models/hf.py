"""``--model hf:DIR``: a Hugging Face ``save_pretrained`` folder (config.json and its
weights), local or on the run's storage, built as the architecture its config.json
names and loaded offline (``local_files_only``: no network is ever needed). Runs on the
driver (on the meta device, to check it) and on workers. transformers is imported only
here, and only when a model needs it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import torch
from torch import nn

from ray_ddp.errors import ConfigError
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


@contextlib.contextmanager
def local_folder(path: str) -> Iterator[str]:
    """The folder on the local disk: itself, or a temporary copy of a URI's files."""
    if "://" not in path:
        yield os.path.abspath(os.path.expanduser(path))
        return
    import pyarrow.fs as pafs

    store = resolve_storage(path)
    tmp = tempfile.mkdtemp(prefix="ray_ddp_hf_")
    try:
        pafs.copy_files(store.path, tmp, source_filesystem=store.fs)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_hf_folder(spec: str) -> None:
    """One line if the folder cannot be an hf: model (driver, before Ray starts)."""
    require_transformers()
    path = spec[len(PREFIX):]
    with local_folder(path) as folder:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ConfigError(f"--model {spec}: {path} has no config.json; give a folder written by "
                              "save_pretrained (model.save_pretrained(DIR))")


def build_hf_model(spec: str, device: torch.device) -> nn.Module:
    """The architecture ``config.json`` names, with the folder's weights; on the meta
    device only the architecture (the driver's checks)."""
    transformers = require_transformers()
    path = spec[len(PREFIX):]
    with local_folder(path) as folder:
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
    return model.to(device)
