"""Data and models shaped as Hugging Face users bring them, built from configs (nothing
downloaded): token sequences of a fixed Markov chain for a tiny GPT-2, and variable-length
sequences whose class a tiny BERT can learn, as dict items with attention masks."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 64


def markov(rows: int, length: int, seed: int) -> torch.Tensor:
    """Sequences of a fixed Markov chain (each token has 4 likely successors)."""
    g = torch.Generator().manual_seed(1234)  # the chain: the same for every split
    likely = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(VOCAB)])
    probs = torch.full((VOCAB, VOCAB), 0.1 / VOCAB)
    probs.scatter_add_(1, likely, torch.full((VOCAB, 4), 0.9 / 4))
    g = torch.Generator().manual_seed(seed)
    seqs = torch.empty(rows, length, dtype=torch.int64)
    seqs[:, 0] = torch.randint(VOCAB, (rows,), generator=g)
    for t in range(1, length):
        seqs[:, t] = torch.multinomial(probs[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return seqs


class CausalText(Dataset):
    """``({"input_ids": ids, "labels": ids}, ids)``: what the issue's user passed; the model
    shifts the labels itself. With ``ragged``, lengths differ (pad_sequences pads them)."""

    def __init__(self, rows: int, length: int = 24, seed: int = 0, ragged: bool = False):
        self.seqs = markov(rows, length, seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.lengths = torch.randint(length // 2, length + 1, (rows,), generator=g) if ragged else \
            torch.full((rows,), length)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        ids = self.seqs[i, :int(self.lengths[i])]
        return {"input_ids": ids, "labels": ids}, ids


def gpt2(n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=n_layer,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


class Sentiment(Dataset):
    """Sequences of 6-16 tokens; the class (3) is which of three marker tokens occurs
    most: dict items with an attention mask and the label as the target."""

    def __init__(self, rows: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(rows):
            n = int(torch.randint(6, 17, (1,), generator=g))
            ids = torch.randint(4, VOCAB, (n,), generator=g)
            label = int(torch.randint(3, (1,), generator=g))
            ids[torch.randperm(n, generator=g)[:3]] = 1 + label  # markers 1, 2, 3
            self.items.append(({"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long)},
                               torch.tensor(label)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def sentiment_train() -> Sentiment:
    return Sentiment(480, seed=0)


def sentiment_val() -> Sentiment:
    return Sentiment(120, seed=1)


def sentiment_rows(rows: int, seed: int):
    """The same sequences as ``Sentiment``, held the Hugging Face way: a ``datasets.Dataset``
    of dict rows (ragged lists of ids, their attention masks, a ``label`` column), as a
    tokenizer's ``map`` leaves them."""
    import datasets

    items = Sentiment(rows, seed).items
    return datasets.Dataset.from_dict({"input_ids": [x["input_ids"].tolist() for x, _ in items],
                                       "attention_mask": [x["attention_mask"].tolist() for x, _ in items],
                                       "label": [int(y) for _, y in items]})


def tokenizer():
    """A fast tokenizer of VOCAB word-level tokens, built in memory (nothing downloaded);
    its padding id is 0, as the models' ``pad_sequences`` pads."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="[PAD]")),
                                   pad_token="[PAD]", unk_token="[PAD]")


def bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32, num_labels=3,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert():
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config())
