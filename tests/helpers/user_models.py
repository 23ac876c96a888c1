"""User-side models for tests of --model package.module:callable."""

import os

import torch
from torch import nn


def small_net() -> nn.Module:
    """A user's own network for the 10 -> 5 synthetic task."""
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))


def frozen_net() -> nn.Module:
    """Nothing to train: DDP refuses such a module."""
    net = nn.Linear(10, 5)
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def not_a_module():
    return torch.zeros(3)


def raises():
    raise RuntimeError("weights file missing")


class SlowToy(torch.nn.Module):
    """The tutorial's ToyModel (same layers, same init for a seed) that takes ~0.1 s a
    step ($SLOW_TOY_STEP_S where set: a test that needs more time to act mid-run sets it
    on its Ray's nodes) and leaves its pid in $TMPDIR/ray_ddp_test_pids/<run>/<rank>.pid,
    so a test can kill a real training worker in mid-run."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self._pid_written = False

    def forward(self, x):
        if not self._pid_written:
            _write_pid()
            self._pid_written = True
        import os
        import time

        time.sleep(float(os.environ.get("SLOW_TOY_STEP_S", "0.1")))
        return self.net2(self.relu(self.net1(x)))


class GatedToy(SlowToy):
    """SlowToy without the sleep, whose training forward after its first ``GATE_AFTER``
    in a process waits until the file ``gate_path(run)`` exists: a run holds still at
    step 16 until the test lets it go on (or stops it), however loaded the machine. (In
    the gloo harness, which has no Ray Train run name, it never holds.)"""

    GATE_AFTER = 15

    def __init__(self):
        super().__init__()
        self._calls = 0

    def forward(self, x):
        import os
        import time

        import ray.train

        if not self._pid_written:
            _write_pid()
            self._pid_written = True
        if self.training:
            self._calls += 1
            if self._calls > self.GATE_AFTER:
                try:
                    run = ray.train.get_context().get_experiment_name()
                except RuntimeError:  # not a Ray Train worker (gloo_run.py): no gate
                    run = None
                while run is not None and not os.path.exists(gate_path(run)):
                    time.sleep(0.05)
        return self.net2(self.relu(self.net1(x)))


def gate_path(run: str) -> str:
    """The file whose existence lets gated_toy's run ``run`` go past its gate."""
    return os.path.join(_pid_folder(run), "open")


def _pid_folder(run: str) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), "ray_ddp_test_pids", run)


def _write_pid():
    import ray.train

    try:
        ctx = ray.train.get_context()
    except RuntimeError:  # not a Ray Train worker (tests/helpers/gloo_run.py): none to kill
        return
    folder = _pid_folder(ctx.get_experiment_name())
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{ctx.get_world_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))


def slow_toy() -> nn.Module:
    return SlowToy()


def gated_toy() -> nn.Module:
    return GatedToy()


class NanAfter(torch.nn.Module):
    """A ToyModel whose output turns NaN from its 14th forward call on."""

    def __init__(self, calls: int = 13):
        super().__init__()
        self.net = nn.Linear(10, 5)
        self.calls, self.limit = 0, calls

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out * float("nan") if self.calls > self.limit else out


def nan_after_13() -> nn.Module:
    return NanAfter()


class SlowOnRankOne(torch.nn.Module):
    """ToyModel whose forward pass takes 300 ms longer on rank 1: a straggler (at 5 steps a
    report, 1.5 s a window over the other rank's few ms). The warning needs 3 windows in a
    row with rank 1 above 3x rank 0's busy time; on a loaded machine rank 0's few ms of
    compute stretch to hundreds of wall-clock ms while a sleep does not, and at 150 ms a
    CI run once saw no warning."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        import time

        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(0.3)
        return self.net2(self.relu(self.net1(x)))


def slow_on_rank_one() -> nn.Module:
    return SlowOnRankOne()


class BatchNormNet(nn.Module):
    """A user's network with both BatchNorm kinds, as every ResNet has: the 10 inputs are
    lifted to a 2x4x4 'image' (BatchNorm2d), flattened (BatchNorm1d), then 5 outputs.
    Its state_dict holds running statistics and 0-dim num_batches_tracked buffers."""

    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(10, 32)
        self.bn2d = nn.BatchNorm2d(2)
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.bn1d = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        h = self.conv(torch.relu(self.bn2d(self.lift(x).view(-1, 2, 4, 4))))
        return self.head(torch.relu(self.bn1d(h.flatten(1))))


def batchnorm_net() -> nn.Module:
    return BatchNormNet()


class BatchNormNetDyingInGroup(BatchNormNet):
    """BatchNormNet whose rank 1 (of the process group: the gloo harness's too) SIGKILLs
    itself at its ``at``-th training forward (0: never), after that forward has moved its
    BatchNorm statistics: its peers meet the loss in the step's gradient all-reduce."""

    def __init__(self, at: int = 0):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        import os
        import signal

        import torch.distributed as dist

        out = super().forward(x)
        self.calls += self.training
        if self.training and self.calls == self.at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return out


def batchnorm_net_dying_in_group(at: int = 0) -> nn.Module:
    return BatchNormNetDyingInGroup(at)


class _InfGrad(torch.autograd.Function):
    """Identity forward; backward sends infinite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class InfGradAt(nn.Module):
    """ToyModel whose backward at its ``at``-th training step gives infinite gradients: the
    loss of that step is finite, the weights after its update are not."""

    def __init__(self, at: int):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        self.calls, self.at = 0, at

    def forward(self, x):
        self.calls += 1
        out = self.net2(self.relu(self.net1(x)))
        return _InfGrad.apply(out) if self.calls == self.at else out


def inf_grad_at_step_10() -> nn.Module:
    return InfGradAt(10)


class DictBatchNormNet(nn.Module):
    """A user's model whose forward takes a dict ({"x": features, "bias": per-row offset})
    and holds BatchNorm (1d and 2d)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.bn2d = nn.BatchNorm2d(1)  # over the 16 features seen as a 1x4x4 image
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 5)

    def forward(self, batch):
        h = self.bn2d(self.inp(batch["x"]).view(-1, 1, 4, 4)).flatten(1)
        return self.out(torch.relu(self.bn(h))) + batch["bias"].unsqueeze(1)


def dict_batchnorm_net() -> nn.Module:
    return DictBatchNormNet()


class UnusedBranch(nn.Module):
    """A forward that never touches one of its layers (as a model with an optional head
    does): DDP needs --find-unused-parameters for it."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(10, 5)
        self.unused = nn.Linear(10, 5)

    def forward(self, x):
        return self.used(x)


def unused_branch() -> nn.Module:
    return UnusedBranch()



class FrozenStatsNet(nn.Module):
    """Fine-tuning as people do it: an input BatchNorm put in eval mode in __init__ (its
    running statistics frozen), then a body and a head of one output column (a
    scikit-learn style regression)."""

    def __init__(self, inputs: int = 6):
        super().__init__()
        self.frozen = nn.BatchNorm1d(inputs)
        self.frozen.running_mean.fill_(0.25)
        self.frozen.eval()
        self.body = nn.Linear(inputs, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(self.frozen(x))))


def frozen_stats_net() -> nn.Module:
    return FrozenStatsNet()


class DiesOnRankOne(nn.Module):
    """The tutorial's ToyModel whose rank 1 process kills itself (SIGKILL, as the OOM
    killer or a lost node does) at its ``at``-th forward: in its first life only, or,
    with ``every_life``, in every life (a crash that a restart cannot cure)."""

    def __init__(self, marker: str, at: int, every_life: bool):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)
        self.marker, self.at, self.every_life, self.calls = marker, at, every_life, 0

    def forward(self, x):
        import os
        import signal

        import ray.train

        self.calls += self.training
        if self.training and self.calls == self.at and ray.train.get_context().get_world_rank() == 1:
            if self.every_life or not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net2(self.relu(self.net1(x)))


def dies_on_rank_one(marker: str, at: int, every_life: bool = False) -> nn.Module:
    return DiesOnRankOne(marker, at, every_life)


class DiesOnSchedule(nn.Module):
    """The tutorial's ToyModel (the same parameters, so the same weights as ``toy``) whose
    processes SIGKILL themselves at chosen moments, one per life of the worker group:
    ``kills[k] = (rank, moment, at)`` for the k-th life (lives are counted in ``folder``),
    ``moment`` "forward" (at that rank's ``at``-th training forward: during that step)
    "write" (at the first state_dict called from the checkpoint writer's snapshot after
    its ``at``-th forward: during that checkpoint, not the epoch's weights hash before it) or
    "validate" (at the first validation forward after its ``at``-th training forward:
    during that epoch's validation), or None (a life without a kill). A life past the
    schedule trains undisturbed."""

    def __init__(self, folder: str, kills: tuple):
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)
        self.folder, self.kills, self.calls = folder, kills, 0
        self.rank, self.kill = self._life()

    def _life(self):
        import os

        try:
            import ray.train

            rank = ray.train.get_context().get_world_rank()
        except Exception:  # built on the driver (its checks): not a life
            return None, None
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"lives-{rank}")  # each rank counts its own lives
        with open(path, "a") as f:
            f.write("life\n")
        with open(path) as f:
            life = len(f.read().splitlines())
        kill = self.kills[life - 1] if life - 1 < len(self.kills) else None
        return rank, kill if kill is not None and kill[0] == rank else None

    def _die(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    def forward(self, x):
        self.calls += self.training
        if self.kill is not None and self.training and self.kill[1] == "forward" and self.calls == self.kill[2]:
            self._die()
        if self.kill is not None and not self.training and self.kill[1] == "validate" and \
                self.calls >= self.kill[2]:
            self._die()
        return self.net2(self.relu(self.net1(x)))

    def state_dict(self, *args, **kwargs):
        if self.kill is not None and self.kill[1] == "write" and self.calls >= self.kill[2] and _in_snapshot():
            self._die()
        return super().state_dict(*args, **kwargs)


def dies_on_schedule(folder: str, kills: tuple) -> nn.Module:
    return DiesOnSchedule(folder, kills)


class HangsOnSchedule(DiesOnSchedule):
    """DiesOnSchedule whose chosen rank stops answering instead of dying (a stuck read, a
    deadlocked kernel): it sleeps where it would have died, and its peers wait for it in
    their next collective. With ``slow_save_s``, rank 0's first checkpoint (its first
    state_dict ever) takes that long, as a big upload on a slow link does: not a hang."""

    def __init__(self, folder: str, hangs: tuple, slow_save_s: float = 0.0):
        super().__init__(folder, hangs)
        self.slow_save_s = slow_save_s

    def _die(self):
        import time

        time.sleep(3600)  # the hung frame the stack file must show

    def state_dict(self, *args, **kwargs):
        import os
        import time

        saved = os.path.join(self.folder, "saved")
        if self.slow_save_s and self.rank == 0 and not os.path.exists(saved):
            open(saved, "w").close()
            time.sleep(self.slow_save_s)
        return super().state_dict(*args, **kwargs)


def _in_snapshot() -> bool:
    import traceback

    return any(frame.name.startswith("snapshot") for frame in traceback.extract_stack())


def hangs_on_schedule(folder: str, hangs: tuple, slow_save_s: float = 0.0) -> nn.Module:
    return HangsOnSchedule(folder, hangs, slow_save_s)
