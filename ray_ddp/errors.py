"""The errors a user meets, in one place. Each message is one line: what is wrong and
what to do. Raised on the driver (ConfigError, StorageError, TrainingError) and on
workers (CheckpointError, NonFiniteLossError, UnusedParametersError, TargetShapeError);
a worker's error reaches the driver as a TrainingError naming the rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:  # the driver's type; errors.py imports nothing of ray_ddp at run time
    from ray_ddp.record.failures import FailureSummary


class ConfigError(ValueError):
    """A user mistake: the message is one line saying what is wrong and what to do."""


class StorageError(RuntimeError):
    """Run storage failed to read or write a file, again on every retry, or holds a file
    that cannot be what ray_ddp wrote there. Raised, never guessed around: a table that
    could not be read must not be replaced by one with only the new rows."""


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded: cut short, corrupt, or holding pickled code."""


class TrainingError(RuntimeError):
    """Training started but failed; the message names the failing rank and cause.
    ``failure``: the rank that explains it (None when Ray's controller failed), and
    ``step``: the last step the run reported."""

    def __init__(self, message: str, failure: Optional[FailureSummary] = None, step: Optional[int] = None):
        super().__init__(message)
        self.failure, self.step = failure, step


class UnusedParametersError(RuntimeError):
    """DDP found parameters that the forward pass did not use."""


class NonFiniteLossError(RuntimeError):
    """The loss or the weights became NaN or infinite; poisoned weights are never checkpointed."""


class TargetShapeError(ValueError):
    """The model's output and the target have shapes no loss can pair without guessing."""


class ProcessFailed(RuntimeError):
    """A spawned process raised or exited non-zero; ``rank`` says which."""

    def __init__(self, rank: int, message: str, exit_code: Optional[int] = None,
                 stderr_tail: Sequence[str] = ()):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.exit_code, self.stderr_tail = rank, exit_code, list(stderr_tail)


class BatchError(ValueError):
    """A batch or a model's output that the task cannot use: a dict whose keys the forward
    does not take, an output with neither logits nor a loss."""
