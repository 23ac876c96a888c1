"""Reading DCP's files without running code: ``.metadata`` through an unpickler that
admits only torch.distributed.checkpoint's metadata classes and plain containers, and
every other entry ``weights_only``; anything else is refused in one line. The shard
files ``.metadata`` names are the ones the checkpoint's manifest lists, read from its
own folder (never ``../x`` or an absolute path).
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import os
import pickle
import re
from collections.abc import Mapping
from typing import Any, NoReturn, Optional
import torch
from ray_ddp.errors import CheckpointError
from ray_ddp.record.names import META_FILE

DCP_METADATA = ".metadata"

NON_TENSORS = "non_tensor_state"  # train_state.pt's key for what DCP does not write



class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, admitting only the classes DCP builds it of: those
    of ``torch.distributed.checkpoint.metadata``, the file reader's ``_StorageInfo``,
    torch's Size, dtypes and layouts, the checkpoint's path, and plain containers. Any
    other class (os.system, builtins.open, ...) is refused before it is looked up."""

    ADMITTED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"), ("builtins", "set"),
                ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex")}

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if self._admits(module, name):
            return super().find_class(module, name)
        refuse(self.path, f"{module}.{name}", "checkpoint metadata")

    def _admits(self, module: str, name: str) -> bool:
        if (module, name) in self.ADMITTED:
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        if module == "torch.distributed.checkpoint.metadata":
            obj = getattr(importlib.import_module(module), name, None)
            return isinstance(obj, type) and obj.__module__ == module
        return False


def read_dcp_metadata(path: str) -> Any:
    """A ``.metadata`` file's Metadata, read by MetadataUnpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated or not a pickle at all
        raise CheckpointError(f"cannot load {path}: {type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refusing to load {path}: it holds a {type(metadata).__name__}, "
                              "not DCP's Metadata")
    check_shard_names(metadata, path)
    return metadata


_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's name for rank r's i-th file


def check_shard_names(metadata: Any, path: str) -> None:
    """Refuse a ``.metadata`` (at ``path``) naming a file its checkpoint does not hold:
    DCP's reader opens each entry's ``relative_path`` joined to the folder, so a name such
    as ``../x`` or ``/x`` would read outside it. A name must be a shard file's, and one
    that the folder's meta.json lists where there is one (a checkpoint ray_ddp wrote; an
    earlier format, or the metadata alone copied from a URI, has none)."""
    listed = _manifest_names(os.path.dirname(path))
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and _SHARD_FILE.fullmatch(name) and (listed is None or name in listed)):
            why = "its meta.json does not list" if isinstance(name, str) and _SHARD_FILE.fullmatch(name) else \
                "is not a shard file in the checkpoint's folder"
            raise CheckpointError(
                f"refusing to load {path}: it names {name!r} as a shard, which {why} (nothing was "
                "loaded); restore this checkpoint from a copy you trust, or delete its folder")


def _manifest_names(folder: str) -> Optional[set]:
    """The file names the checkpoint's meta.json lists, or None where it has none."""
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, dict) else None


def load_weights_only(value: io.BytesIO, what: str) -> Any:
    """An entry DCP pickled (``torch.save``), loaded ``weights_only``, or refused."""
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        refuse(what, found.group(1) if found else "a class weights_only refuses", "a tensor or a plain value")


def refuse(what: str, name: str, admitted: str) -> NoReturn:
    """The one line a refused file gets: which file, which class, what to do."""
    raise CheckpointError(
        f"refusing to load {what}: it names {name}, which is not {admitted} (unpickling it could "
        "run code; nothing was loaded); restore this checkpoint from a copy you trust, or delete its folder"
    ) from None


def set_at_path(root: dict, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``root`` (a str key names a dict's entry,
    an int a list's), making the containers missing on the way and growing a list with
    None: where DCP's load planner puts an entry of a state dict it flattened
    (``planner.mappings[fqn]``), as DCP's own planner does."""
    node: Any = root
    for key, below in zip(path, path[1:]):
        empty: Any = {} if type(below) is str else []
        if isinstance(node, Mapping):
            node = node.setdefault(key, empty)
        else:
            _grow(node, key)
            if node[key] is None:
                node[key] = empty
            node = node[key]
    if isinstance(node, list):
        _grow(node, path[-1])
    node[path[-1]] = value


def _grow(items: list, index: int) -> None:
    items.extend([None] * (index + 1 - len(items)))


@functools.cache
def weights_only_dcp() -> tuple[type, type]:
    """DCP's file reader and load planner, less the unpickling: the reader reads
    ``.metadata`` with MetadataUnpickler (once: ``load_shards`` reads it before DCP
    does), the planner loads non-tensor entries with ``weights_only=True`` (DCP's own
    uses ``weights_only=False``). Built on first use: importing DCP takes the CLI most
    of a second."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        def __init__(self, path: str):
            super().__init__(path)
            self.metadata_by_rank: dict[Optional[int], Any] = {}  # None: .metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")  # DCP asks for rank-local metadata if .metadata fails
            if rank not in self.metadata_by_rank:
                name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
                metadata = read_dcp_metadata(os.path.join(self.path, name))
                metadata.storage_meta = metadata.storage_meta or StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self.metadata_by_rank[rank] = metadata
            return self.metadata_by_rank[rank]

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            self.metadata_by_rank = {}

    class Planner(dcp.DefaultLoadPlanner):
        def __init__(self, directory: str):
            super().__init__()
            self.directory = directory

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = load_weights_only(value, f"entry {fqn} of the shards in {self.directory}")
            if self.flatten_state_dict:
                set_at_path(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return Reader, Planner
