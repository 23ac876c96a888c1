"""The values some options may take (a sorted few each). Runs on the driver and on
workers."""

BUILTIN_MODELS = ("toy", "toy-mp", "mlp", "gpt")
TASKS = ("regression", "classification", "lm")
OPTIMIZERS = ("sgd", "adamw")
AMP_MODES = ("off", "bf16", "fp16")
SCHEDULES = ("constant", "cosine")
BACKENDS = ("nccl", "gloo")
STRATEGIES = ("ddp", "fsdp", "hsdp")
SHARDED_STRATEGIES = ("fsdp", "hsdp")  # checkpoints in DCP's format: one loads under the other
# `ray-ddp demo`'s; here, not in driver/demos.py (which runs them): that imports torch,
# and `ray-ddp --help` lists them
DEMOS = ("basic", "checkpoint", "model-parallel")
