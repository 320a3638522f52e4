"""A small character LSTM for next-character prediction, scaled for 2 CPU cores.

LEAF's Shakespeare model: embedding 8 -> 2-layer LSTM 256 -> fc 80, on 80-character
windows (about 820 k parameters). Scaled here to embedding 8 -> 1-layer LSTM 32 ->
fc 65 on 40-character windows (8,041 parameters), so that Opacus per-sample
gradients cost about 0.3 ms per record on one core. The LSTM is Opacus's
:class:`~opacus.layers.DPLSTM` (the same maths as ``nn.LSTM``, built from linear
layers whose per-sample gradients Opacus computes). The output has shape
(batch, vocabulary, sequence): logits for the next character at every position,
the layout ``F.cross_entropy`` takes with targets of shape (batch, sequence).
"""

from __future__ import annotations

import torch
from torch import nn

from flwr_jdp import import_opacus_quietly

import_opacus_quietly()
from opacus.layers import DPLSTM  # noqa: E402 - after the quiet import (no root log handler)


class CharLSTM(nn.Module):
    """Embedding -> LSTM -> linear, logits at every position."""

    def __init__(self, vocab_size: int = 65, embedding: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding)
        self.lstm = DPLSTM(embedding, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.fc(out).transpose(1, 2)


def build_char_lstm(vocab_size: int = 65, seed: int = 0, embedding: int = 8, hidden: int = 32) -> CharLSTM:
    """A seeded character LSTM (the same initialisation on the server and every silo)."""
    torch.manual_seed(seed)
    return CharLSTM(vocab_size, embedding, hidden)
