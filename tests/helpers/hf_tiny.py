"""Tiny Hugging Face models of the field's heads, built from configs (nothing
downloaded), and ragged rows for them: what the own-loss tests cut in every way. Beside
them, ray_ddp's own tasks on its built-in MLP (``BUILTIN``: its cross-entropy and mean
squared error), whose rows are one short of the global batch, so that a cut gives
micro-batches of different sizes."""

from __future__ import annotations

import torch

VOCAB = 32
# head -> what its own loss is a mean over (tasks/build.py loss_units_of)
UNITS = {"gpt2": "shifted", "llama": "shifted", "t5": "tokens", "bart": "tokens", "masked": "tokens",
         "token": "tokens", "rows": "rows", "choice": "rows", "custom": None, "gpt2-lora": "shifted"}
# ray_ddp's own task -> the task's name and the loss of a plain process over all rows
BUILTIN = {"classify": ("classification", torch.nn.functional.cross_entropy),
           "regress": ("regression", torch.nn.functional.mse_loss)}


def tiny(kind: str):
    """A tiny model of ``kind`` in eval mode (dropout would make every forward differ)."""
    return _build(kind).eval()


def task_of(kind: str) -> str:
    if kind in BUILTIN:
        return BUILTIN[kind][0]
    return "lm" if kind in ("gpt2", "llama", "t5", "bart", "masked", "gpt2-lora") else "classification"


def _build(kind: str):
    import transformers as t

    torch.manual_seed(0)
    if kind in BUILTIN:
        from ray_ddp.models.builtin import build_mlp

        return build_mlp(6, 4 if kind == "classify" else 3, 16, 1)
    if kind == "gpt2-lora":  # --lora's adapters (peft) on the GPT-2 below: only they train
        from ray_ddp.models.lora import apply_lora

        return apply_lora(_build("gpt2"), "r=2,alpha=4,targets=c_attn", "the tiny GPT-2")
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                max_position_embeddings=32))
    if kind == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, d_kv=8,
                                                       num_layers=1, num_heads=2, decoder_start_token_id=0))
    if kind == "bart":
        return t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    if kind == "custom":
        return _own_model_class()(t.PretrainedConfig())
    bert = t.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3)
    return {"masked": t.BertForMaskedLM, "token": t.BertForTokenClassification,
            "choice": t.BertForMultipleChoice, "rows": t.BertForSequenceClassification}[kind](bert)


def _own_model_class():
    import transformers

    class OwnModel(transformers.PreTrainedModel):
        """A user's own PreTrainedModel: no head in its name, no loss_type."""

        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(VOCAB, 8)
            self.linear = torch.nn.Linear(8, 3)

        def forward(self, input_ids, labels=None):
            logits = self.linear(self.embed(input_ids).mean(1))
            return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}

    return OwnModel


def rows(kind: str, count: int = 6, length: int = 8, ends=(8, 1, 5, 2, 0, 7, 0, 0)) -> dict:
    """Rows whose labels have different lengths (-100 past each row's end: ``ends``), a
    row of one label token, and (where labels are tokens) rows with none at all."""
    g = torch.Generator().manual_seed(1)
    if kind in BUILTIN:  # {"inputs": x, "labels": y}, one row short: uneven micro-batches
        x = torch.randn(count - 1, 6, generator=g)
        y = torch.randint(0, 4, (count - 1,), generator=g) if kind == "classify" else \
            torch.randn(count - 1, 3, generator=g)
        return {"inputs": x, "labels": y}
    ids = torch.randint(1, VOCAB, (count, length), generator=g)
    if kind in ("rows", "choice", "custom"):
        labels = torch.randint(0, 2 if kind == "choice" else 3, (count,), generator=g)
        if kind == "choice":  # (rows, choices, length)
            return {"input_ids": torch.stack([ids, ids.flip(1)], 1), "labels": labels}
        return {"input_ids": ids, "labels": labels}
    labels = torch.randint(0, 3 if kind == "token" else VOCAB, (count, length), generator=g)
    for r, end in enumerate(list(ends)[:count]):
        labels[r, end:] = -100
    return {"input_ids": ids, "labels": labels}
