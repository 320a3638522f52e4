"""Writing a results table: one CSV file, rewritten whole, header first.

A helper of the reproductions and benchmarks (``from research.results_csv import
write_csv``, with the repository root on ``sys.path``); not run on its own.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


def write_csv(path: Path | str, rows: Sequence[dict], fields: Sequence[str] | None = None) -> Path:
    """Write ``rows`` to ``path`` (folders made as needed) under the header ``fields``,
    by default the keys of the first row; keys a row lacks are left blank. Nothing is
    written when there are no rows and no ``fields``."""
    path = Path(path)
    if not rows and fields is None:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields if fields is not None else rows[0]), restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


__all__ = ["write_csv"]
