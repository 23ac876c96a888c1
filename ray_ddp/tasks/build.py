"""The task of a run: the built-in one its config names, wrapped by the user's loss or,
when batches hand the model its labels, the model's own. Runs on workers (and on the
driver's meta-device check)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray_ddp.tasks.builtin import ClassificationTask, LanguageModelTask, Task
from ray_ddp.tasks.own_loss import ModelLossTask, UserLossTask

TASKS = ("regression", "classification", "lm")


def build_task(name: str, seq_len: int = 0, loss: Optional[Callable] = None, model: Any = None,
               model_loss: bool = False) -> Task:
    """``model_loss``: the batches hand the model ``labels`` (a dict batch with that key),
    so the model computes the loss itself; ``model`` says what kind of mean it is (a
    Hugging Face model's ``loss_type``)."""
    base = {"regression": Task, "classification": ClassificationTask}.get(name)
    task = base() if base is not None else LanguageModelTask(seq_len)
    if loss is not None:
        return UserLossTask(loss, task)
    if model_loss:
        return ModelLossTask(task, getattr(model, "loss_type", None) or _loss_type_by_name(model))
    return task


def _loss_type_by_name(model: Any) -> Optional[str]:
    """What a model without a ``loss_type`` averages over: a Hugging Face model with none
    falls back to the causal-LM loss, as transformers itself does (GPT2LMHeadModel is
    one); another named like Hugging Face's heads (...ForCausalLM) is taken at its word;
    else rows."""
    if hasattr(type(model), "loss_function"):  # a transformers PreTrainedModel
        return "ForCausalLM"
    name = type(model).__name__
    for kind in ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM", "ForTokenClassification"):
        if kind in name:
            return kind
    return None
