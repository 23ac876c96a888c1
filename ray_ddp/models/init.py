"""``--init-from PATH``: a new run's first weights, from a plain state_dict file (.pt,
.bin, .safetensors), a ray-ddp ``model.pt``, another run's checkpoint folder (DDP or FSDP
shards) or a Hugging Face ``save_pretrained`` folder. Every load is ``weights_only``.
Runs on the driver (to check the keys before any worker starts) and on workers (to load
them into the bare model before the strategy sets it up; a --lora run's checkpoint, whose
keys are the adapted model's, into the model under the same --lora)."""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch
from torch import nn

from ray_ddp.errors import ConfigError
from ray_ddp.models.hf import local_folder
from ray_ddp.models.remote import child_uri, is_uri, list_folder, safetensors_shapes, small_files, uri_name
from ray_ddp.checkpoint.safe_load import DCP_METADATA
from ray_ddp.checkpoint.sharded import is_sharded_checkpoint, read_model_shapes, read_model_state

_FILES = ("model.pt", "model.safetensors", "pytorch_model.bin")


def read_init_weights(path: str, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """The state_dict at ``path``; ConfigError in one line for anything else. With
    ``shapes_only`` (the driver's check), its tensors on the meta device: names and shapes
    read from the safetensors headers, DCP's metadata or a memory-mapped torch file,
    never the weights themselves (a 70B model's do not fit the driver); on a URI, without
    copying them either."""
    if shapes_only and is_uri(path):
        return _remote_shapes(path)
    with local_folder(path) as local:
        if os.path.isdir(local):
            return _read_folder(local, path, shapes_only)
        if not os.path.isfile(local):
            raise ConfigError(f"--init-from {path}: no such file or folder")
        return _read_file(local, path, shapes_only)


def _read_folder(folder: str, given: str, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    if is_sharded_checkpoint(folder) and not os.path.isfile(os.path.join(folder, "model.pt")):
        return read_model_shapes(folder) if shapes_only else read_model_state(folder)
    for name in _FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return _read_file(os.path.join(folder, name), given, shapes_only)
    shards = sorted(glob.glob(os.path.join(folder, "model-*.safetensors")))  # a sharded save_pretrained
    if shards:
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(_read_file(shard, given, shapes_only))
        return state
    raise ConfigError(f"--init-from {given}: the folder holds none of {', '.join(_FILES)}; give a "
                      "checkpoint folder, a save_pretrained folder or a state_dict file")


def _remote_shapes(uri: str) -> dict[str, torch.Tensor]:
    """read_init_weights(shapes_only=True) of a URI: the same choice of files as
    _read_folder, each read as little as it can be: DCP's .metadata, safetensors headers;
    only a torch file (model.pt, .bin), which has no header to read, is copied."""
    try:
        entries = list_folder(uri)
    except FileNotFoundError:
        raise ConfigError(f"--init-from {uri}: no such file or folder") from None
    if not entries:  # a single file
        return safetensors_shapes(uri) if uri_name(uri).endswith(".safetensors") else _copied_file_shapes(uri, uri)
    if DCP_METADATA in entries and "model.pt" not in entries:
        with small_files(uri, [DCP_METADATA]) as folder:
            return read_model_shapes(folder)
    for name in _FILES:
        if name in entries:
            path = child_uri(uri, name)
            return safetensors_shapes(path) if name.endswith(".safetensors") else _copied_file_shapes(path, uri)
    shards = sorted(n for n in entries if n.startswith("model-") and n.endswith(".safetensors"))
    if shards:
        return {k: v for shard in shards for k, v in safetensors_shapes(child_uri(uri, shard)).items()}
    raise ConfigError(f"--init-from {uri}: the folder holds none of {', '.join(_FILES)}; give a "
                      "checkpoint folder, a save_pretrained folder or a state_dict file")


def _copied_file_shapes(path: str, given: str) -> dict[str, torch.Tensor]:
    with local_folder(path) as local:  # this node's copy (the workers' too): read memory-mapped
        return _read_file(local, given, shapes_only=True)


def _read_file(path: str, given: str, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        try:
            from safetensors import safe_open
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError("reading .safetensors needs safetensors: pip install 'ray_ddp[hf]'") from None
        if not shapes_only:
            return load_file(path)
        with safe_open(path, framework="pt") as f:  # the header only
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
    try:
        # memory-mapped for the shapes: no tensor's bytes are read
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=shapes_only)
    except Exception as err:  # a pickle with code, or not a torch file at all
        raise ConfigError(f"--init-from {given}: not a state_dict that loads with weights_only=True "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:160]})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # Lightning's and others' wrapping
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--init-from {given}: {type(state).__name__} is not a state_dict (a dict of "
                          "tensor names to tensors)")
    if shapes_only:
        return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    return state


def check_init_weights(model: nn.Module, state: dict[str, Any], strict: bool, given: str) -> None:
    """Refuse, in one line listing the first few, keys that do not match: missing or
    unexpected (with ``strict``), and shapes that differ (always)."""
    own = model.state_dict()
    aliases = _aliases(model)
    missing = [k for k in own if k not in state and not any(a in state for a in aliases.get(k, ()))]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state
             if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if wrong:
        problems.append(f"shapes differ: {_first(wrong)}")
    if strict and missing:
        problems.append(f"missing: {_first(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected: {_first(unexpected)}")
    if problems:
        hint = "; pass --init-strict false to load the keys that match (e.g. for a new head)" if strict \
            and not wrong else ""
        raise ConfigError(f"--init-from {given} does not fit the model: {'; '.join(problems)}{hint}")


def holds_adapters(state: dict[str, Any]) -> bool:
    """Whether a state_dict is a LoRA-adapted model's (peft's names: the model under
    ``base_model.model.``, the adapters' ``lora_`` weights), as a --lora run saves it."""
    return any(".lora_" in k for k in state) and any(k.startswith("base_model.model.") for k in state)


def adapters_need_lora(given: str) -> ConfigError:
    """The one line for --init-from weights that hold adapters, in a run without --lora."""
    return ConfigError(f"--init-from {given} holds LoRA adapters (a --lora run's checkpoint), and this run "
                       "has none: pass the --lora it was trained with to go on from its adapters")


def load_init_weights(model: nn.Module, path: str) -> None:
    """``--init-from``'s weights into ``model`` (built whole: rank 0's), one tensor at a
    time, so the host holds the model once and a tensor more, never the model twice
    (reading the whole state_dict first held it twice). The keys and shapes were checked
    against the model (``check_init_weights`` of read_init_weights(shapes_only=True)).
    DCP's shards and safetensors files are read straight into the model's own tensors; a
    torch file is memory-mapped (its pages are the file's, which the kernel can drop)."""
    own = model.state_dict()
    with torch.no_grad(), local_folder(path) as local:
        if not os.path.isdir(local):
            _read_file_into(local, own)
        elif is_sharded_checkpoint(local) and not os.path.isfile(os.path.join(local, "model.pt")):
            read_model_state(local, into={k: own[k] for k in read_model_shapes(local) if k in own})
        else:
            names = [os.path.join(local, n) for n in _FILES if os.path.isfile(os.path.join(local, n))]
            for file in names[:1] or sorted(glob.glob(os.path.join(local, "model-*.safetensors"))):
                _read_file_into(file, own)


def _read_file_into(path: str, own: dict[str, torch.Tensor]) -> None:
    """The file's tensors that ``own`` names, copied into them."""
    if path.endswith(".safetensors"):
        _read_safetensors_into(path, own)
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    for key, tensor in state.items():
        if key in own:
            own[key].copy_(tensor)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _read_safetensors_into(path: str, own: dict[str, torch.Tensor]) -> None:
    """A safetensors file read with plain reads, each tensor's bytes into its target where
    the dtypes agree (else through one tensor-sized buffer): no mapping of the whole file,
    whose touched pages would count as this process's memory until it is closed."""
    import json
    import struct

    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        start = 8 + size
        for key, entry in header.items():
            if key == "__metadata__" or key not in own:
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ConfigError(f"--init-from {path}: tensor {key} has dtype {entry['dtype']}, which torch "
                                  "has no type for; save it as F32, F16 or BF16")
            begin, end = entry["data_offsets"]
            target = own[key]
            f.seek(start + begin)
            in_place = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous() \
                and target.numel() * target.element_size() == end - begin
            # else (another dtype, or the model on a GPU): through one tensor-sized buffer
            buffer = target.view(-1).view(torch.uint8) if in_place else torch.empty(end - begin, dtype=torch.uint8)
            if f.readinto(memoryview(buffer.numpy())) != end - begin:
                raise ConfigError(f"--init-from {path}: the file ends inside tensor {key}; it is cut short "
                                  "(copy it again)")
            if not in_place:
                target.copy_(buffer.view(dtype).reshape(entry["shape"]))


def apply_init_weights(model: nn.Module, path: str, strict: bool, shapes: Optional[dict] = None) -> None:
    """``--init-from``'s weights into ``model`` (rank 0's): its keys and shapes checked
    (``shapes``: read_init_weights(path, shapes_only=True), read here if not given), then
    its values streamed in (load_init_weights)."""
    check_init_weights(model, shapes if shapes is not None else read_init_weights(path, shapes_only=True),
                       strict, path)
    load_init_weights(model, path)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """For each key, the other keys of the same tensor (a tied embedding and head:
    save_pretrained writes one of them)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {name: [other for other in names if other != name] for names in groups.values() for name in names}


def _first(keys: list[str], n: int = 4) -> str:
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more
