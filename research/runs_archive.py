"""Per-run folders of a reproduction, read from a folder or from its committed archive.

A reproduction writes one folder per run (``results.json``, ``ledger.json``) under
``<results>/runs`` (joint DP also ``tuning_runs`` and ``runs_interleaved``). The
repository keeps those folders as one archive per reproduction,
``<results>/runs.tar.gz``, whose top-level entries are the folders themselves, so
``tar xzf <results>/runs.tar.gz -C <results>`` restores them in place.

:func:`runs_folder` gives a report the folder to read: ``<results>/<name>`` when it
exists (a fresh reproduction, or an extracted archive), otherwise the same folder
extracted once per process from the archive into a temporary directory (removed at
exit). With neither it returns the (missing) folder, which reports treat as "no runs".
A helper of the reports (``from research.runs_archive import runs_folder``); not run on
its own.
"""

from __future__ import annotations

import atexit
import shutil
import tarfile
import tempfile
from pathlib import Path

ARCHIVE = "runs.tar.gz"

_extracted: dict[Path, Path] = {}


def _extract(archive: Path) -> Path:
    key = archive.resolve()
    if key not in _extracted:
        target = Path(tempfile.mkdtemp(prefix="flwr-jdp-runs-"))
        atexit.register(shutil.rmtree, target, True)
        with tarfile.open(key, "r:gz") as tar:
            tar.extractall(target, filter="data")
        _extracted[key] = target
    return _extracted[key]


def runs_folder(results: Path | str, name: str = "runs") -> Path:
    """``results/name`` if it is a folder, else that folder from ``results/runs.tar.gz``."""
    results = Path(results)
    folder = results / name
    if folder.is_dir():
        return folder
    archive = results / ARCHIVE
    if archive.is_file():
        inside = _extract(archive) / name
        if inside.is_dir():
            return inside
    return folder


__all__ = ["ARCHIVE", "runs_folder"]
