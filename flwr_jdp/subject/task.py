"""The learning task of a subject-level run: its data set (subjects and records)
and the model trained on it, chosen by the ``dataset`` run-config key.

- ``femnist``: FEMNIST writers as subjects, the scaled LEAF CNN
  (:mod:`flwr_jdp.models.leaf_cnn`), one label per record;
- ``shakespeare``: Tiny Shakespeare speaking characters as subjects, the scaled
  character LSTM (:mod:`flwr_jdp.models.char_lstm`), ``seq-len`` next-character
  predictions per record.

``max-writers`` > 0 keeps that many subjects (the first writers; the characters
with the most text).
"""

from __future__ import annotations

from torch import nn

from ..data.femnist import load_femnist
from ..data.shakespeare import load_shakespeare
from ..data.subject_dataset import SubjectDataset
from ..models.char_lstm import build_char_lstm
from ..models.leaf_cnn import build_leaf_cnn
from .config import SubjectDPConfig


def load_subject_dataset(dataset: str, data_dir: str, max_subjects: int, seq_len: int) -> SubjectDataset:
    """The records, labels and subject of every training record (cached per process)."""
    if dataset == "shakespeare":
        return load_shakespeare(data_dir, max_subjects, seq_len)
    return load_femnist(data_dir, max_subjects)


def build_subject_model(cfg: SubjectDPConfig) -> nn.Module:
    """The seeded model of the task (identical on the server and every silo), sized
    to the data set's classes (FEMNIST's 62 labels, the corpus's 65 characters)."""
    classes = load_subject_dataset(cfg.dataset, cfg.data_dir, cfg.max_writers, cfg.seq_len).num_classes
    if cfg.dataset == "shakespeare":
        return build_char_lstm(classes, seed=cfg.model_seed)
    return build_leaf_cnn(classes, seed=cfg.model_seed)
