"""FEMNIST with its writers as data subjects.

Two sources, same arrays:

- ``data_dir``: a folder holding ``femnist_leaf_subset_300writers.npz`` (the LEAF
  ``niid`` subset shipped with this project's shared data: ``x_train`` (N, 28, 28)
  uint8 with a white background, ``y_train`` in 0..61, ``writer_train``, the test
  arrays likewise) or any ``.npz`` with those keys given as a file path;
- no ``data_dir``: the Hugging Face dataset ``flwrlabs/femnist`` through
  ``datasets`` (needs internet), its ``writer_id`` column as the subject, split
  90/10 per writer with a fixed seed; ``max_writers`` keeps the first writers.

Images are returned as float32 (N, 1, 28, 28) with ink positive
(``1 - pixel / 255``), standardised with the training mean and std; labels int64;
``subject_train`` / ``subject_test`` are writer indices 0..S-1.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .subject_dataset import SubjectDataset

NPZ_NAME = "femnist_leaf_subset_300writers.npz"
HF_NAME = "flwrlabs/femnist"
NUM_CLASSES = 62


def _prepare(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xt = 1.0 - x_train.astype(np.float32)[:, None] / 255.0
    xs = 1.0 - x_test.astype(np.float32)[:, None] / 255.0
    mean, std = float(xt.mean()), float(xt.std()) or 1.0
    return (xt - mean) / std, (xs - mean) / std


@functools.lru_cache(maxsize=4)
def load_femnist(data_dir: str = "", max_writers: int = 0) -> SubjectDataset:
    """Load FEMNIST (cached per process); ``max_writers`` > 0 keeps that many writers."""
    if data_dir:
        path = Path(data_dir).expanduser()
        if path.is_dir():
            path = path / NPZ_NAME
        if not path.is_file():
            raise FileNotFoundError(f"data-dir: no FEMNIST file at {path} (expected {NPZ_NAME})")
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("x_train", "y_train", "writer_train", "x_test", "y_test")}
    else:  # pragma: no cover - needs internet
        arrays = _load_hf(max_writers)
    writers = arrays["writer_train"].astype(np.int64)
    if max_writers > 0:
        keep = writers < max_writers
        arrays = {**arrays, "x_train": arrays["x_train"][keep], "y_train": arrays["y_train"][keep]}
        writers = writers[keep]
    _, subjects = np.unique(writers, return_inverse=True)
    x_train, x_test = _prepare(arrays["x_train"], arrays["x_test"])
    return SubjectDataset(x_train, arrays["y_train"].astype(np.int64), subjects.astype(np.int64),
                          x_test, arrays["y_test"].astype(np.int64), int(subjects.max()) + 1, NUM_CLASSES)


def _load_hf(max_writers: int) -> dict[str, np.ndarray]:  # pragma: no cover - needs internet
    from datasets import load_dataset

    ds = load_dataset(HF_NAME, split="train")
    writer_ids = np.asarray(ds["writer_id"])
    names, writer = np.unique(writer_ids, return_inverse=True)
    if max_writers > 0:
        rows = np.flatnonzero(writer < max_writers)
        ds, writer = ds.select(rows.tolist()), writer[rows]
    images = np.stack([np.asarray(im, dtype=np.uint8) for im in ds["image"]])
    labels = np.asarray(ds["character"], dtype=np.int64)
    rng = np.random.default_rng(0)
    test = rng.random(len(labels)) < 0.1
    return {"x_train": images[~test], "y_train": labels[~test], "writer_train": writer[~test],
            "x_test": images[test], "y_test": labels[test]}
