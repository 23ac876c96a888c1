"""What the driver reads of a model folder on a URI (``hf:s3://...``, ``--init-from
s3://...``) without copying its weights: whether a file is there, a small file (a
``config.json``, DCP's ``.metadata``) into a temporary folder, a safetensors file's
header (the names, shapes and dtypes of its tensors, from its first bytes). The workers
copy the whole folder, once per node (models/hf.py ``node_copy``); the driver only checks,
and a 70B model's weights belong on neither its disk nor its network. Runs on the driver."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from typing import Iterator

import pyarrow.fs as pafs
import torch

from ray_ddp.storage import resolve_storage

# safetensors' dtype names; a name this torch lacks reads as float32 (the check compares
# names and shapes)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def is_uri(path: str) -> bool:
    return "://" in path


def child_uri(uri: str, name: str) -> str:
    """The URI of ``name`` inside the folder at ``uri``, its query (``?endpoint_override=``)
    kept after the path, where a filesystem reads it."""
    base, query = uri.split("?", 1) if "?" in uri else (uri, "")
    return f"{base.rstrip('/')}/{name}" + (f"?{query}" if query else "")


def uri_name(uri: str) -> str:
    """The last part of a URI's path (its file's name), the query left out."""
    return uri.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def list_folder(uri: str) -> dict[str, pafs.FileInfo]:
    """The entries directly in the folder at ``uri`` by name (one listing); {} when
    ``uri`` is a file; FileNotFoundError where nothing is there."""
    store = resolve_storage(uri)
    info = store.fs.get_file_info(store.path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(uri)
    if info.type != pafs.FileType.Directory:
        return {}
    return {os.path.basename(f.path): f for f in store.fs.get_file_info(pafs.FileSelector(store.path))}


def is_file(uri: str) -> bool:
    store = resolve_storage(uri)
    return store.fs.get_file_info(store.path).type == pafs.FileType.File


@contextlib.contextmanager
def small_files(uri: str, names: list[str]) -> Iterator[str]:
    """A temporary local folder holding copies of the files ``names`` of the folder at
    ``uri`` (those that exist), removed afterwards."""
    store = resolve_storage(uri)
    folder = tempfile.mkdtemp(prefix="ray_ddp_small_")
    try:
        for name in names:
            source = f"{store.path.rstrip('/')}/{name}"
            if store.fs.get_file_info(source).type == pafs.FileType.File:
                with store.fs.open_input_stream(source) as src, open(os.path.join(folder, name), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def safetensors_shapes(uri: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on the meta device, from its header alone (8 bytes
    giving the header's length, then that many bytes of JSON): no weight is read."""
    store = resolve_storage(uri)
    with store.fs.open_input_file(store.path) as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: torch.empty(entry["shape"], dtype=_DTYPES.get(entry["dtype"], torch.float32), device="meta")
            for name, entry in header.items() if name != "__metadata__"}
