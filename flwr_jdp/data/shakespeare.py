"""Tiny Shakespeare with its speaking characters as data subjects.

Every speech in ``input.txt`` is a block headed by a ``SPEAKER:`` line. A
character's speeches (header lines removed, lines joined by newlines, speeches
separated by a newline) form its text; each speech goes to the test set with
probability ``test_fraction`` (seeded), the rest to training. Each text is cut
into records of ``seq_len + 1`` characters with stride ``seq_len``: ``x`` holds
the first ``seq_len`` character ids, ``y`` the next character at every position
(the same string shifted by one), so one record is ``seq_len`` next-character
predictions by one speaker. Accuracy is over all predicted characters.

Subjects are the characters with at least ``min_chars`` characters of training
text (the rest are dropped: too little text for a subject); ``max_subjects`` > 0
keeps that many characters with the most text. The 65-symbol vocabulary is the
sorted set of characters of the corpus minus header lines.

Sources: ``data_dir`` (a folder with ``input.txt``, or the file itself), or with
no ``data_dir`` the LEAF variant ``flwrlabs/shakespeare`` on Hugging Face
(``character_id`` as subject; each character's text rebuilt from its rows,
needs internet).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .subject_dataset import SubjectDataset

TEXT_NAME = "input.txt"
HF_NAME = "flwrlabs/shakespeare"


def parse_speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs in corpus order; blocks without a ``NAME:`` header are skipped."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and lines[0].endswith(":") and lines[0][:-1].strip():
            out.append((lines[0][:-1].strip(), "\n".join(lines[1:])))
    return out


def chunk(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``seq_len`` inputs and ``seq_len`` shifted targets, stride ``seq_len``."""
    count = max(0, (len(ids) - 1) // seq_len)
    if count == 0:
        return np.zeros((0, seq_len), np.int64), np.zeros((0, seq_len), np.int64)
    idx = np.arange(count)[:, None] * seq_len + np.arange(seq_len)[None, :]
    return ids[idx].astype(np.int64), ids[idx + 1].astype(np.int64)


def build_subject_dataset(texts: dict[str, tuple[str, str]], vocab: str, seq_len: int,
                          min_chars: int, max_subjects: int) -> SubjectDataset:
    """Records of every speaker from its (train text, test text)."""
    lookup = np.full(1 + max(map(ord, vocab)), -1, dtype=np.int64)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))

    def encode(s: str) -> np.ndarray:
        codes = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        return lookup[codes[codes < len(lookup)]]

    speakers = sorted((name for name, (tr, _) in texts.items() if len(tr) >= min_chars),
                      key=lambda n: (-len(texts[n][0]), n))
    if max_subjects > 0:
        speakers = speakers[:max_subjects]
    parts = {"xtr": [], "ytr": [], "str": [], "xte": [], "yte": []}
    for subject, name in enumerate(speakers):
        train, test = texts[name]
        x, y = chunk(encode(train), seq_len)
        parts["xtr"].append(x)
        parts["ytr"].append(y)
        parts["str"].append(np.full(len(y), subject, dtype=np.int64))
        x, y = chunk(encode(test), seq_len)
        parts["xte"].append(x)
        parts["yte"].append(y)
    cat = {k: np.concatenate(v) if v else np.zeros((0, seq_len), np.int64) for k, v in parts.items()}
    return SubjectDataset(cat["xtr"], cat["ytr"], cat["str"].reshape(-1), cat["xte"], cat["yte"],
                          len(speakers), len(vocab))


@functools.lru_cache(maxsize=4)
def load_shakespeare(data_dir: str = "", max_subjects: int = 0, seq_len: int = 40, min_chars: int = 1000,
                     test_fraction: float = 0.1, seed: int = 0) -> SubjectDataset:
    """Load Tiny Shakespeare with characters as subjects (cached per process)."""
    if seq_len < 1:
        raise ValueError(f"seq-len must be >= 1, got {seq_len}")
    if data_dir:
        path = Path(data_dir).expanduser()
        if path.is_dir():
            path = path / TEXT_NAME
        if not path.is_file():
            raise FileNotFoundError(f"data-dir: no Tiny Shakespeare file at {path} (expected {TEXT_NAME})")
        speeches = parse_speeches(path.read_text(encoding="utf-8"))
    else:  # pragma: no cover - needs internet
        speeches = _load_hf()
    rng = np.random.default_rng(seed)
    is_test = rng.random(len(speeches)) < test_fraction
    texts: dict[str, tuple[list[str], list[str]]] = {}
    for (name, speech), test in zip(speeches, is_test, strict=True):
        texts.setdefault(name, ([], []))[int(test)].append(speech)
    joined = {n: ("\n".join(tr), "\n".join(te)) for n, (tr, te) in texts.items()}
    vocab = "".join(sorted({c for _, s in speeches for c in s} | {"\n"}))
    return build_subject_dataset(joined, vocab, seq_len, min_chars, max_subjects)


def _load_hf() -> list[tuple[str, str]]:  # pragma: no cover - needs internet
    from datasets import load_dataset

    ds = load_dataset(HF_NAME, split="train")
    texts: dict[str, list[str]] = {}
    for row in ds:
        parts = texts.setdefault(str(row["character_id"]), [])
        parts.append(row["x"] + row["y"] if not parts else row["y"])
    return [(name, "".join(parts)) for name, parts in texts.items()]
