"""FEMNIST runs on the real 300 writers at the noise that epsilon = 4 costs with N writers.

Not a privacy result. The issue's anchor (HiGradAvgDP within 3 points of LocalItemDP)
is the paper's, on 3,500 writers; the data here has 300, and ``scale.py`` computes
(accounting only) the noise multiplier that the same budget (epsilon 4, delta 1e-5,
100 rounds of 2 batches of 256 per silo, 16 silos, exact accounting) needs when the
300 writers' silo counts are resampled to ``N`` writers. This script trains on the
real 300 writers with that noise multiplier in place of the calibrated one, so that
each step's noise is what an ``N``-writer federation would add, on the same images:

- ``higradavg-exact`` (record sampling, per-writer averages) at ``scale.csv``'s
  ``noise_multiplier`` for ``N`` (``--match noise``, the default), or at that multiplier
  scaled so each step's signal-to-noise bound is the ``N``-writer one (``--match snr``,
  see :func:`matched_noise`);
- ``local-item-dp`` at its ``local_item_dp_noise_multiplier`` for ``N`` (both matchings).

Everything else is the ``femnist.py`` run of the same name. The ``epsilon`` column is
the exact epsilon *of this run on the 300 writers* (the plan's, as in ``femnist.py``):
far above 4, because 300 writers at that noise are not 4-DP. What the runs show is how
far the noise alone, at the paper's writer count, would move each method's accuracy.

    python examples/subject_dp/noise_matched.py --data-dir ../shared/data/femnist \\
        --writers 3500 --runs higradavg-exact --learning-rate 1.6 --evaluate-on validation

``--report`` trains nothing: it prints, per run and writer count, the learning rate chosen
on the validation rows (of the rates run on the most seeds, the highest mean) and the test
accuracy there, beside the 300-writer test rows of ``femnist.csv`` at their chosen rate,
and draws ``results/subject_dp/noise_matched.png``.

Rows go to ``results/subject_dp/noise_matched.csv`` (a row with the same writers, match,
run, learning rate, split and seed is replaced) and each run to
``results/subject_dp/runs/noise_matched/<run>_w<N>[_snr][_val]_lr<lr>_seed<k>.json``.
The runs always use all the real writers (``--max-subjects`` is refused: the matching
is computed for them).
Several processes may write the csv at once (it is locked while it is rewritten).
"""

from __future__ import annotations

import csv
import fcntl
import json
import statistics
import sys
from pathlib import Path

import torch
from femnist import make_parser, run_one

# research/ (the reproductions' code) is not installed: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.results_csv import write_csv  # noqa: E402

#: run -> the scale.csv column that holds its noise multiplier for N writers
NOISE_COLUMN = {"higradavg-exact": "noise_multiplier", "local-item-dp": "local_item_dp_noise_multiplier"}
FIELDS = ["writers_matched", "match", "run", "learning_rate", "evaluate_on", "seed", "noise_multiplier",
          "epsilon", "unit", "rounds", "acc_final", "seconds"]


#: the writers of the data set the runs train on (FEMNIST's LEAF slice)
REAL_WRITERS = 300
MATCH = ("noise", "snr")
MATCH_ORDER = {"calibrated": 0, "noise": 1, "snr": 2}


def _scale_row(scale_csv: Path, writers: int) -> dict:
    rows = [r for r in csv.DictReader(scale_csv.open()) if int(r["writers"]) == writers]
    if not rows:
        raise SystemExit(f"{scale_csv} has no row for {writers} writers: run scale.py --writers {writers}")
    return rows[0]


def matched_noise(scale_csv: Path, writers: int, run: str, match: str = "noise") -> float:
    """The noise multiplier to train ``run`` at on the real writers.

    ``noise``: the one ``scale.py`` calibrated for ``run`` at ``writers`` writers, so each
    step adds the noise of an ``writers``-writer federation. ``snr`` (HiGradAvgDP): that
    multiplier times the real data's distinct writers per batch over those of
    ``writers`` writers, so each step's signal-to-noise bound (``scale.csv``'s
    ``signal_to_noise``: writers per batch times ``C`` against the noise) is the
    ``writers``-writer one. A record-level step's bound does not depend on the writers
    (every record adds up to ``C``), so LocalItemDP's ``snr`` multiplier is its ``noise`` one.
    """
    row = _scale_row(scale_csv, writers)
    value = row.get(NOISE_COLUMN[run], "")
    if not value:
        raise SystemExit(f"{scale_csv} has no {NOISE_COLUMN[run]} column: rerun scale.py")
    z = float(value)
    if match == "snr" and run == "higradavg-exact":
        real = _scale_row(scale_csv, REAL_WRITERS)
        z *= float(real["subjects_per_batch"]) / float(row["subjects_per_batch"])
    return z


def key(r: dict) -> tuple:
    return (int(r["writers_matched"]), r.get("match") or "noise", r["run"], float(r["learning_rate"]),
            r["evaluate_on"], int(r["seed"]))


def write_row(path: Path, row: dict) -> None:
    """Replace the row of the same key in ``path`` (under an exclusive lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [r | {"match": r.get("match") or "noise"} for r in csv.DictReader(path.open())
                if key(r) != key(row)] if path.is_file() else []
        write_csv(path, rows + [row], FIELDS)


def _series(rows: list[dict]) -> tuple[float, float, int]:
    accs = [float(r["acc_final"]) for r in rows]
    return statistics.fmean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0, len(accs)


def summary(folder: Path) -> list[dict]:
    """Per run: the test accuracy at the noise calibrated on the 300 writers (``femnist.csv``,
    at the rate chosen on validation in ``method_learning_rate_choice.csv``; ``match`` is
    ``calibrated``) and at each matched writer count and match (``noise_matched.csv``, at
    the rate chosen on its own validation rows: among the rates run on the most seeds, the
    highest mean over the seeds they all ran; ``validation`` lists those finalists), mean,
    std and seeds."""
    chosen = {r["run"]: float(r["learning_rate"]) for r in csv.DictReader(
        (folder / "method_learning_rate_choice.csv").open()) if float(r["alpha"]) == 1.0}
    real = [r for r in csv.DictReader((folder / "femnist.csv").open())
            if r["evaluate_on"] == "test" and float(r["alpha"]) == 1.0]
    matched = [r | {"match": r.get("match") or "noise"} for r in csv.DictReader((folder / "noise_matched.csv").open())]
    out = []
    for run in NOISE_COLUMN:
        rows = [r for r in real if r["run"] == run and float(r["learning_rate"]) == chosen[run]]
        if rows:
            m, sd, k = _series(rows)
            out.append({"run": run, "writers_matched": REAL_WRITERS, "match": "calibrated",
                        "learning_rate": chosen[run], "noise_multiplier": float(rows[-1]["noise_multiplier"]),
                        "epsilon": float(rows[-1]["epsilon"]), "acc_mean": m, "acc_std": sd, "seeds": k})
        cells = sorted({(int(r["writers_matched"]), r["match"]) for r in matched if r["run"] == run})
        for w, match in cells:
            mine = [r for r in matched if r["run"] == run and int(r["writers_matched"]) == w and r["match"] == match]
            by_lr: dict[float, dict[int, float]] = {}
            for r in mine:
                if r["evaluate_on"] == "validation":
                    by_lr.setdefault(float(r["learning_rate"]), {})[int(r["seed"])] = float(r["acc_final"])
            if not by_lr:
                continue
            # the finalists: the rates run on the most seeds (a seed-0 screen, then the best
            # on more seeds), compared by their mean over the seeds they all ran
            most = max(len(v) for v in by_lr.values())
            by_lr = {x: v for x, v in by_lr.items() if len(v) == most}
            common = set.intersection(*(set(v) for v in by_lr.values()))
            if not common:
                continue
            lr = max(by_lr, key=lambda x: statistics.fmean(by_lr[x][s] for s in common))
            test = [r for r in mine if r["evaluate_on"] == "test" and float(r["learning_rate"]) == lr]
            if test:
                m, sd, k = _series(test)
                out.append({"run": run, "writers_matched": w, "match": match, "learning_rate": lr,
                            "noise_multiplier": float(test[-1]["noise_multiplier"]),
                            "epsilon": float(test[-1]["epsilon"]), "acc_mean": m, "acc_std": sd, "seeds": k,
                            "validation": " ".join(f"{x:g}:{statistics.fmean(v[s] for s in common):.4f}"
                                                   for x, v in sorted(by_lr.items())),
                            "validation_seeds": len(common)})
    return out


def plot(folder: Path) -> Path:
    """``noise_matched.png``: final test accuracy of each run at the 300 writers' calibrated
    noise and at each matched writer count and match (error bars: std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(folder)
    cells = sorted({(r["writers_matched"], r["match"]) for r in rows}, key=lambda c: (c[0], MATCH_ORDER[c[1]]))
    names = {"calibrated": "calibrated, eps = 4", "noise": "its noise", "snr": "its signal/noise"}
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, (run, marker) in enumerate(zip(NOISE_COLUMN, "os")):
        for j, cell in enumerate(cells):
            r = next((r for r in rows if r["run"] == run and (r["writers_matched"], r["match"]) == cell), None)
            if r is None:
                continue
            x = j + (i - 0.5) * 0.15
            ax.errorbar([x], [r["acc_mean"]], yerr=[r["acc_std"]], marker=marker, capsize=3,
                        color=f"C{i}", label=run if j == 0 else None)
            ax.annotate(f"z={r['noise_multiplier']:.3g}", (x, r["acc_mean"]), textcoords="offset points",
                        xytext=(6, -3), fontsize=7)
    ax.set_xticks(range(len(cells)), [f"{w} writers,\n{names[m]}" for w, m in cells], fontsize=8)
    ax.set_ylabel("final test accuracy (trained on the 300 writers)")
    ax.set_title("FEMNIST, 16 silos, alpha = 1: the noise of N writers' epsilon = 4", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "noise_matched.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = make_parser("femnist", __doc__)
    ap.add_argument("--writers", type=int, nargs="+", default=[3500],
                    help="writer counts whose calibrated noise to train at (rows of scale.csv)")
    ap.add_argument("--match", choices=MATCH, default="noise",
                    help="noise: the N-writer noise multiplier; snr: the N-writer signal-to-noise bound")
    ap.add_argument("--report", action="store_true",
                    help="train nothing: print the summary and draw noise_matched.png")
    ap.set_defaults(runs=list(NOISE_COLUMN))
    args = ap.parse_args()
    if args.report:
        for row in summary(Path(args.results)):
            print(json.dumps(row))
        print(f"wrote {plot(Path(args.results))}")
        return
    args.dataset = "femnist"
    unknown = [r for r in args.runs if r not in NOISE_COLUMN]
    if unknown:
        ap.error(f"--runs must be among {list(NOISE_COLUMN)}, got {unknown}")
    if args.max_subjects:
        ap.error(f"--max-subjects must be 0 (all {REAL_WRITERS} writers: the matching is computed for them), "
                 f"got {args.max_subjects}")
    torch.set_num_threads(1)
    out = Path(args.results)
    for writers, seed, name in ((w, k, n) for w in args.writers for k in args.seeds for n in args.runs):
        args.noise_multiplier = matched_noise(out / "scale.csv", writers, name, args.match)
        detail = run_one(name, 1.0, args, seed)
        r = detail["row"]
        row = {"writers_matched": writers, "match": args.match, **{k: r[k] for k in FIELDS if k in r}}
        print(json.dumps(row), flush=True)
        write_row(out / "noise_matched.csv", row)
        split = "_val" if args.evaluate_on == "validation" else ""
        match = "" if args.match == "noise" else f"_{args.match}"
        path = (out / "runs" / "noise_matched" /
                f"{name}_w{writers}{match}{split}_lr{args.learning_rate:g}_seed{seed}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(detail | {"writers_matched": writers, "match": args.match},
                                   indent=1, default=float))


if __name__ == "__main__":
    main()
