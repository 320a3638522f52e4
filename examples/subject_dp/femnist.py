"""Subject-level DP on FEMNIST (writers as subjects, 16 silos): the five methods of
Marathe et al. through the project's ServerApp strategy and ClientApp.

Each run is :class:`~flwr_jdp.strategies.subject_level.SubjectLevelFedAvg` driving the
real ClientApp (``apps/subject_dp (subject_dp.client_app:client)``) on an in-process grid
(:class:`~flwr_jdp.inprocess.InProcessGrid`, no Ray; ``flwr run apps/subject_dp``
runs the same apps on a Flower federation). Every run uses the reported-counts mode
(``max-records-per-subject = 0``: silos report their per-subject counts, not DP), the
paper's setting in which the committed results were computed; a user's run defaults to
the public cap instead (``apps/subject_dp/pyproject.toml``).

    python examples/subject_dp/femnist.py --data-dir ../shared/data/femnist \\
        --alpha 1 --runs fedavg local-item-dp higradavg-exact user-ldp

Rows go to ``results/subject_dp/femnist.csv`` (a row with the same run, alpha, learning rate, seed and
evaluation split is replaced), the accuracy history, batch-statistics histograms
and the plan of each run to ``results/subject_dp/runs/<run>_alpha<a>[_lr<lr>].json``
(``_lr<lr>`` when the learning rate is not the default; ``_val_lr<lr>`` for validation
runs).
``--evaluate-on validation`` evaluates on the validation split carved from the
training records (for choosing the learning rate); the committed table uses the
test set with settings chosen on validation. ``report.py`` draws the plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from accounting import write_csv

from apps.subject_dp.subject_dp.client_app import client
from apps.subject_dp.subject_dp.server_app import test_evaluator
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.task import build_subject_model

ROOT = Path(__file__).resolve().parents[2]

#: run name -> run-config overrides (method, accounting, inclusion)
RUNS: dict[str, dict] = {
    "fedavg": {"method": "fedavg"},
    "local-item-dp": {"method": "local-item-dp"},
    "higradavg-exact": {"method": "higradavg-dp", "accounting": "exact"},
    "higradavg-scaled-steps": {"method": "higradavg-dp", "accounting": "scaled-steps"},
    "higradavg-sqrt-rounds": {"method": "higradavg-dp", "accounting": "sqrt-rounds"},
    # the paper's accounting (record sampling rate, under-counts subjects; true epsilon reported)
    "higradavg-paper": {"method": "higradavg-dp", "accounting": "sqrt-rounds", "inclusion": "record"},
    # beyond the paper: Poisson over each silo's subjects (batch-size = expected subjects,
    # one record each), so every writer is amplified by the same rate whatever its count
    "higradavg-subject-sampling": {"method": "higradavg-dp", "accounting": "exact", "sampling": "subjects"},
    # the same with fewer expected subjects per batch (these runs ignore --batch-size)
    **{f"higradavg-subject-sampling-b{b}": {"method": "higradavg-dp", "accounting": "exact",
                                            "sampling": "subjects", "batch-size": b} for b in (32, 64, 128)},
    "local-group-dp": {"method": "local-group-dp", "accounting": "scaled-steps"},
    # beyond the paper: a fixed public group size G (<= G records of a subject per batch,
    # noise z G C), accounted exactly like HiGradAvgDP
    **{f"local-group-dp-g{g}": {"method": "local-group-dp", "accounting": "exact", "group-size": g}
       for g in (1, 2, 4)},
    "user-ldp": {"method": "user-ldp", "accounting": "exact"},
}
FIELDS = ["run", "method", "accounting", "inclusion", "alpha", "rounds", "noise_multiplier", "epsilon",
          "acc_final", "unit", "epsilon_claimed", "epsilon_sfold", "learning_rate", "evaluate_on",
          "seconds", "seed"]


def histogram(values: list[int]) -> dict[str, int]:
    vals, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(vals, counts)}


def run_one(name: str, alpha: float, args: argparse.Namespace, seed: int = 0) -> dict:
    """One run; seed ``k`` uses model seed ``k`` and noise seed ``--noise-seed + k``."""
    rc = {"report-batch-stats": True,  # its histograms below; not DP (reproduction only)
          "max-records-per-subject": 0,  # reported counts, as the paper (and the committed results); not DP
          "model-seed": seed, "dataset": args.dataset, "data-dir": args.data_dir, "alpha": alpha, "budget-rounds": args.budget_rounds,
          "batch-size": args.batch_size, "local-steps": args.local_steps, "max-writers": args.max_subjects,
          "learning-rate": args.learning_rate, "eval-every": args.eval_every,
          "evaluate-on": args.evaluate_on, "noise-seed": args.noise_seed + seed, **RUNS[name]}
    if args.noise_multiplier:
        rc["noise-multiplier"] = args.noise_multiplier
    with tempfile.TemporaryDirectory() as tmp:
        rc["results-dir"] = tmp
        cfg = parse_subject_config(rc)
        grid = InProcessGrid(client, args.nodes, rc)
        strategy = SubjectLevelFedAvg(cfg, build_subject_model(cfg), test_evaluator(cfg), rc)
        t = time.time()
        strategy.start(grid)
        summary = strategy.results()
        seconds = time.time() - t
    plan = summary["plan"]
    row = {"run": name, "method": cfg.method,
           "accounting": "none" if cfg.method == "fedavg" else cfg.accounting,
           "inclusion": cfg.inclusion if cfg.method in ("higradavg-dp", "user-ldp") or cfg.group_size else "",
           "alpha": alpha, "rounds": plan["rounds"], "noise_multiplier": round(plan["noise_multiplier"], 4),
           "epsilon": round(plan["epsilon"], 4) if math.isfinite(plan["epsilon"]) else plan["epsilon"],
           "acc_final": round(summary["acc_final"], 4), "unit": plan["unit"],
           "epsilon_claimed": plan["epsilon_claimed"], "epsilon_sfold": round(plan["epsilon_sfold"], 4)
           if math.isfinite(plan["epsilon_sfold"]) else plan["epsilon_sfold"],
           "learning_rate": cfg.learning_rate, "evaluate_on": cfg.evaluate_on,
           "seconds": round(seconds, 1), "seed": seed}
    detail = {"dataset": args.dataset, "row": row, "run_config": rc | {"results-dir": None}, "plan": plan,
              "ledger_epsilon": summary["ledger_epsilon"], "dropped": summary["dropped"],
              "history": strategy.history,
              "group_size_histogram": histogram(summary["batch_stats"]["group_sizes"]),
              "distinct_subjects_histogram": histogram(summary["batch_stats"]["distinct_subjects"])}
    return detail


def write_row(path: Path, row: dict) -> None:
    rows = []
    if path.is_file():
        def key(r: dict) -> tuple:
            return (r["run"], float(r["alpha"]), r["evaluate_on"], float(r["learning_rate"]),
                    int(r.get("seed") or 0))
        rows = [r for r in csv.DictReader(path.open()) if key(r) != key(row)]
    rows.append(row)
    write_csv(path, [{k: r.get(k, "") for k in FIELDS} for r in rows])


#: dataset -> (default data folder, default learning rate). The rate each method runs at
#: was chosen on the validation split and is passed with --learning-rate (README).
DEFAULTS = {"femnist": ("femnist", 0.2), "shakespeare": ("tinyshakespeare", 2.0)}


def make_parser(dataset: str = "femnist", doc: str | None = None) -> argparse.ArgumentParser:
    """The command line of a run script (this one, ``shakespeare.py``, ``noise_matched.py``)."""
    folder, lr = DEFAULTS[dataset]
    ap = argparse.ArgumentParser(description=(doc or __doc__).splitlines()[0])
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / folder))
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--budget-rounds", type=int, default=100)
    ap.add_argument("--learning-rate", type=float, default=lr)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--max-subjects", type=int, default=0, help="0 = all subjects")
    ap.add_argument("--noise-multiplier", type=float, default=0.0,
                    help="skip calibration (tuning only; the plan still reports the true epsilon)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--evaluate-on", choices=["test", "validation"], default="test")
    ap.add_argument("--noise-seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="seed k: model seed k, noise seed --noise-seed + k")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--results", default=str(ROOT / "results" / "subject_dp"))
    return ap


def main(dataset: str = "femnist", doc: str | None = None) -> None:
    args = make_parser(dataset, doc).parse_args()
    args.dataset = dataset
    torch.set_num_threads(1)
    out = Path(args.results)
    table = out / (f"{dataset}.csv" if args.evaluate_on == "test" else f"{dataset}_validation.csv")
    prefix = "" if dataset == "femnist" else f"{dataset}_"
    for alpha, seed, name in ((a, k, n) for a in args.alpha for k in args.seeds for n in args.runs):
        detail = run_one(name, alpha, args, seed)
        print(json.dumps(detail["row"]), flush=True)
        write_row(table, detail["row"])
        if args.evaluate_on == "validation":
            suffix = f"_val_lr{args.learning_rate:g}"
        else:  # a test run at another rate than the default keeps the default's file
            suffix = "" if args.learning_rate == DEFAULTS[dataset][1] else f"_lr{args.learning_rate:g}"
        suffix += f"_seed{seed}" if seed else ""
        path = out / "runs" / f"{prefix}{name}_alpha{alpha:g}{suffix}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(detail, indent=1, default=float))

if __name__ == "__main__":
    main()
