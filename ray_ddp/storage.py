"""Run storage: where a run's folder lives, on a local disk or behind a pyarrow URI.

Runs on the driver, in the Ray Train controller (the metrics callback) and on workers (a
checkpoint's folder opened to resume from). Everything
ray_ddp writes next to Ray's checkpoints goes through the same pyarrow filesystem, so
nothing assumes a local disk. Writes are atomic where the filesystem allows: a reader
never sees half a file.
"""

from __future__ import annotations

from ray_ddp.errors import StorageError

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ray_ddp.errors import ConfigError



@dataclass(frozen=True)
class Storage:
    """A resolved ``--storage``: what Ray gets, and the filesystem + path ray_ddp uses."""

    uri: str  # given to RunConfig(storage_path=...): an absolute path or a URI
    fs: pafs.FileSystem
    path: str  # the same place, as a path inside ``fs``

    def run_path(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def uri_of(self, *parts: str) -> str:
        """A place under the storage as the user can open it: a local path, or for a URI
        storage its URI with ``parts`` joined to the path and the query (the filesystem's
        options, e.g. ?endpoint_override=...) kept after it. What is printed and recorded."""
        base, sep, query = self.uri.partition("?")
        joined = "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])
        return f"{joined}{sep}{query}"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path_on_disk(self, name: str) -> str:
        """The run folder as a local path (only for local storage: TensorBoard's writer)."""
        if not self.is_local:
            raise ConfigError(f"--storage {self.uri} is not on a local disk")
        return self.run_path(name)


def resolve_storage(storage: str) -> Storage:
    """Turn ``--storage`` into a filesystem; local paths become absolute."""
    if "://" in storage:
        try:
            fs, path = pafs.FileSystem.from_uri(storage)
        except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as err:
            raise ConfigError(f"--storage {storage}: {err}; use a local path or s3://, gs://, file://") from None
        return Storage(uri=storage, fs=fs, path=path.rstrip("/") or "/")
    path = os.path.abspath(os.path.expanduser(storage))
    return Storage(uri=path, fs=pafs.LocalFileSystem(), path=path)


def check_writable(storage: Storage) -> None:
    """Create the storage folder if needed and prove we can write there, leaving nothing."""
    probe = f"{storage.path}/.ray_ddp_probe-{uuid.uuid4().hex}"
    try:
        storage.fs.create_dir(storage.path, recursive=True)
        with storage.fs.open_output_stream(probe) as f:
            f.write(b"ok")
        storage.fs.delete_file(probe)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(
            f"--storage {storage.uri} is not writable ({err}); pick a folder you can write to"
        ) from None




RETRIES = 4  # tries per read or write; transient errors (a dropped S3 connection) pass


def _with_retries(what: str, path: str, attempt_fn):
    """Run ``attempt_fn`` up to RETRIES times with backoff (0.2, 0.4, 0.8 s). A missing
    file is an answer, not a failure: FileNotFoundError goes straight to the caller."""
    for attempt in range(RETRIES):
        try:
            return attempt_fn()
        except FileNotFoundError:
            raise
        except (OSError, pa.ArrowException) as err:
            if isinstance(err, pa.ArrowInvalid) or attempt == RETRIES - 1:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StorageError(f"cannot {what} {path} ({first}); tried {attempt + 1} times") from None
            time.sleep(0.2 * 2**attempt)


def read_json(fs: pafs.FileSystem, path: str) -> Optional[dict[str, Any]]:
    """The JSON object at ``path``; None if there is no such file. Raises ValueError if
    the file is not JSON, StorageError if it cannot be read."""
    def attempt():
        with fs.open_input_stream(path) as f:
            return f.read()

    try:
        data = _with_retries("read", path, attempt)
    except FileNotFoundError:
        return None
    return json.loads(data)


def _write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    def attempt():
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)

    _with_retries("write", path, attempt)


def write_json(fs: pafs.FileSystem, path: str, obj: dict[str, Any]) -> None:
    _write_atomic(fs, path, json.dumps(obj, indent=2, default=str).encode())


def write_table(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    _write_atomic(fs, path, buf.getvalue())


def read_table(fs: pafs.FileSystem, path: str) -> Optional[pa.Table]:
    """The parquet table at ``path``; None if there is no such file. Raises StorageError
    if it cannot be read (after retries) or is not parquet."""
    def attempt():
        with fs.open_input_file(path) as f:
            return pq.read_table(f)

    try:
        return _with_retries("read", path, attempt)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def local_copy(fs: pafs.FileSystem, path: str, names: Optional[Sequence[str]] = None) -> Iterator[str]:
    """The folder ``path`` of ``fs`` on the local disk: itself on a local filesystem, else
    a temporary copy (of ``names`` only, if given), removed afterwards."""
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    tmp = tempfile.mkdtemp(prefix="ray_ddp_copy_")
    try:
        # 64 MiB a read, as Ray's own downloads: a checkpoint's files are large
        if names is None:
            pafs.copy_files(path, tmp, source_filesystem=fs, chunk_size=64 << 20)
        for name in names or ():
            pafs.copy_files(f"{path}/{name}", os.path.join(tmp, name), source_filesystem=fs, chunk_size=64 << 20)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
