"""``--data DIR`` / ``--val-data DIR`` of a Hugging Face ``datasets`` ``save_to_disk``
folder: its Arrow files read with pyarrow (``datasets`` itself is not needed), as a
map-style Dataset of dict rows, the same rows a ``datasets.Dataset`` passed as
``train_data=`` gives (data/user.py takes it from there: its labels, a collator).
Recognised on the driver, which counts the rows from the Arrow files' message headers
and reads only the rows it inspects; the rows are read on workers, each process opening
the files itself (memory-mapped on a local or shared disk; read whole from a URI).

A ``DatasetDict`` folder (``dataset_dict.json``) holds splits: it is refused in one
line naming them (give ``DIR/train``).
"""

from __future__ import annotations

import bisect
import json
import struct
from dataclasses import dataclass, field
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
    values (lists for sequences, as ``datasets`` rows without a format).

    Counted from the Arrow messages' headers (``index_arrow_stream``), so the driver
    reads no record batch to learn the length; on a URI its rows (the first item, the
    example batch) are read one record batch at a time. A micro-batch
    (``__getitems__``, the workers') reads the whole table once: memory-mapped on a
    local or shared disk, read whole from a URI."""

    def __init__(self, path: str):
        self.path = path
        self._table = self._batches = self._last = None
        self._local = resolve_storage(path).is_local
        batches = self._index()
        self._length = batches[-1].first_row + batches[-1].rows if batches else 0

    def table(self):
        if self._table is None:
            import pyarrow as pa

            store = resolve_storage(self.path)
            tables = []
            for name in self._data_files(store):
                with _open_arrow(store, name) as source:
                    tables.append(pa.ipc.open_stream(source).read_all())
            self._table = pa.concat_tables(tables)
        return self._table

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self._length:
            raise IndexError(index)
        if self._table is None and not self._local:
            return self._row_of_its_batch(index)  # on a URI, not the whole table for one row
        return self.table().slice(index, 1).to_pylist()[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        """The rows at ``indices`` in one read (a micro-batch's: data/user.py rows_fetcher)."""
        if any(not 0 <= i < self._length for i in indices):
            raise IndexError(indices)
        return self.table().take(indices).to_pylist()

    def __getstate__(self):
        # not pickled to the workers: each opens the files itself (the index, one entry a
        # record batch, is made again where a worker reads single rows)
        return {**self.__dict__, "_table": None, "_batches": None, "_last": None}

    def _data_files(self, store) -> list[str]:
        """The Arrow files state.json lists, each checked to be in the folder."""
        with store.fs.open_input_stream(f"{store.path}/{STATE_FILE}") as f:
            state = json.loads(f.read())
        names = [entry["filename"] for entry in state.get("_data_files") or []]
        for name in names:
            if "/" in name or name.startswith("."):  # read from the folder, which others may write
                raise ConfigError(f"--data {self.path}: {STATE_FILE} names a file outside the folder ({name!r})")
        if not names:
            raise ConfigError(f"--data {self.path}: {STATE_FILE} lists no data files")
        return names

    def _index(self) -> list[ArrowBatch]:
        """Every record batch of the folder's files, in order (made once)."""
        if self._batches is None:
            store, batches = resolve_storage(self.path), []
            for name in self._data_files(store):
                with _open_arrow(store, name) as source:
                    first = batches[-1].first_row + batches[-1].rows if batches else 0
                    try:
                        batches += index_arrow_stream(source, name, first)
                    except (struct.error, IndexError, ValueError):
                        raise ConfigError(f"--data {self.path}: {name} is not an Arrow stream as "
                                          "save_to_disk writes one") from None
            self._batches = batches
        return self._batches

    def _row_of_its_batch(self, index: int) -> dict[str, Any]:
        """Row ``index``, from the one record batch that holds it (the last one is kept)."""
        import pyarrow as pa

        batches = self._index()
        batch = batches[bisect.bisect_right([b.first_row for b in batches], index) - 1]
        if self._last is None or self._last[0] is not batch:
            with _open_arrow(resolve_storage(self.path), batch.file) as source:
                schema = pa.ipc.read_schema(pa.ipc.read_message(pa.py_buffer(batch.schema)))
                message = pa.ipc.read_message(pa.py_buffer(source.read_at(batch.size, batch.offset)))
                self._last = batch, pa.ipc.read_record_batch(message, schema)
        return self._last[1].slice(index - batch.first_row, 1).to_pylist()[0]


@dataclass(frozen=True)
class ArrowBatch:
    """One record batch of an Arrow stream file: its rows, where its message lies in the
    file, and the file's schema message (what reads it back)."""

    file: str
    first_row: int  # of the whole data set
    rows: int
    offset: int
    size: int  # the message's bytes: its prefix, its metadata and its body
    schema: bytes = field(repr=False)


_CONTINUATION = 0xFFFFFFFF
_SCHEMA, _DICTIONARY, _RECORD_BATCH = 1, 2, 3  # Arrow's MessageHeader union
_READ_AHEAD = 1 << 16  # the headers of small batches come in one read; a large body is skipped


def index_arrow_stream(source, file: str, first_row: int = 0) -> list[ArrowBatch]:
    """The record batches of an Arrow IPC stream (a save_to_disk data file), from its
    messages' headers alone: each message is a length-prefixed flatbuffer (its type, a
    record batch's row count, its body's length) and then the body, which is skipped.
    ``source``: a random-access pyarrow file. A dictionary batch (which ``datasets``
    does not write) is refused, as the rows could not be read batch by batch."""
    window, batches, schema, pos = _Window(source), [], b"", 0
    while True:
        head = window.read_at(pos, 8)
        if len(head) < 4:
            return batches  # the stream ended without its end marker (older writers)
        prefix = 8 if struct.unpack_from("<I", head)[0] == _CONTINUATION else 4
        length = struct.unpack_from("<i", head, prefix - 4)[0]
        if length == 0:
            return batches
        header_type, rows, body = _message_header(window.read_at(pos + prefix, length))
        size = prefix + length + body
        if header_type == _SCHEMA:
            schema = window.read_at(pos, size)
        elif header_type == _RECORD_BATCH:
            batches.append(ArrowBatch(file, first_row, rows, pos, size, schema))
            first_row += rows
        else:
            raise ValueError(f"message type {header_type}")
        pos += size


def _message_header(meta: bytes) -> tuple[int, int, int]:
    """(header type, rows, body length) of an Arrow ``Message`` flatbuffer (format/
    Message.fbs: fields version, header_type, header, bodyLength; a RecordBatch's first
    field is its length in rows); rows 0 for any other message."""
    root = struct.unpack_from("<I", meta)[0]
    at = _field(meta, root, 1)
    header_type = meta[at] if at else 0
    at = _field(meta, root, 3)
    body = struct.unpack_from("<q", meta, at)[0] if at else 0
    rows = 0
    if header_type == _RECORD_BATCH:
        at = _field(meta, root, 2)
        header = at + struct.unpack_from("<I", meta, at)[0]
        at = _field(meta, header, 0)
        rows = struct.unpack_from("<q", meta, at)[0] if at else 0
    if body < 0 or rows < 0:
        raise ValueError("a negative length")
    return header_type, rows, body


def _field(buf: bytes, table: int, index: int) -> Optional[int]:
    """Where field ``index`` of the flatbuffer table at ``table`` lies, or None where it
    is absent (its default, 0): the table's vtable holds each field's offset."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    slot = 4 + 2 * index
    if slot >= struct.unpack_from("<H", buf, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


class _Window:
    """Reads of a random-access file at offsets, ``_READ_AHEAD`` bytes at a time."""

    def __init__(self, source):
        self.source, self.start, self.data = source, 0, b""

    def read_at(self, pos: int, count: int) -> bytes:
        if not self.start <= pos <= pos + count <= self.start + len(self.data):
            self.start, self.data = pos, self.source.read_at(max(count, _READ_AHEAD), pos)
        return self.data[pos - self.start:pos - self.start + count]


def _open_arrow(store, name: str):
    """A data file of the folder: memory-mapped on a local disk, else opened for reads at offsets."""
    import pyarrow as pa

    path = f"{store.path}/{name}"
    return pa.memory_map(path) if store.is_local else store.fs.open_input_file(path)


def open_saved_datasets(cfg, train_data: Any, val_data: Any):
    """(cfg, train_data, val_data) with a save_to_disk folder in --data / --val-data
    turned into a SavedDataset, read from there on as train_data= / val_data= rows; a
    DatasetDict folder is one line naming its splits. ``cfg`` is kept as given: the
    run's config records the folders (the checks and the inputs take the objects first,
    data/checks.py ``check_train_data`` knowing these rows for the --data folder's)."""
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
    if saved_dataset_kind(cfg.val_data) == "split":
        if val_data is not None:
            raise ConfigError("give val_data= or --val-data, not both")
        val_data = SavedDataset(cfg.val_data)
    return cfg, train_data, val_data
