"""`ray-ddp export --format hf`: a checkpoint of a Hugging Face model as a folder that
``AutoModel*.from_pretrained(DIR)`` loads, without the user's code. Runs on the driver
(any machine that reaches the storage), with no Ray and no process group.

The architecture comes from the checkpoint's ``hf_config.json`` (the config rank 0 saved,
``architectures`` naming the class), is built on the meta device (no memory, no random
init), and takes the checkpoint's tensors as they are (``assign``, strict: every key, no
more). Only classes of ``transformers`` itself that are a PreTrainedModel are built:
the JSON names a class, never code to run, and ``trust_remote_code`` is never used.

"""

from __future__ import annotations

import inspect
import json
import os
import shutil
from typing import Any, Optional

import torch
from ray_ddp.errors import ConfigError
from ray_ddp.wrappers import unwrap_peft


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--format hf needs the transformers package, which is not installed: "
                          "pip install ray_ddp[hf] (or --format torch for a plain state_dict)") from None
    return transformers


def check_out_folder(out: str) -> str:
    """``--out`` for --format hf: a folder that does not exist yet (in one that does) or
    an empty one; its absolute path. Checked before anything is read: a mistake costs
    nothing."""
    target = os.path.abspath(out)
    if not os.path.isdir(os.path.dirname(target)):
        raise ConfigError(f"--out {out}: folder {os.path.dirname(target)} does not exist")
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"--out {out} is a file; --format hf writes a folder: name a new or empty one")
    if os.path.isdir(target) and os.listdir(target):
        raise ConfigError(f"--out {out} is a folder that is not empty; name a new or empty one "
                          "(nothing was written)")
    return target


def read_hf_config(path: str, what: str) -> dict[str, Any]:
    """hf_config.json's fields (checked against meta.json's CRC-32 before this)."""
    try:
        with open(path) as f:
            fields = json.load(f)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise ConfigError(f"{what}: its hf_config.json is not a JSON object; use --format torch")
    return fields


def build_hf_model(transformers: Any, fields: dict[str, Any], what: str) -> torch.nn.Module:
    """The architecture ``fields`` names, on the meta device: a shell of the right shapes
    that the checkpoint's tensors fill."""
    names = fields.get("architectures")
    name = names[0] if isinstance(names, list) and len(names) == 1 else None
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise ConfigError(f"{what}: its hf_config.json names architecture {names!r}, which is no model "
                          f"class of transformers {transformers.__version__} (a class of your own code: "
                          "use --format torch and load the state_dict into it)")
    config_class = getattr(model_class, "config_class", None)
    try:
        if isinstance(config_class, type) and issubclass(config_class, transformers.PretrainedConfig) \
                and config_class is not transformers.PretrainedConfig:
            config = config_class.from_dict(fields)
        else:  # a class that names no config of its own: the one of its model_type
            config = transformers.AutoConfig.for_model(**fields)
        with torch.device("meta"):
            return model_class(config)
    except Exception as err:  # an unknown model_type, a field this version refuses
        reason = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{what}: transformers {transformers.__version__} cannot build {name} from its "
                          f"hf_config.json ({type(err).__name__}: {reason}); try the transformers "
                          "version that trained it, or --format torch") from None


def fill(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """The checkpoint's tensors into the meta-device shell, strict: a key missing or extra,
    or a shape that differs, is one line, not a model half random."""
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:3])
        if len(detail) > 300:  # a key list hundreds long: the first few name the problem
            detail = detail[:300].rsplit(",", 1)[0] + ", ..."
        raise ConfigError(f"{what} does not fit the {type(model).__name__} its hf_config.json "
                          f"describes: {detail}; use --format torch") from None
    tie(model)  # ``assign`` gave tied parameters (lm_head and the embedding) apart


def tie(model: torch.nn.Module) -> None:
    """Tie the output embedding to the input one again, as the model was built. An adapter
    on the output embedding (--lora targets=lm_head) wraps it, and transformers' own
    tie_weights cannot set a wrapper's weight: its base layer is tied instead, as training
    had it (the adapter put on a model already tied)."""
    base = unwrap_peft(model)
    out = base.get_output_embeddings()
    if not hasattr(out, "base_layer"):
        model.tie_weights()
    elif getattr(base.config, "tie_word_embeddings", False):
        inp = base.get_input_embeddings()
        out.base_layer.weight = getattr(inp, "base_layer", inp).weight


def save_hf(model: torch.nn.Module, target: str, max_shard_size: Optional[str] = None) -> list[str]:
    """``save_pretrained`` into a folder beside ``target``, renamed onto it once whole;
    the names of the files written. On failure nothing is left behind. A model bigger
    than ``max_shard_size`` (default: transformers' own) is written in shards with their
    index, as save_pretrained writes it."""
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)  # a crashed export's leftovers of the same pid
    os.mkdir(partial)  # not mkdtemp: the folder gets the user's umask, not 0700
    try:
        # safetensors: loads without unpickling; transformers 5 writes nothing else and
        # has dropped the argument, transformers 4 needs it said
        safe = "safe_serialization" in inspect.signature(model.save_pretrained).parameters
        sized = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
        model.save_pretrained(partial, **({"safe_serialization": True} if safe else {}), **sized)
        written = sorted(os.listdir(partial))
        if not any(name.endswith(".safetensors") for name in written):
            raise ConfigError(f"save_pretrained wrote no .safetensors file ({', '.join(written)}); "
                              "use --format torch")
        os.replace(partial, target)  # onto an empty folder too; one filled since stays, and this fails
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return written


def check_untied_adapters(model: torch.nn.Module, what: str) -> None:
    """Refuse to merge an adapter into a weight another layer shares (GPT-2's lm_head is its
    token embedding): merging adds the adapter's change to both, so the merged model would
    not be the one trained, where the other layer saw the base weight alone."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, module in model.named_modules():
        weight = getattr(getattr(module, "base_layer", None), "weight", None)
        if hasattr(module, "lora_A") and weight is not None and len(names.get(id(weight), [])) > 1:
            shared = [n for n in names[id(weight)] if not n.startswith(f"{name}.")]
            raise ConfigError(f"--merge cannot merge {what}'s adapters on {name}: its weight is also "
                              f"{', '.join(shared)}, which would change too; export the adapters "
                              "(without --merge) or use --format torch")


def tensors_written(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors save_pretrained writes: a peft model's adapters alone, else the model's
    tensors with each tied one once."""
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict  # not at the top: only a --lora run's export has peft

        return list(get_peft_model_state_dict(model).values())
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return list(unique.values())
