"""The app's model, data and training code (plain transformers and PyTorch).

The model is a tiny GPT-2 sequence classifier built from a config with random weights
(nothing downloaded); the text is tokenized by a word-level vocabulary built here (no
tokenizer download). The data are short synthetic reviews whose label (negative,
neutral, positive) is set by the sentiment words they contain.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2ForSequenceClassification
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

WORDS = {0: ["bad", "awful", "boring", "poor"], 1: ["okay", "fine", "average", "plain"],
         2: ["great", "superb", "lovely", "fun"]}
FILLER = ["the", "film", "was", "plot", "acting", "really", "quite", "and", "a", "story", "music", "ending"]
VOCAB = ["[PAD]"] + FILLER + [w for ws in WORDS.values() for w in ws]
MAX_LEN = 12


def encode(text: str) -> tuple[list[int], list[int]]:
    """Word ids and attention mask of ``text``, padded to ``MAX_LEN``."""
    ids = [VOCAB.index(w) for w in text.split()][:MAX_LEN]
    return ids + [0] * (MAX_LEN - len(ids)), [1] * len(ids) + [0] * (MAX_LEN - len(ids))


def build_model() -> GPT2ForSequenceClassification:
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=MAX_LEN, n_embd=32, n_layer=1, n_head=2, num_labels=3,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return GPT2ForSequenceClassification(config)


class Reviews(Dataset):
    """Batches as transformers models take them: ``input_ids``, ``attention_mask``, ``labels``."""

    def __init__(self, texts: list[str], labels: list[int]) -> None:
        enc = [encode(t) for t in texts]
        self.input_ids = torch.tensor([e[0] for e in enc])
        self.attention_mask = torch.tensor([e[1] for e in enc])
        self.labels = torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


@functools.lru_cache(maxsize=4)
def _partitions(num_partitions: int, records: int = 1800) -> list[tuple[Reviews, Reviews]]:
    rng = np.random.default_rng(0)
    texts, labels = [], []
    for _ in range(records):
        label = int(rng.integers(3))
        words = list(rng.choice(FILLER, size=int(rng.integers(3, 9))))
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(WORDS[label])))
        texts.append(" ".join(words))
        labels.append(label)
    parts = []
    for idx in np.array_split(np.arange(records), num_partitions):
        cut = int(0.8 * len(idx))
        parts.append((Reviews([texts[i] for i in idx[:cut]], [labels[i] for i in idx[:cut]]),
                      Reviews([texts[i] for i in idx[cut:]], [labels[i] for i in idx[cut:]])))
    return parts


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    train, test = _partitions(num_partitions)[partition_id]
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(test, batch_size=64)


def train(net, trainloader: DataLoader, epochs: int, lr: float) -> None:
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    net.train()
    for _ in range(epochs):
        for batch in trainloader:
            outputs = net(**batch)
            outputs.loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def test(net, testloader: DataLoader) -> tuple[float, float]:
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for batch in testloader:
            outputs = net(**batch)
            loss += outputs.loss.item() * len(batch["labels"])
            correct += (outputs.logits.argmax(-1) == batch["labels"]).sum().item()
            n += len(batch["labels"])
    return loss / max(1, n), correct / max(1, n)
