"""Loaders for the real data sets, each returning in-memory arrays.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, no
  download), split 75/25 into train and test, stratified, with a fixed seed.
- ``fashion-mnist`` and ``mnist``: the four official IDX ``.gz`` files in a data
  directory (``train-images-idx3-ubyte.gz`` ...). Without a data directory, the
  same arrays are taken from the Hugging Face datasets ``zalando-datasets/fashion_mnist``
  / ``ylecun/mnist`` through ``datasets`` (needs internet).

Images are returned as float32 arrays of shape (N, 1, H, W), standardised with the
training set's mean and standard deviation; labels as int64.
"""

from __future__ import annotations

import functools
import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("digits", "fashion-mnist", "mnist")
#: Image shape (C, H, W) and number of classes of each data set, known without loading it.
SHAPES = {"digits": ((1, 8, 8), 10), "fashion-mnist": ((1, 28, 28), 10), "mnist": ((1, 28, 28), 10)}
HF_NAMES = {"fashion-mnist": "zalando-datasets/fashion_mnist", "mnist": "ylecun/mnist"}
IDX_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


@dataclass(frozen=True)
class ArrayDataset:
    """Train and test arrays of one data set."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]


def dataset_shape(name: str) -> tuple[tuple[int, int, int], int]:
    """``(image shape, number of classes)`` of data set ``name``."""
    if name not in SHAPES:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    return SHAPES[name]


def read_idx(path: str | Path) -> np.ndarray:
    """Read one (optionally gzipped) IDX file into a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, std = float(x_train.mean()), float(x_train.std()) or 1.0
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", seed: int = 0) -> ArrayDataset:
    """Load ``name`` once per process (cached)."""
    if name == "digits":
        return _load_digits(seed)
    if name in ("fashion-mnist", "mnist"):
        if data_dir:
            return _load_idx_dir(Path(data_dir))
        return _load_hf(HF_NAMES[name])
    raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")


def _load_digits(seed: int) -> ArrayDataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    x_tr, x_te = _standardise(x_tr, x_te)
    return ArrayDataset(x_tr, y_tr, x_te, y_te)


def _load_idx_dir(data_dir: Path) -> ArrayDataset:
    missing = [f for f in IDX_FILES.values() if not (data_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"data-dir {data_dir} lacks {', '.join(missing)}")
    arr = {k: read_idx(data_dir / f) for k, f in IDX_FILES.items()}
    x_tr = arr["x_train"].astype(np.float32)[:, None] / 255.0
    x_te = arr["x_test"].astype(np.float32)[:, None] / 255.0
    x_tr, x_te = _standardise(x_tr, x_te)
    return ArrayDataset(
        x_tr, arr["y_train"].astype(np.int64), x_te, arr["y_test"].astype(np.int64)
    )


def _load_hf(hf_name: str) -> ArrayDataset:  # pragma: no cover - needs internet
    import datasets

    ds = datasets.load_dataset(hf_name)
    out = {}
    for split in ("train", "test"):
        images = np.stack([np.asarray(im, dtype=np.float32) for im in ds[split]["image"]])
        out[split] = (images[:, None] / 255.0, np.asarray(ds[split]["label"], dtype=np.int64))
    x_tr, x_te = _standardise(out["train"][0], out["test"][0])
    return ArrayDataset(x_tr, out["train"][1], x_te, out["test"][1])
