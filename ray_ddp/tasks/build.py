"""The task of a run: the built-in one its config names, wrapped by the user's loss or,
when batches hand the model its labels, the model's own. Runs on workers (and on the
driver's meta-device check)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray_ddp.wrappers import unwrap_peft
from ray_ddp.tasks.batches import takes_keyword
from ray_ddp.tasks.builtin import ClassificationTask, LanguageModelTask, Task
from ray_ddp.tasks.own_loss import ModelLossTask, UserLossTask

TASKS = ("regression", "classification", "lm")


def build_task(name: str, seq_len: int = 0, loss: Optional[Callable] = None, model: Any = None,
               model_loss: bool = False) -> Task:
    """``model_loss``: the batches hand the model ``labels`` (a dict batch with that key),
    so the model computes the loss itself if uses_model_loss says so; ``model`` says what
    kind of mean it is (a Hugging Face model's ``loss_type``) and, for a classifier, how
    many classes its labels may name."""
    base = {"regression": Task, "classification": ClassificationTask}.get(name)
    task = base() if base is not None else LanguageModelTask(seq_len)
    if loss is not None:
        return UserLossTask(loss, task)
    if uses_model_loss(model, model_loss, has_loss=False):
        return ModelLossTask(task, loss_units_of(model), f"model {type(model).__name__}", class_count_of(model))
    return task


def uses_model_loss(model: Any, hands_labels: bool, has_loss: bool) -> bool:
    """Whether the model's own loss is the objective: the batches hand it ``labels``, no
    loss is given (--loss, loss=), and its forward takes them (one that does not is never
    passed them: the task's loss pairs its output with them). The driver's check and the
    worker's task both decide by this."""
    return hands_labels and not has_loss and takes_keyword(model, "labels")


# Hugging Face heads whose loss is a mean over label tokens that are not -100, the labels
# shifted by one inside the loss (next-token prediction) or not; every other known head
# averages over rows. transformers maps "ForConditionalGeneration" to its causal loss,
# right for the decoder-only ones (vision-language models) and wrong for the
# encoder-decoders (T5, BART, Marian, Pegasus, Whisper), which compare the decoder's
# logits with the labels unshifted: those are told apart by config.is_encoder_decoder.
_SHIFTED_HEADS = ("ForCausalLM", "ForConditionalGeneration")
_TOKEN_HEADS = ("ForMaskedLM", "ForTokenClassification")
_ROW_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForVideoClassification",
              "ForAudioClassification", "ForMultipleChoice", "ForQuestionAnswering")


def loss_units_of(model: Any) -> Optional[str]:
    """What the model's own loss is a mean over: ``shifted`` (label tokens after the first
    of each row), ``tokens`` (label tokens), ``rows``, or None: not known from the model,
    so the labels decide (one per row: rows; a sequence each: refused, own_loss.py). A
    model under LoRA adapters (peft) is told by the model under them."""
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    kind = getattr(model, "loss_type", None)
    if kind not in _SHIFTED_HEADS + _TOKEN_HEADS + _ROW_HEADS:  # unset, or a loss ray_ddp does not know
        kind = _head_of(type(model).__name__)
    if getattr(config, "is_encoder_decoder", False) and kind in _SHIFTED_HEADS + (None,):
        return "tokens"
    if kind in _SHIFTED_HEADS:
        return "shifted"
    if kind in _TOKEN_HEADS:
        return "tokens"
    if kind in _ROW_HEADS:
        return "rows"
    return None


# Hugging Face heads whose logits' last dimension is the class count of single-label
# integer labels (num_labels); with num_labels 1 their loss is a regression's
_CLASS_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForImageClassification",
                "ForAudioClassification", "ForVideoClassification")


def class_count_of(model: Any) -> Optional[int]:
    """How many classes a classifier's own loss takes labels of (its ``num_labels``), known
    before any forward, so labels are checked before the model computes its loss on them;
    None for any other model (a language model, a head ray_ddp does not know)."""
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    classes = getattr(config, "num_labels", None)
    if _head_of(type(model).__name__) not in _CLASS_HEADS or not isinstance(classes, int) or classes < 2:
        return None
    if getattr(config, "problem_type", None) not in (None, "single_label_classification"):
        return None  # regression or multi-label: the labels are not class indices
    return classes


def _head_of(name: str) -> Optional[str]:
    """The Hugging Face head a class is named for (GPT2LMHeadModel is a causal LM)."""
    if name.endswith("LMHeadModel"):
        return "ForCausalLM"
    return next((head for head in _SHIFTED_HEADS + _TOKEN_HEADS + _ROW_HEADS if head in name), None)
