"""Built-in models and how a model name becomes an nn.Module. The built-in classes are
named here too, as ``--fsdp-wrap ray_ddp.models.Block`` and users' imports name them."""

from ray_ddp.models.builtin import GPT, Block, ToyModel, ToyMpModel, build_mlp

__all__ = ["GPT", "Block", "ToyModel", "ToyMpModel", "build_mlp"]
