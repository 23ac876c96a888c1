"""``--data DIR`` / ``--val-data DIR`` of a Hugging Face ``datasets`` ``save_to_disk``
folder: its Arrow files read with pyarrow (``datasets`` itself is not needed), as a
map-style Dataset of dict rows, the same rows a ``datasets.Dataset`` passed as
``train_data=`` gives (data/user.py takes it from there: its labels, a collator).
Recognised on the driver; the rows are read on workers, each process opening the files
itself (memory-mapped on a local or shared disk; read whole from a URI).

A ``DatasetDict`` folder (``dataset_dict.json``) holds splits: it is refused in one
line naming them (give ``DIR/train``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Optional

from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage

STATE_FILE, DICT_FILE = "state.json", "dataset_dict.json"


def saved_dataset_kind(path: Optional[str]) -> Optional[str]:
    """"split" for a save_to_disk folder of one Dataset, "dict" for a DatasetDict's, else
    None (a parquet file or folder, a text file: the other readers')."""
    if not path or path == "synthetic":
        return None
    try:
        store = resolve_storage(path)
        from pyarrow.fs import FileType

        info = store.fs.get_file_info([f"{store.path}/{STATE_FILE}", f"{store.path}/{DICT_FILE}"])
    except Exception:  # not a place this can read: the other readers say why
        return None
    if info[0].type == FileType.File:
        return "split"
    return "dict" if info[1].type == FileType.File else None


class SavedDataset:
    """The rows of a save_to_disk folder, in its order: each a dict of the columns'
    values (lists for sequences, as ``datasets`` rows without a format)."""

    def __init__(self, path: str):
        self.path = path
        self._table = None
        self._length = len(self.table())  # read on the driver once: its length, checked there
        self._table = None  # not pickled to the workers: each opens the files itself

    def table(self):
        if self._table is None:
            import pyarrow as pa

            store = resolve_storage(self.path)
            with store.fs.open_input_stream(f"{store.path}/{STATE_FILE}") as f:
                state = json.loads(f.read())
            tables = []
            for entry in state.get("_data_files") or []:
                name = entry["filename"]
                if "/" in name or name.startswith("."):  # read from the folder, which others may write
                    raise ConfigError(f"--data {self.path}: {STATE_FILE} names a file outside the folder ({name!r})")
                file_path = f"{store.path}/{name}"
                source = pa.memory_map(file_path) if store.is_local else store.fs.open_input_file(file_path)
                tables.append(pa.ipc.open_stream(source).read_all())
            if not tables:
                raise ConfigError(f"--data {self.path}: {STATE_FILE} lists no data files")
            self._table = pa.concat_tables(tables)
        return self._table

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self._length:
            raise IndexError(index)
        return self.table().slice(index, 1).to_pylist()[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """The rows at ``indices`` in one read (a micro-batch's: data/user.py rows_fetcher)."""
        if any(not 0 <= i < self._length for i in indices):
            raise IndexError(indices)
        return self.table().take(indices).to_pylist()

    def __getstate__(self):
        return {**self.__dict__, "_table": None}


def open_saved_datasets(cfg, train_data: Any, val_data: Any):
    """(cfg, train_data, val_data) with a save_to_disk folder in --data / --val-data
    turned into a SavedDataset, read from there on as train_data= / val_data= rows; a
    DatasetDict folder is one line naming its splits."""
    for flag, path in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if saved_dataset_kind(path) == "dict":
            store = resolve_storage(path)
            with store.fs.open_input_stream(f"{store.path}/{DICT_FILE}") as f:
                splits = json.loads(f.read()).get("splits") or []
            raise ConfigError(f"{flag} {path} is a DatasetDict's folder of splits {', '.join(splits)}: give one "
                              f"split's folder, e.g. {flag} {path.rstrip('/')}/{splits[0] if splits else 'train'}")
    saved = [(flag, path) for flag, path in (("--data", cfg.data), ("--val-data", cfg.val_data))
             if saved_dataset_kind(path) == "split"]
    for other, given in (("--stream", cfg.stream), ("--ray-data", cfg.ray_data)):
        if saved and given:
            raise ConfigError(f"{saved[0][0]} {saved[0][1]} is a datasets save_to_disk folder, read as "
                              f"memory-mapped rows; {other} reads parquet: drop {other}")
    if saved_dataset_kind(cfg.data) == "split":
        if train_data is not None:
            raise ConfigError("give train_data= or --data / --dataset, not both")
        train_data = SavedDataset(cfg.data)
        cfg = replace(cfg, data="synthetic")  # read as train_data= rows from here on
    if saved_dataset_kind(cfg.val_data) == "split":
        if val_data is not None:
            raise ConfigError("give val_data= or --val-data, not both")
        val_data = SavedDataset(cfg.val_data)
        cfg = replace(cfg, val_data=None)
    return cfg, train_data, val_data
