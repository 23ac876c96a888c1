"""`ray-ddp export`: a checkpoint's model as one plain ``state_dict`` file (``--format
torch``, the default), or for a Hugging Face model as a ``save_pretrained`` folder
(``--format hf``, written by export/hf.py).

Runs on the driver (any machine that reaches the storage), with no Ray and no process
group. A DDP checkpoint already holds ``model.pt``: it is checked and copied. A sharded
(FSDP) checkpoint holds each rank's shards: they are read back into whole tensors. Either
way the file loads with ``torch.load(path, weights_only=True)`` into the bare model,
without ray_ddp. The output appears whole or not at all (written beside, then renamed).
A checkpoint that would need unpickling to read (pickled objects in model.pt, a
``.metadata`` naming classes DCP's metadata is not made of) is refused in one line.

"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional
import torch
from ray_ddp.checkpoint.format import HF_CONFIG_FILE, META_FILE, MODEL_FILE, checkpoint_dir_name, started_from_of
from ray_ddp.errors import CheckpointError
from ray_ddp.checkpoint.verify import checkpoint_file_problem, find_latest_checkpoint
from ray_ddp.checkpoint.load import load_tensors
from ray_ddp.errors import ConfigError
from ray_ddp.checkpoint.safe_load import DCP_METADATA
from ray_ddp.checkpoint.sharded import read_model_state
from ray_ddp.export import hf as hf_export
from ray_ddp.models.lora import apply_lora
from ray_ddp.record.folder import RunFolder, run_folder
from ray_ddp.storage import Storage, local_copy, read_json, resolve_storage


@dataclass
class ExportSummary:
    """What `ray-ddp export` wrote."""

    run: str
    checkpoint: str  # the step folder's name
    out: str
    tensors: int
    parameters: int  # elements of all tensors (buffers included)
    sharded: bool  # consolidated from FSDP shards (else a DDP model.pt, copied)
    format: str = "torch"
    architecture: Optional[str] = None  # --format hf: the transformers class written
    files: list[str] = field(default_factory=list)  # --format hf: the folder's files
    merged: bool = False  # --merge: a --lora run's adapters merged into its base

    def text(self) -> str:
        """What was exported, from which checkpoint and where to, as `ray-ddp export` says it."""
        source = "consolidated from its shards" if self.sharded else "copied"
        if self.format == "hf":
            merged = ", its LoRA adapters merged into the base" if self.merged else ""
            return (f"exported {self.checkpoint} of run {self.run} ({source}{merged}) as Hugging Face "
                    f"{self.architecture}: {self.tensors} tensors, {self.parameters:,} values -> "
                    f"{self.out} ({', '.join(self.files)})")
        return (f"exported {self.checkpoint} of run {self.run} ({source}): {self.tensors} tensors, "
                f"{self.parameters:,} values -> {self.out}")


FORMATS = ("torch", "hf")


def export_model(run: str, storage: str, step: Optional[int] = None, out: Optional[str] = None,
                 format: str = "torch", merge: bool = False, max_shard_size: Optional[str] = None) -> ExportSummary:
    """Write the model of run ``run``'s checkpoint at ``step`` (default: the newest whole
    one) to ``out``: with ``format="torch"`` one state_dict file (default:
    ``<run>-step-<N>.pt`` in the current folder); with ``format="hf"`` a new or empty
    folder that ``from_pretrained`` loads (``out`` required): of a ``--lora`` run its
    adapters, or with ``merge`` the whole model with the adapters merged into the base;
    ``max_shard_size``: its largest safetensors file (save_pretrained's)."""
    _check_export_options(format, out, merge, max_shard_size)
    store = resolve_storage(storage)
    folder = run_folder(store, run)
    run_path = folder.path
    dir_name, meta = _pick_checkpoint(store, folder, run, storage, step)
    files = meta["files"]
    what = f"checkpoint {dir_name} of run {run}"
    config = meta.get("config") or {}
    if format == "hf":  # every refusal before a weight is read or anything is written
        check_lora_export(config, started_from_of(meta), merge, what)
        if max_shard_size is not None and config.get("lora") and not merge:
            raise ConfigError("--max-shard-size: a --lora run's adapters are written whole (peft's own file); "
                              "drop it, or add --merge to write the whole model in shards")
        target, transformers = _prepare_hf_folder(run, files, out)
    else:
        target = _torch_target(run, dir_name, out)
    sharded = MODEL_FILE not in files
    if sharded and DCP_METADATA not in files:
        raise ConfigError(f"{what} holds no model (neither {MODEL_FILE} nor shards)")
    state, fields = _read_model(store, f"{run_path}/{dir_name}", files, sharded, format, what)
    summary = ExportSummary(run=run, checkpoint=dir_name, out=target, tensors=len(state),
                            parameters=sum(t.numel() for t in state.values()), sharded=sharded,
                            format=format)
    if format == "hf":
        _save_hf_model(summary, transformers, fields, state, config, merge, what, max_shard_size)
    else:
        _save_state_dict(state, target)
    return summary


def _check_export_options(format: str, out: Optional[str], merge: bool, max_shard_size: Optional[str]) -> None:
    """Refuse a --format, --out, --merge and --max-shard-size that do not go together."""
    if max_shard_size is not None and format != "hf":
        raise ConfigError("--max-shard-size sizes the safetensors files of --format hf; drop it, or add --format hf")
    if max_shard_size is not None and not re.fullmatch(r"\d+[KMGkmg]i?B", max_shard_size):
        raise ConfigError(f"--max-shard-size {max_shard_size}: give a whole number and a unit, e.g. 5GB, "
                          "500MB or 2GiB")
    if format not in FORMATS:
        raise ConfigError(f"--format {format}: choose one of {', '.join(FORMATS)}")
    if format == "hf" and not out:
        raise ConfigError("--format hf needs --out DIR: the folder to write the model into")
    if merge and format != "hf":
        raise ConfigError("--merge writes a --lora run's Hugging Face model with its adapters merged in: "
                          "pass it with --format hf (--format torch writes base and adapters as the run holds them)")


def _pick_checkpoint(store: Storage, folder: RunFolder, run: str, storage: str,
                     step: Optional[int]) -> tuple[str, dict]:
    """The step folder to export and its header: the newest whole one, or ``step``'s,
    verified (its CRCs too); a run or step with none is the user's mistake, in one line."""
    scan = find_latest_checkpoint(folder, verify_crc=step is None)
    if scan.newest is None:
        raise ConfigError(f"run {run} has no checkpoint under {store.uri}; `ray-ddp runs --storage "
                          f"{storage}` lists the runs there")
    if step is None:
        if scan.latest is None:
            broken = "; ".join(f"{name}: {problem}" for name, problem in scan.broken)
            raise ConfigError(f"run {run} has no whole checkpoint ({broken})")
        return scan.latest, scan.meta
    dir_name = checkpoint_dir_name(step)
    meta = read_json(store.fs, f"{folder.path}/{dir_name}/{META_FILE}")
    if meta is None:
        raise ConfigError(f"run {run} has no checkpoint at step {step}; its newest is "
                          f"{scan.newest} (pass --step with one of its step-* numbers)")
    problem = checkpoint_file_problem(store.fs, f"{folder.path}/{dir_name}", meta, verify_crc=True)
    if problem is not None:
        raise ConfigError(f"checkpoint {dir_name} of run {run} is unusable: {problem}")
    return dir_name, meta


def _prepare_hf_folder(run: str, files: list[str], out: Optional[str]) -> tuple[str, Any]:
    """--format hf's folder, checked, and transformers imported: (the folder, the module)."""
    if HF_CONFIG_FILE not in files:  # before the folder or the package: this is the mistake
        raise ConfigError(f"run {run}'s model is not a Hugging Face model (its checkpoint has no "
                          f"{HF_CONFIG_FILE}); use --format torch")
    target = hf_export.check_out_folder(out)
    return target, hf_export.import_transformers()


def _torch_target(run: str, dir_name: str, out: Optional[str]) -> str:
    """--format torch's file: ``out``, or ``<run>-step-<N>.pt`` here; its folder must exist."""
    target = os.path.abspath(out or f"{run}-{dir_name}.pt")
    if not os.path.isdir(os.path.dirname(target)):
        raise ConfigError(f"--out {out}: folder {os.path.dirname(target)} does not exist")
    return target


def _read_model(store: Storage, checkpoint: str, files: list[str], sharded: bool, format: str,
                what: str) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    """The checkpoint's whole model state (consolidated from FSDP shards, or model.pt) and,
    for --format hf, the model's config.json fields (else None)."""
    names = list(files) if sharded else [MODEL_FILE] + ([HF_CONFIG_FILE] if format == "hf" else [])
    fields = None
    with local_copy(store.fs, checkpoint, names) as folder:
        try:
            state = read_model_state(folder) if sharded else load_tensors(os.path.join(folder, MODEL_FILE))
        except CheckpointError as err:  # the user's to act on: the CLI's one line and exit 2
            raise ConfigError(f"{what}: {err}") from None
        if format == "hf":
            fields = hf_export.read_hf_config(os.path.join(folder, HF_CONFIG_FILE), what)
    return state, fields


def _save_hf_model(summary: ExportSummary, transformers: Any, fields: dict, state: dict[str, torch.Tensor],
                   config: dict, merge: bool, what: str, max_shard_size: Optional[str] = None) -> None:
    """Build the Hugging Face model (with a --lora run's adapters), fill it with ``state``,
    merge the adapters if asked, and save it to ``summary.out``; ``summary`` then counts
    what the folder holds."""
    model = hf_export.build_hf_model(transformers, fields, what)
    if config.get("lora"):  # --lora's adapters: written as PeftModel.from_pretrained loads them over the base
        model = apply_lora(model, config["lora"], what)
    hf_export.fill(model, state, what)
    if merge:  # base + scale * B @ A in every adapted layer: a plain model of the base's class
        hf_export.check_untied_adapters(model, what)
        model, summary.merged = model.merge_and_unload(), True
    written = hf_export.tensors_written(model)  # what the folder holds, not the checkpoint
    summary.tensors, summary.parameters = len(written), sum(t.numel() for t in written)
    summary.architecture, summary.files = type(model).__name__, hf_export.save_hf(model, summary.out, max_shard_size)


def _save_state_dict(state: dict[str, torch.Tensor], target: str) -> None:
    """``torch.save`` the state to ``target`` whole or not at all: written beside, then renamed."""
    partial = f"{target}.partial-{os.getpid()}"
    try:
        torch.save(state, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def check_lora_export(config: dict, started_from: Optional[str], merge: bool, what: str) -> None:
    """Refuse, before any weight is read or anything written, an hf export whose adapters
    would load over the wrong base: a --lora run's adapters alone name hf:DIR as their
    base (PeftModel.from_pretrained loads them over it), but a run that started from
    --init-from weights (``started_from``, kept across its resumes) trained them over
    those instead. Merged, the model carries its own base."""
    if merge and not config.get("lora"):
        raise ConfigError(f"--merge merges a --lora run's adapters into its base; {what} was not trained "
                          "with --lora: drop --merge")
    if config.get("lora") and started_from and not merge:
        raise ConfigError(f"{what} trained its --lora adapters over its --init-from weights "
                          f"({started_from}), not {config.get('model')}'s own: the adapters alone "
                          "would load over a base they were not trained with; pass --merge to write the "
                          "whole model with the adapters merged in")
