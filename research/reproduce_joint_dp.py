"""Reproduce the joint-DP paper's experiments (section 4, appendix C), one cell at a time.

From the repository root (``research/`` is not installed)::

    python -m research.reproduce_joint_dp --dataset fashion-mnist --data-dir DIR --owners N \
        --method joint-dp --epsilon E --seeds K --trust local --out DIR

runs one cell as Flower simulations (one per seed) and appends a row to ``OUT/table.csv``.

A *cell* is (data set, n owners, method, trust model, epsilon, records per user,
personal layers). Every seed of a cell is one Flower simulation of the project's
own ServerApp and ClientApp (:func:`research.simulation.simulate`, Ray backend).
The reported accuracy of a run is the paper's: the mean over owners of each
owner's own model (shared + personal parameters) on its own test split, after the
last round; a cell reports mean and standard deviation over seeds.

Setup, as in the paper
    N = 10,000 training records split evenly among n owners (balanced
    partitioner), at most 8 of the 10 classes per owner, the test set split the
    same way; delta = 1e-4 (= 1/N); local epochs E and rounds T from the paper's
    Table 3; the seed CNN (two conv layers, two parallel FC heads averaged), FC1
    personal for joint-DP.

Trust models
    ``local``: every owner adds its own noise (DP-SGD on the shared parameters);
    the server is not trusted. ``central``: owners send clipped per-record
    gradient sums of one Poisson sample per round and the server (trusted
    aggregator, the paper's billboard model) adds the noise once.

Personal layers (joint-DP) are *decoupled* from the shared release (the default
``personal-coupling``; see :mod:`flwr_jdp.joint_dp.release`): the paper's
Algorithm 1 takes the shared gradients through personal layers trained without
noise, which leaves its record-level guarantee unproven. Its committed results
(``--coupling interleaved``, ``results/joint_dp/table1_interleaved.csv``) came
from an earlier version; this one refuses that coupling, so they are a record only.

Hyperparameters (learning rates, clipping norm, batch size, GroupNorm) come from
:data:`HPARAMS`, fixed a priori and never tuned on the test split. Where a setting was
chosen on a validation split instead (``examples/joint_dp/tune.py``: carved from the
owners' training records, ``--validation-fraction``, or drawn from the unused training
records, ``--validation-source pool``), a cell's ``lr`` (shared learning rate),
``personal_lr``, ``ema_decay`` and ``user_batch`` (users per DP batch at the user level,
run-config ``user-batch-size``) override :data:`HPARAMS`, and its ``finetune_epochs`` and
``finetune_lr`` (joint DP only) adapt each owner's evaluated model to the owner's own
records (run-config ``finetune-epochs``). What was checked, and what was chosen, is in
``results/joint_dp/tuning.csv`` (and in this file's git history).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_jdp.data.partition import VALIDATION_SOURCES
from flwr_jdp.joint_dp.config import (
    FINETUNE_LEARNING_RATE,
    MAX_AUGMENT_SHIFT,
    RELEASE_PERSONAL,
    config_digest,
    parse_config,
)

#: Run-config keys added after results were committed, with the value every
#: earlier run used: a stored config without the key equals one with it at this value.
ADDED_KEYS: dict[str, Any] = {"ema-decay": 0.0, "user-batch-size": 0.0, "finetune-epochs": 0,
                              "finetune-learning-rate": FINETUNE_LEARNING_RATE, "augment-shift": 0,
                              "validation-source": "carve", "release-personal": "seeded",
                              "secure-noise": False, "neighbouring": "add-remove",
                              "max-skipped-rounds": 3}


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the :data:`ADDED_KEYS` at their earlier value, so a run
    stored before a key existed matches the same run configured today."""
    return {k: v for k, v in config.items() if not (k in ADDED_KEYS and v == ADDED_KEYS[k])}


METHODS = ("per-silo", "fedavg", "full-dp", "joint-dp")
TRUST = ("local", "central", "distributed")
COLUMNS = ("dataset", "owners", "method", "trust", "epsilon", "seeds", "acc_mean", "acc_std",
           "records_per_user", "personal_layers", "local_epochs", "rounds", "seconds", "coupling",
           "personal_learning_rate", "ema_decay", "user_batch_size", "finetune_epochs",
           "finetune_learning_rate", "learning_rate", "augment_shift", "release_personal")
COUPLINGS = ("decoupled", "interleaved")

#: The paper's Table 3: n -> (local epochs E, global rounds T).
PAPER_SCHEDULE = {4: (20, 10), 16: (10, 10), 64: (10, 10), 128: (5, 20), 256: (5, 20), 512: (5, 20)}

#: Named personal-layer rules: the paper's Table 2 (FC2 shared), then two beyond the
#: paper that keep both heads personal and share only convolutions (FedRep's split:
#: a shared body, a personal head), to be chosen on validation like the others.
PERSONAL_RULES = {
    "none": "",
    "conv1": r"^conv1\.",
    "conv2": r"^conv2\.",
    "conv1+conv2": r"^(conv1|conv2)\.",
    "fc1": r"^fc1\.",
    "conv1+fc1": r"^(conv1|fc1)\.",
    "conv2+fc1": r"^(conv2|fc1)\.",
    "conv1+conv2+fc1": r"^(conv1|conv2|fc1)\.",
    "fc1+fc2": r"^(fc1|fc2)\.",
    "conv1+fc1+fc2": r"^(conv1|fc1|fc2)\.",
    # Beyond the paper (whose CNN has no normalisation layers): Conv1, Conv2 and FC1
    # personal together with the GroupNorm affine parameters that follow each conv,
    # so only FC2 is shared. Under ``conv1+conv2+fc1`` those GroupNorm parameters are
    # shared and noised although they rescale personal conv outputs.
    "conv1+conv2+fc1+norms": r"^(conv1|norm1|conv2|norm2|fc1)\.",
}

#: Hyperparameters per (method, trust). Chosen a priori (not tuned on any test
#: split; which of them were later checked on a validation split, and the cells
#: that override them with a validated choice, are listed in the module docstring):
#: plain SGD at lr 0.05 for the non-private methods and every personal head; under
#: local noise a small shared lr (0.05) with batch 32 (q = 32/m), because each
#: owner's noise (z ~ 29 at epsilon = 1) dominates its own steps; under central
#: noise one server step per round with a large expected batch, so a large lr (1.0).
HPARAMS: dict[tuple[str, str], dict[str, Any]] = {
    ("per-silo", "local"): {"learning-rate": 0.05, "personal-learning-rate": 0.05, "batch-size": 16},
    ("fedavg", "local"): {"learning-rate": 0.05, "personal-learning-rate": 0.05, "batch-size": 16},
    ("full-dp", "local"): {"learning-rate": 0.05, "personal-learning-rate": 0.05, "batch-size": 32,
                           "clipping-norm": 1.0},
    ("joint-dp", "local"): {"learning-rate": 0.05, "personal-learning-rate": 0.05, "batch-size": 32,
                            "clipping-norm": 1.0},
    ("full-dp", "central"): {"learning-rate": 1.0, "personal-learning-rate": 0.05, "batch-size": 32,
                             "clipping-norm": 1.0},
    ("joint-dp", "central"): {"learning-rate": 1.0, "personal-learning-rate": 0.05, "batch-size": 32,
                              "clipping-norm": 1.0},
}


def hparams_for(method: str, trust: str) -> dict[str, Any]:
    """The :data:`HPARAMS` entry of ``method`` under ``trust`` (methods without DP
    have one entry, whatever the trust model)."""
    central = method in ("full-dp", "joint-dp") and trust in ("central", "distributed")
    return HPARAMS[(method, "central" if central else "local")]


@dataclass(frozen=True)
class Cell:
    """One cell of a results table."""

    dataset: str
    owners: int
    method: str
    trust: str = "local"
    epsilon: float = 1.0
    records_per_user: int = 1
    personal: str = "fc1"
    coupling: str = "decoupled"
    #: Overrides of :data:`HPARAMS` chosen on validation: the personal learning rate
    #: (0 = the HPARAMS value) and the decay of the moving average the owners are
    #: evaluated with (run-config ``ema-decay``; 0 = none).
    personal_lr: float = 0.0
    ema_decay: float = 0.0
    #: User unit only: expected users per DP batch (run-config ``user-batch-size``;
    #: 0 = as many users as fill the HPARAMS batch of records).
    user_batch: float = 0.0
    #: Joint DP only: epochs of plain SGD on all layers, over the owner's own training
    #: records, that adapt each owner's model after the last round (run-config
    #: ``finetune-epochs``; 0 = none), and their learning rate
    #: (``finetune-learning-rate``). The adapted copy is never sent: no privacy cost.
    finetune_epochs: int = 0
    finetune_lr: float = FINETUNE_LEARNING_RATE
    #: The learning rate of the shared (DP) parameters, chosen on validation
    #: (run-config ``learning-rate``; 0 = the HPARAMS value). It scales the noisy
    #: update, so z and the ledger's events do not depend on it; the search that chose
    #: it read the owners' training records and is not in the ledger (as for every
    #: setting chosen on validation here).
    lr: float = 0.0
    #: Pixels of random translation of the owners' own (non-private) training batches
    #: (run-config ``augment-shift``; 0 = none): personal parameters, per-silo, FedAvg,
    #: adaptation. DP-SGD releases are not augmented, so the ledger is unchanged.
    augment: int = 0
    #: Decoupled joint DP only: the public values of the personal parameters in the
    #: model a release is computed on (run-config ``release-personal``; ``seeded`` =
    #: their seeded initialisation, ``zero-head`` = personal head parameters at zero).
    #: A constant either way, so the release and its ledger event are the same DP-SGD.
    release: str = "seeded"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.trust not in TRUST:
            raise ValueError(f"--trust must be one of {TRUST}, got {self.trust!r}")
        if self.personal not in PERSONAL_RULES:
            raise ValueError(f"--personal must be one of {tuple(PERSONAL_RULES)}, got {self.personal!r}")
        if self.owners < 1:
            raise ValueError(f"--owners must be >= 1, got {self.owners}")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"--coupling must be one of {COUPLINGS}, got {self.coupling!r}")
        if self.method == "joint-dp" and self.personal == "none":
            raise ValueError("joint-dp with no personal layers is full-dp: use --method full-dp")
        if self.dp and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"--epsilon must be > 0 and finite for {self.method}, got {self.epsilon}")
        if not (self.personal_lr >= 0 and math.isfinite(self.personal_lr)):
            raise ValueError(f"--personal-learning-rate must be > 0 (0 = default), got {self.personal_lr}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"--ema-decay must be in [0, 1), got {self.ema_decay}")
        if not (self.user_batch >= 0 and math.isfinite(self.user_batch)):
            raise ValueError(f"--user-batch-size must be >= 0 (0 = default), got {self.user_batch}")
        if self.user_batch and (self.records_per_user == 1 or not self.dp):
            raise ValueError("--user-batch-size applies to DP cells at the user level "
                             "(--records-per-user > 1) only")
        if self.finetune_epochs < 0:
            raise ValueError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")
        if self.finetune_epochs and self.method != "joint-dp":
            raise ValueError("--finetune-epochs applies to joint-dp only (an adapted model uses its "
                             "owner's data without noise, which only joint DP allows)")
        if not (self.finetune_lr > 0 and math.isfinite(self.finetune_lr)):
            raise ValueError(f"--finetune-learning-rate must be > 0, got {self.finetune_lr}")
        if not self.finetune_epochs:
            object.__setattr__(self, "finetune_lr", FINETUNE_LEARNING_RATE)  # unused: one cell whatever was given
        if self.personal_lr == self.hparams["personal-learning-rate"]:
            object.__setattr__(self, "personal_lr", 0.0)  # the default spelt out: same cell
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"--learning-rate must be > 0 (0 = default), got {self.lr}")
        if not 0 <= self.augment <= MAX_AUGMENT_SHIFT:
            raise ValueError(f"--augment-shift must be in [0, {MAX_AUGMENT_SHIFT}] pixels, got {self.augment}")
        if self.lr == self.hparams["learning-rate"]:
            object.__setattr__(self, "lr", 0.0)  # the default spelt out: same cell
        if self.release not in RELEASE_PERSONAL:
            raise ValueError(f"--release-personal must be one of {RELEASE_PERSONAL}, got {self.release!r}")
        if self.release != "seeded" and not (self.method == "joint-dp" and self.coupling == "decoupled"):
            raise ValueError("--release-personal applies to joint-dp with decoupled personal layers only")

    @property
    def hparams(self) -> dict[str, Any]:
        """The :data:`HPARAMS` entry of this cell (before its overrides)."""
        return hparams_for(self.method, self.trust)

    @property
    def learning_rate(self) -> float:
        """The learning rate of the shared parameters the cell runs with."""
        return self.lr or float(self.hparams["learning-rate"])

    @property
    def personal_learning_rate(self) -> float:
        """The personal learning rate the cell runs with."""
        return self.personal_lr or float(self.hparams["personal-learning-rate"])

    @property
    def dp(self) -> bool:
        return self.method in ("full-dp", "joint-dp")

    @property
    def name(self) -> str:
        eps = f"eps{self.epsilon:g}" if self.dp else "nodp"
        return (f"{self.dataset}-n{self.owners}-{self.method}-{self.trust}-{eps}"
                f"-mr{self.records_per_user}-{self.personal}"
                + ("-interleaved" if self.method == "joint-dp" and self.coupling == "interleaved" else "")
                + (f"-lr{self.lr:g}" if self.lr else "")
                + (f"-plr{self.personal_lr:g}" if self.personal_lr else "")
                + (f"-ema{self.ema_decay:g}" if self.ema_decay else "")
                + (f"-ub{self.user_batch:g}" if self.user_batch else "")
                + (f"-ft{self.finetune_epochs}-ftlr{self.finetune_lr:g}" if self.finetune_epochs else "")
                + (f"-aug{self.augment}" if self.augment else "")
                + (f"-rel{self.release}" if self.release != "seeded" else ""))


@functools.cache
def _seed_cnn_sizes() -> dict[str, int]:
    """Parameter name -> size of the seed CNN (28x28 grey images, GroupNorm); built once."""
    from flwr_jdp.models.seed_cnn import SeedCNN  # torch only when counted

    return {name: p.numel() for name, p in SeedCNN().named_parameters()}


def personal_parameter_count(rule: str) -> int:
    """Parameters of the seed CNN that the :data:`PERSONAL_RULES` entry ``rule`` keeps personal."""
    pattern = PERSONAL_RULES[rule]
    if not pattern:
        return 0
    return sum(size for name, size in _seed_cnn_sizes().items() if re.search(pattern, name))


def shared_parameter_count(rule: str) -> int:
    """Parameters of the seed CNN that ``rule`` shares (the ones the DP noise covers)."""
    return sum(_seed_cnn_sizes().values()) - personal_parameter_count(rule)


def schedule_for(owners: int) -> tuple[int, int]:
    """(E, T) of the paper's Table 3; other n take the nearest listed n."""
    nearest = min(PAPER_SCHEDULE, key=lambda k: (abs(math.log(k) - math.log(owners)), k))
    return PAPER_SCHEDULE[nearest]


def run_config(cell: Cell, seed: int, data_dir: str, results_dir: str, *,
               local_epochs: int | None = None, rounds: int | None = None,
               validation_fraction: float = 0.0, validation_source: str = "carve",
               max_records: int = 10_000, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Flower run config of one seed of ``cell``."""
    e, t = schedule_for(cell.owners)
    cfg: dict[str, Any] = {
        "method": cell.method,
        "num-owners": cell.owners,
        "num-rounds": rounds or t,
        "local-epochs": local_epochs or e,
        "dataset": cell.dataset,
        "data-dir": data_dir,
        "max-records": max_records,
        "classes-per-owner": 8,
        "partitioner": "balanced",
        "validation-fraction": validation_fraction,
        "delta": 1e-4,
        "target-epsilon": cell.epsilon if cell.dp else 1e9,
        "noise-multiplier": 0.0,
        "privacy-unit": "user" if cell.records_per_user > 1 else "record",
        "records-per-user": cell.records_per_user,
        "noise-placement": cell.trust,
        "accountant": "pld",
        "norm": "group",
        "seed": seed,
        "results-dir": results_dir,
        "resume": False,
    }
    if cell.method == "joint-dp":
        cfg["personal-layers"] = PERSONAL_RULES[cell.personal]
        cfg["personal-coupling"] = cell.coupling
    cfg.update(cell.hparams)
    cfg["learning-rate"] = cell.learning_rate
    cfg["personal-learning-rate"] = cell.personal_learning_rate
    if cell.ema_decay:
        cfg["ema-decay"] = cell.ema_decay
    if cell.user_batch:
        cfg["user-batch-size"] = cell.user_batch
    if cell.finetune_epochs:
        cfg["finetune-epochs"] = cell.finetune_epochs
        cfg["finetune-learning-rate"] = cell.finetune_lr
    if cell.augment:
        cfg["augment-shift"] = cell.augment
    if cell.release != "seeded":
        cfg["release-personal"] = cell.release
    if validation_source != "carve":
        cfg["validation-source"] = validation_source
    cfg.update(extra or {})
    parse_config(cfg)  # fail early with the key's name
    return cfg


def run_seed(cell: Cell, seed: int, data_dir: str, work_dir: Path, supernodes: int = 2,
             ray_address: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run one seed of ``cell`` as a Flower simulation; return its results.json.

    A seed whose ``results.json`` already says ``completed`` for the same
    configuration (all keys but ``results-dir``; ``data-dir`` compared as a resolved
    path, so a relative and an absolute spelling of one folder match) is not run
    again: its results are returned as they are."""
    from .simulation import simulate

    results_dir = work_dir / cell.name / f"seed{seed}"
    cfg = run_config(cell, seed, data_dir, str(results_dir), **kwargs)
    done = results_dir / "results.json"
    if done.is_file():  # a finished seed of exactly this configuration is reused
        old = json.loads(done.read_text())
        def digest(config: dict[str, Any]) -> str:
            same = {k: v for k, v in comparable(config).items() if k != "results-dir"}
            if same.get("data-dir"):
                same["data-dir"] = str(Path(same["data-dir"]).resolve())
            return config_digest(same)

        if (old.get("status") == "completed"
                and digest(old.get("config", {})) == digest(parse_config(cfg).to_dict())):
            old["timing"] = {"seconds": float(old.get("wall_seconds", 0.0)), "reused": True}
            return old
    nodes = max(1, min(supernodes, cell.owners))
    if cell.trust == "distributed":  # secure aggregation needs 3 nodes (flwr_jdp.joint_dp.distributed.MIN_NODES)
        nodes = max(nodes, 3)
    timing = simulate("joint-dp", cfg, num_supernodes=nodes, ray_address=ray_address)
    out = json.loads((results_dir / "results.json").read_text())
    out["timing"] = timing
    return out


def run_cell(cell: Cell, seeds: int, data_dir: str, out_dir: str | os.PathLike[str],
             supernodes: int = 2, table: str = "table.csv", ray_address: str | None = None,
             **kwargs: Any) -> dict[str, Any]:
    """Run ``seeds`` seeds of ``cell`` and append one row to ``out_dir/table`` (unless
    the table already holds that exact row, as when every seed was reused)."""
    out = Path(out_dir)
    accs, seconds = [], 0.0
    cfg = None
    for seed in range(seeds):
        res = run_seed(cell, seed, data_dir, out / "runs", supernodes, ray_address, **kwargs)
        if res.get("rounds_completed", 0) < 1 or res.get("final_accuracy") is None:
            raise RuntimeError(f"{cell.name} seed {seed}: no round completed "
                               f"(status {res.get('status')})")
        accs.append(float(res["final_accuracy"]))
        seconds += float(res["timing"]["seconds"])  # a reused seed counts its recorded wall time
        cfg = res.get("config", {})
        print(f"[{cell.name}] seed {seed}: accuracy {accs[-1]:.4f}, epsilon "
              f"{res.get('final_epsilon', 0.0):.4f} ({res.get('status')}), "
              f"{res['timing']['seconds']:.0f}s", flush=True)
    row = {
        "dataset": cell.dataset, "owners": cell.owners, "method": cell.method,
        "trust": cell.trust if cell.dp else "-", "epsilon": cell.epsilon if cell.dp else "inf",
        "seeds": seeds, "acc_mean": round(statistics.mean(accs), 4),
        "acc_std": round(statistics.pstdev(accs), 4) if len(accs) > 1 else 0.0,
        "records_per_user": cell.records_per_user, "personal_layers": cell.personal,
        "local_epochs": (cfg or {}).get("local-epochs", ""), "rounds": (cfg or {}).get("num-rounds", ""),
        "seconds": round(seconds, 1),
        "coupling": cell.coupling if cell.method == "joint-dp" else "-",
        "personal_learning_rate": f"{cell.personal_learning_rate:g}", "ema_decay": f"{cell.ema_decay:g}",
        "user_batch_size": f"{cell.user_batch:g}", **finetune_columns(cell.finetune_epochs, cell.finetune_lr),
        "learning_rate": f"{cell.learning_rate:g}", "augment_shift": str(cell.augment),
        "release_personal": cell.release,
    }
    if {k: str(row.get(k, "")) for k in COLUMNS} in upgrade_table(out / table):
        print(f"[{cell.name}] every seed reused: {table} already holds this row", flush=True)
    else:
        append_row(out / table, row)
    return row


def finetune_columns(epochs: int, lr: float) -> dict[str, str]:
    """The ``finetune_epochs`` and ``finetune_learning_rate`` columns of a row
    (``0`` and ``-`` without adaptation)."""
    return {"finetune_epochs": str(epochs), "finetune_learning_rate": f"{lr:g}" if epochs else "-"}


def append_row(path: Path, row: dict[str, Any], columns: tuple[str, ...] = COLUMNS) -> None:
    """Append ``row`` to the CSV at ``path`` (header ``columns`` written once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in columns})


def _columns_added_since(row: dict[str, str]) -> dict[str, str]:
    """Values of the :data:`COLUMNS` added after the first tables were written, at
    what those rows' runs used: the HPARAMS personal learning rate, no moving average,
    the default user batch (``user_batch_size`` 0), no adaptation before evaluation, the
    HPARAMS learning rate of the shared parameters, no augmentation, personal
    parameters at their seeded values in every decoupled release."""
    hp = hparams_for(row["method"], row.get("trust", ""))
    return {"personal_learning_rate": f"{hp['personal-learning-rate']:g}", "ema_decay": "0",
            "user_batch_size": "0", **finetune_columns(0, 0.0), "learning_rate": f"{hp['learning-rate']:g}",
            "augment_shift": "0", "release_personal": "seeded"}


def upgrade_table(path: Path, columns: tuple[str, ...] = COLUMNS,
                  added: Callable[[dict[str, str]], dict[str, str]] = _columns_added_since,
                  ) -> list[dict[str, str]]:
    """Rows of the table at ``path``; a file written before a column of ``columns``
    existed is rewritten with it, at the value ``added(row)`` gives for that row (by
    default the values its runs used, see ``_columns_added_since``)."""
    rows = read_rows(path)
    if not rows or all(k in rows[0] for k in columns):
        return rows
    for r in rows:
        for k, v in added(r).items():
            r.setdefault(k, v)
    # Written whole to a temporary file, then moved into place: a process that runs
    # beside this one (two tuning runs started together) reads either the old table
    # or the new one, never a half-rewritten file whose rows it would write again.
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    with os.fdopen(fd, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in columns} for r in rows)
    os.replace(tmp, path)
    return read_rows(path)


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Rows of a table CSV (empty list if there is none)."""
    p = Path(path)
    if not p.exists():
        return []
    with p.open(newline="") as fh:
        return list(csv.DictReader(fh))



def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line of one cell (``python -m research.reproduce_joint_dp --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m research.reproduce_joint_dp",
        description="Run one cell of the joint-DP paper's tables (1, 2, 4) as Flower simulations "
        "(one per seed) and append a row to OUT/TABLE. Run from the repository root.")
    parser.add_argument("--dataset", choices=("fashion-mnist", "mnist", "digits"), default="fashion-mnist",
                        help="data set of the owners")
    parser.add_argument("--data-dir", default="", help="folder with the four IDX .gz files "
                        "(empty: Hugging Face through flwr-datasets)")
    parser.add_argument("--owners", type=_positive(int), required=True, help="number of owners n")
    parser.add_argument("--method", choices=("per-silo", "fedavg", "full-dp", "joint-dp"), required=True,
                        help="the method of the table's row")
    parser.add_argument("--epsilon", type=_positive(float), default=1.0, help="target epsilon of each run")
    parser.add_argument("--seeds", type=_positive(int), default=3, help="seeds (runs) per cell")
    parser.add_argument("--quick", action="store_true", help="one seed")
    parser.add_argument("--trust", choices=TRUST, default="local",
                        help="noise placement: local (owners noise), central (trusted server) or "
                             "distributed (owners' noise shares summed by secure aggregation)")
    parser.add_argument("--records-per-user", type=_positive(int), default=1, help="m/r (user unit if > 1)")
    parser.add_argument("--personal", default="fc1", help="personal layers: fc1, conv1, conv2, "
                        "conv1+fc1, conv2+fc1, conv1+conv2, conv1+conv2+fc1 (the paper's Table 2), "
                        "fc1+fc2, conv1+fc1+fc2 (both heads personal)")
    parser.add_argument("--coupling", choices=("decoupled",), default="decoupled",
                        help="joint-dp personal layers: decoupled from the shared release (DP holds); the "
                        "paper's Algorithm 1 ('interleaved', archived results only) is refused")
    parser.add_argument("--learning-rate", type=_positive(float), default=None,
                        help="learning rate of the shared parameters (default: the method's; choose it "
                        "on validation with examples/joint_dp/tune.py --learning-rates)")
    parser.add_argument("--personal-learning-rate", type=_positive(float), default=None,
                        help="personal learning rate (default: the method's; choose it on validation "
                        "with examples/joint_dp/tune.py)")
    parser.add_argument("--ema-decay", type=float, default=0.0,
                        help="in [0, 1): evaluate the owners on a moving average of the shared model "
                        "(post-processing, no privacy cost); 0 = the last aggregate")
    parser.add_argument("--user-batch-size", type=float, default=0.0,
                        help="user level (--records-per-user > 1): expected users per DP batch "
                        "(default 0: as many users as fill the method's batch of records; choose it on "
                        "validation with examples/joint_dp/tune.py --user-batch-sizes)")
    parser.add_argument("--finetune-epochs", type=int, default=0,
                        help="joint-dp: epochs of plain SGD on all layers over the owner's own records that "
                        "adapt each owner's model after the last round, before it is evaluated (never "
                        "sent, no privacy cost; 0 = none)")
    parser.add_argument("--finetune-learning-rate", type=float, default=FINETUNE_LEARNING_RATE,
                        help="learning rate of that adaptation")
    parser.add_argument("--augment-shift", type=int, default=0,
                        help="pixels of random translation of the owners' own non-private training "
                        "batches (personal layers, per-silo, FedAvg, adaptation; DP-SGD releases are not "
                        "augmented, so no privacy cost); choose it on validation with "
                        "examples/joint_dp/tune.py --augment-shifts; 0 = none")
    parser.add_argument("--release-personal", choices=RELEASE_PERSONAL, default="seeded",
                        help="joint-dp, decoupled: the public values of the personal layers in the model "
                        "each release is computed on (seeded initialisation, or the personal head at "
                        "zero); a constant either way, so the release is the same DP-SGD")
    parser.add_argument("--supernodes", type=_positive(int), default=2,
                        help="simulated SuperNodes; the owners are spread over them")
    parser.add_argument("--local-epochs", type=_positive(int), default=None, help="default: paper Table 3")
    parser.add_argument("--rounds", type=_positive(int), default=None, help="default: paper Table 3")
    parser.add_argument("--validation-fraction", type=float, default=0.0,
                        help="> 0: evaluate on a validation split of the training data (tuning)")
    parser.add_argument("--validation-source", choices=VALIDATION_SOURCES, default="carve",
                        help="carve: part of each owner's training records; pool: training-set records "
                        "outside the 10,000 used, dealt like the test split (owners train on all theirs)")
    parser.add_argument("--table", default="table.csv", help="CSV file name inside --out")
    parser.add_argument("--ray-address", default=None,
                        help="run on an existing Ray cluster (ray start --head ...), e.g. 127.0.0.1:6379")
    parser.add_argument("--out", required=True, help="results folder (rows appended to OUT/TABLE)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cell = Cell(args.dataset, args.owners, args.method, args.trust, args.epsilon,
                    args.records_per_user, args.personal, args.coupling,
                    lr=args.learning_rate or 0.0,
                    personal_lr=args.personal_learning_rate or 0.0, ema_decay=args.ema_decay,
                    user_batch=args.user_batch_size, finetune_epochs=args.finetune_epochs,
                    finetune_lr=args.finetune_learning_rate, augment=args.augment_shift,
                    release=args.release_personal)
    except ValueError as err:
        print(f"research.reproduce_joint_dp: {err}", file=sys.stderr)
        return 2
    row = run_cell(cell, 1 if args.quick else args.seeds, args.data_dir, args.out,
                   supernodes=args.supernodes, table=args.table, ray_address=args.ray_address,
                   local_epochs=args.local_epochs, rounds=args.rounds,
                   validation_fraction=args.validation_fraction,
                   validation_source=args.validation_source)
    print(", ".join(f"{k}={v}" for k, v in row.items()))
    print(f"{row['acc_mean']:.4f}")
    return 0


__all__ = ["ADDED_KEYS", "COLUMNS", "Cell", "HPARAMS", "METHODS", "PAPER_SCHEDULE", "PERSONAL_RULES", "TRUST",
           "append_row", "build_parser", "comparable", "finetune_columns", "hparams_for", "main",
           "personal_parameter_count", "read_rows", "run_cell", "run_config", "run_seed", "schedule_for",
           "shared_parameter_count", "upgrade_table"]

if __name__ == "__main__":
    sys.exit(main())
