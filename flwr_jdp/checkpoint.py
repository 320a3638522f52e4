"""Per-round checkpoint of a run: shared model, privacy ledger and results.

Written to ``results-dir`` after every round (``model.npz``, ``ledger.json``,
``results.json``), atomically, so a killed server can be restarted and continue
from the epsilon it had spent rather than from zero.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from flwr_jdp.config_check import config_digest
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.records import ArraySpec, to_record


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "wb") as fh:
        write(fh)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class Checkpoint:
    """Files of one run in ``directory``."""

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.config = config
        self.digest = config_digest(config)

    @property
    def results_path(self) -> Path:
        return self.directory / "results.json"

    @property
    def ledger_path(self) -> Path:
        return self.directory / "ledger.json"

    @property
    def model_path(self) -> Path:
        return self.directory / "model.npz"

    @property
    def ema_path(self) -> Path:
        """The averaged shared model (``ema-decay`` > 0): the one owners are
        evaluated with, plus the number of rounds averaged (``ema-steps``)."""
        return self.directory / "model_ema.npz"

    def resumable(self) -> bool:
        """True if an unfinished run with the same configuration is on disk."""
        if not (self.results_path.is_file() and self.ledger_path.is_file()
                and self.model_path.is_file()):
            return False
        try:
            res = json.loads(self.results_path.read_text())
        except (OSError, ValueError):
            return False
        return res.get("status") == "running" and res.get("config_digest") == self.digest

    def save(self, arrays: ArrayRecord, ledger: PrivacyLedger, history: list[dict],
             noise_multiplier: float, status: str, summary: dict[str, Any],
             ema: tuple[dict[str, np.ndarray], int] | None = None) -> None:
        """Write model (and its moving average, if any), ledger and results (in
        that order)."""
        named = {k: v.numpy() for k, v in arrays.items()}
        _atomic_write(self.model_path, lambda fh: np.savez(fh, **named))
        if ema is not None:
            average, steps = ema
            _atomic_write(self.ema_path,
                          lambda fh: np.savez(fh, **average, **{"ema-steps": np.asarray(steps)}))
        ledger.save(self.ledger_path)
        doc = {
            "status": status,
            "config": self.config,
            "config_digest": self.digest,
            "noise_multiplier": noise_multiplier,
            "epsilon": ledger.epsilon(),
            "delta": ledger.delta,
            "accountant": ledger.accountant,
            "unit": ledger.unit,
            "history": history,
            **summary,
        }
        data = json.dumps(doc, indent=1, default=float).encode()
        _atomic_write(self.results_path, lambda fh: fh.write(data))

    def session(self) -> str:
        """The training session id of the run on disk ('' if none)."""
        try:
            return str(json.loads(self.results_path.read_text()).get("session", ""))
        except (OSError, ValueError):
            return ""

    def load(self, spec: dict[str, ArraySpec]) -> tuple[ArrayRecord, PrivacyLedger, list[dict], float]:
        """Restore (shared arrays, ledger, history, noise multiplier)."""
        res = json.loads(self.results_path.read_text())
        with np.load(self.model_path) as npz:
            arrays = {k: np.asarray(npz[k]) for k in spec}
        return (to_record(arrays), PrivacyLedger.load(self.ledger_path), res["history"],
                float(res["noise_multiplier"]))

    def load_ema(self, spec: dict[str, ArraySpec]) -> tuple[dict[str, np.ndarray], int] | None:
        """Restore (averaged shared arrays, rounds averaged), or None if not saved."""
        if not self.ema_path.is_file():
            return None
        with np.load(self.ema_path) as npz:
            return {k: np.asarray(npz[k]) for k in spec}, int(npz["ema-steps"])
