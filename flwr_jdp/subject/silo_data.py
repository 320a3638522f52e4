"""The silos of a run, built identically (and once per process) on every node
from the run config: the task's subjects (FEMNIST writers or Shakespeare
characters, :mod:`flwr_jdp.subject.task`), records spread over the silos by
:func:`flwr_jdp.subject.silos.assign_records`. In the public-cap mode
(``max-records-per-subject = K > 0``) each silo keeps at most ``K`` records of each
subject (:func:`flwr_jdp.subject.silos.truncate_per_subject`, seeded by
``assignment-seed`` and the silo's index) and trains on those only."""

from __future__ import annotations

import functools

import numpy as np

from ..data.subject_dataset import SubjectDataset
from ..training.subject_level import SiloData
from .config import SubjectDPConfig
from .silos import assign_records, subject_silo_counts, truncate_per_subject
from .task import load_subject_dataset


@functools.lru_cache(maxsize=8)
def _build(source: tuple[str, str, int, int], validation_fraction: float, num_silos: int, alpha: float,
           seed: int) -> tuple[SubjectDataset, tuple[np.ndarray, np.ndarray], np.ndarray]:
    ds = load_subject_dataset(*source)
    val = (ds.x_train[:0], ds.y_train[:0])
    if validation_fraction > 0:
        ds, val = ds.validation_split(validation_fraction, seed)
    silo = assign_records(ds.subject_train, num_silos, alpha, seed)
    return ds, val, silo


def dataset(cfg: SubjectDPConfig) -> tuple[SubjectDataset, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """(training data without the validation split, validation split, silo of each record)."""
    return _build(_source(cfg), cfg.validation_fraction, cfg.num_silos, cfg.alpha, cfg.assignment_seed)


def _source(cfg: SubjectDPConfig) -> tuple[str, str, int, int]:
    return (cfg.dataset, cfg.data_dir, cfg.max_writers, cfg.seq_len)


@functools.lru_cache(maxsize=64)
def _silo(source: tuple[str, str, int, int], validation_fraction: float, num_silos: int, alpha: float,
          seed: int, index: int, cap: int) -> SiloData:
    ds, _, silo = _build(source, validation_fraction, num_silos, alpha, seed)
    rows = np.flatnonzero(silo == index)
    if cap > 0:  # public cap: at most `cap` records of each subject (a per-subject choice)
        rows = rows[truncate_per_subject(ds.subject_train[rows], cap, (seed, index))]
    return SiloData.from_numpy(ds.x_train[rows], ds.y_train[rows], ds.subject_train[rows])


def silo_data(cfg: SubjectDPConfig, index: int) -> SiloData:
    """The records silo ``index`` trains on (truncated to ``max-records-per-subject``
    per subject in the public-cap mode)."""
    return _silo(_source(cfg), cfg.validation_fraction, cfg.num_silos, cfg.alpha, cfg.assignment_seed, index,
                 cfg.max_records_per_subject)


def local_counts(cfg: SubjectDPConfig, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(subject ids, record counts) at silo ``index``: what the silo reports in the
    reported-counts mode (never sent in the public-cap mode)."""
    subjects, counts = np.unique(silo_data(cfg, index).subject.numpy(), return_counts=True)
    return subjects.astype(np.int64), counts.astype(np.int64)


def all_counts(cfg: SubjectDPConfig) -> np.ndarray:
    """Records of each subject at each silo, as the silos train on them (capped at
    ``max-records-per-subject`` in the public-cap mode). For studies and tests: no
    server receives it in the public-cap mode."""
    ds, _, silo = dataset(cfg)
    counts = subject_silo_counts(ds.subject_train, silo, ds.num_subjects, cfg.num_silos)
    return np.minimum(counts, cfg.max_records_per_subject) if cfg.public_cap else counts
