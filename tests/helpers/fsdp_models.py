"""ray-ddp's built-in models as a user would import them, leaving each worker's pid so a
test can kill a worker mid-run (kept apart from user_models, which must import without
ray_ddp)."""

from torch import nn

from ray_ddp.models.builtin import GPT, build_mlp
from user_models import _write_pid


class _LeavesPid:
    """Mixin: the first forward leaves the worker's pid (as SlowToy), every forward takes
    ~0.03 s more, so a test can kill a worker mid-run."""

    def forward(self, *args):
        if not getattr(self, "_pid_written", False):
            _write_pid()
            self._pid_written = True
        import time

        time.sleep(0.03)
        return super().forward(*args)


class PidMLP(_LeavesPid, nn.Sequential):
    """ray-ddp's built-in mlp (the same layers and initial weights), leaving its pid."""


def slow_mlp() -> nn.Module:
    return PidMLP(*build_mlp(10, 5, 64, 3))


class PidGPT(_LeavesPid, GPT):
    """ray-ddp's built-in gpt (blocks, tied embedding), leaving its pid."""


def slow_gpt() -> nn.Module:
    return PidGPT(vocab_size=256, width=32, depth=2, heads=4, seq_len=16)
