"""Text for a language model: a file or folder of text read as bytes (a vocabulary of
256) and cut into windows of ``--seq-len`` + 1. Runs on the driver and on workers.
"""

from __future__ import annotations

import torch
from ray_ddp.errors import ConfigError
from ray_ddp.storage import resolve_storage


# ------------------------------------------------------------------------------- text
def is_text(path: str) -> bool:
    """Text data for a language model: a .txt file, or a folder of .txt files."""
    from pyarrow.fs import FileSelector, FileType

    if path.endswith(".txt"):
        return True
    store = resolve_storage(path)
    try:
        if store.fs.get_file_info(store.path).type != FileType.Directory:
            return False
        return any(i.path.endswith(".txt") for i in store.fs.get_file_info(FileSelector(store.path)))
    except OSError:
        return False


def _text_files(path: str):
    """(filesystem, the .txt file infos of ``path`` in name order): a file, or a folder's."""
    from pyarrow.fs import FileSelector, FileType

    store = resolve_storage(path)
    info = store.fs.get_file_info(store.path)
    if info.type == FileType.NotFound:
        raise ConfigError(f"--data {path} does not exist; give a .txt file or a folder of them")
    files = [info] if info.type == FileType.File else sorted(
        (i for i in store.fs.get_file_info(FileSelector(store.path)) if i.path.endswith(".txt")),
        key=lambda i: i.path)
    return store.fs, files


def text_size(path: str) -> int:
    """Bytes of text at ``path``, from the files' metadata (the driver reads no text)."""
    return sum(i.size for i in _text_files(path)[1])


def read_text_bytes(path: str) -> torch.Tensor:
    """The bytes of a .txt file, or of a folder's .txt files in name order, as uint8."""
    fs, files = _text_files(path)
    chunks = []
    for info in files:
        name = info.path
        with fs.open_input_stream(name) as f:
            chunks.append(f.read())
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def text_windows(data: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level tokens cut into windows of ``seq_len + 1`` (stride ``seq_len``, so every
    byte after the first is a target once): inputs and the targets one byte on."""
    rows = (len(data) - 1) // seq_len
    ids = data.long()
    x = ids[: rows * seq_len].reshape(rows, seq_len)
    y = ids[1: rows * seq_len + 1].reshape(rows, seq_len)
    return x, y
