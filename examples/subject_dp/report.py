"""Plots and the README table of the subject-level runs (FEMNIST or Shakespeare).

    python examples/subject_dp/report.py [--dataset shakespeare]

Reads ``results/subject_dp/<dataset>.csv`` and ``runs/*.json`` (written by
``femnist.py`` / ``shakespeare.py``; without a ``runs/`` folder, from the committed
``runs.tar.gz``) and draws, beside them (Shakespeare files
are prefixed ``shakespeare_``):

- ``accuracy_rounds.png``: test accuracy over rounds of every run at alpha = 1 (seed 0);
- ``batch_histograms.png``: per batch, the largest number of records of one
  subject (group size Z) and the number of distinct subjects (paper Figure 2 c, d);
- ``alpha_sweep.png``: final accuracy against alpha per run, when several alphas ran;
- ``alpha_sweep_chosen.png`` (FEMNIST): the same at the learning rate (and, for
  subject sampling, the batch) chosen on validation at each alpha, from the choice
  files below, one line per method whatever its rate;
- ``batch_choice.csv`` (FEMNIST): for subject-sampled HiGradAvgDP, the subject batch
  chosen at each alpha by validation accuracy (mean over the validation seeds every
  batch ran, one learning rate), and the test accuracy of the chosen batch;
- ``learning_rate_choice.csv`` (FEMNIST): then, at the chosen batch, the learning rate
  chosen at each alpha by validation accuracy, and its test accuracy;
- ``method_learning_rate_choice.csv`` (FEMNIST): for every other run (FedAvg,
  LocalItemDP, LocalGroupDP, UserLDP, record-sampled HiGradAvgDP), the learning rate
  chosen by validation accuracy (a seed-0 screen, then the rates re-run on more seeds
  compared by their mean) at each alpha where two or more of its rates were validated
  (every run at alpha = 1; some at other alphas), and its test accuracy there; where a
  run was tested at an alpha but not searched there, alpha = 1's rate carried over
  (``chosen_at_alpha`` 1, no screen).

and prints the markdown table of the test-set rows, mean +- std over seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.results_csv import write_csv  # noqa: E402
from research.runs_archive import runs_folder  # noqa: E402

TITLES = {"femnist": "FEMNIST, 300 writers as subjects", "shakespeare": "Tiny Shakespeare, 134 characters as subjects"}


def _dataset(doc: dict) -> str:
    """The data set of a run file: its ``dataset`` key, else its run config's (some early
    Shakespeare validation files have only the latter), else FEMNIST (the first runs
    predate both keys and are all FEMNIST)."""
    return doc.get("dataset") or (doc.get("run_config") or {}).get("dataset") or "femnist"


def load_runs(folder: Path, dataset: str) -> dict[tuple[str, float, float], dict]:
    """(run, alpha, learning rate) -> the seed-0 test run of ``dataset``."""
    runs = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        row = doc["row"]
        if (_dataset(doc) == dataset and row["evaluate_on"] == "test"
                and int(row.get("seed") or 0) == 0):
            runs[(row["run"], float(row["alpha"]), float(row["learning_rate"]))] = doc
    return runs


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (run, alpha, learning rate): acc_final as mean (+- std over seeds)."""
    groups: dict[tuple[str, float, float], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["run"], float(r["alpha"]), float(r["learning_rate"])), []).append(r)
    out = []
    for group in groups.values():
        accs = [float(r["acc_final"]) for r in group]
        row = dict(group[0], seeds=len(accs), acc_mean=statistics.fmean(accs),
                   acc_std=statistics.stdev(accs) if len(accs) > 1 else 0.0)
        row["acc_final"] = (f"{row['acc_mean']:.4f} +- {row['acc_std']:.4f}" if len(accs) > 1
                            else f"{row['acc_mean']:.4f}")
        out.append(row)
    return out


def plot_accuracy(runs: dict, out: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # more runs than the default 10 colours
    several = {n for n, a, _ in runs if a == 1.0 and sum(k[:2] == (n, a) for k in runs) > 1}
    for (name, alpha, lr), doc in sorted(runs.items()):
        if alpha != 1.0:
            continue
        hist = [(h["round"], h["accuracy"]) for h in doc["history"] if "accuracy" in h]
        r, a = zip(*hist)
        row = doc["row"]
        claimed = row["method"] == "local-group-dp" and row["accounting"] != "exact"  # data-dependent sigma_Z
        eps = row["epsilon"] if row["method"] != "fedavg" and not claimed else None
        noise = "sigma_Z per batch" if claimed else f"z={float(row['noise_multiplier']):.3g}"
        label = f"{name} ({noise}" + (f", eps={float(eps):.3g}" if eps else "")
        label += f", lr={lr:g})" if name in several else ")"
        ax.plot(r, a, marker=".", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{title}, 16 silos, alpha = 1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_histograms(runs: dict, out: Path, title: str) -> None:
    """Batch statistics depend on the sampling only, not on the learning rate."""
    doc = next((d for k, d in sorted(runs.items()) if k[:2] == ("higradavg-exact", 1.0)),
               next(iter(runs.values())))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "group_size_histogram", "largest records of one subject per batch (Z)"),
                           (axes[1], "distinct_subjects_histogram", "distinct subjects per batch")):
        h = {int(k): v for k, v in doc[key].items()}
        ax.bar(list(h), list(h.values()), width=1.0)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("batches")
    fig.suptitle(f"{title}: batches of run {doc['row']['run']} (alpha = {doc['row']['alpha']}, "
                 f"batch 256, 16 silos)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def alpha_series(rows: list[dict]) -> dict[str, list[tuple[float, float, float]]]:
    """One (alpha, mean accuracy, std over seeds) series per run and learning rate,
    never mixing rates; a series needs at least two alphas."""
    by_run: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        label = r.get("label") or f"{r['run']} (lr {float(r['learning_rate']):g})"
        by_run.setdefault(label, []).append((float(r["alpha"]), float(r["acc_mean"]),
                                             float(r.get("acc_std") or 0.0)))
    return {k: sorted(v) for k, v in by_run.items() if len({p[0] for p in v}) > 1}


def plot_alpha(rows: list[dict], out: Path) -> bool:
    """Final accuracy against alpha (error bars: std over seeds where several ran);
    False (nothing drawn) when no run has two alphas."""
    by_run = alpha_series(rows)
    if not by_run:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours; marker and dash tell repeats apart
    markers, dashes = "osD^v", ("-", "--")
    for i, (name, pts) in enumerate(by_run.items()):
        alphas, means, stds = zip(*pts)
        ax.errorbar(alphas, means, yerr=stds, marker=markers[i % len(markers)], capsize=3, label=name,
                    color=colours[(2 * i + i // 10) % len(colours)], linestyle=dashes[(i // 10) % 2])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("alpha (power-law silo assignment)")
    ax.set_ylabel("final test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the axes: no line hidden
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


SUBJECT_SAMPLING = "higradavg-subject-sampling"


def chosen_rows(methods: list[dict], rates: list[dict]) -> list[dict]:
    """Rows for :func:`plot_alpha` at the settings chosen on validation at each alpha:
    ``method_learning_rate_choice.csv`` rows (one rate per run and alpha) and
    ``learning_rate_choice.csv`` rows (subject sampling, batch then rate per alpha), each
    with its test mean and std; choices never run on test are left out. A method rate
    carried from alpha = 1 (:func:`carried_choices`) counts as chosen. The label
    names the method, not the rate, so one line may join several rates."""
    out = []
    for r in methods:
        if int(r["test_seeds"] or 0):
            out.append({"label": f"{r['run']} (rate chosen on validation)", "run": r["run"], "alpha": r["alpha"],
                        "learning_rate": r["learning_rate"], "acc_mean": r["test_mean"], "acc_std": r["test_std"]})
    for r in rates:
        if int(r["test_seeds"] or 0):
            out.append({"label": f"{SUBJECT_SAMPLING} (batch and rate chosen per alpha)", "run": r["run"],
                        "alpha": r["alpha"], "learning_rate": r["learning_rate"], "acc_mean": r["test_mean"],
                        "acc_std": r["test_std"]})
    return out


def _test_summary(accs: list[float]) -> dict:
    """The test accuracy of a chosen run: seeds, mean and sample std (blank when none ran)."""
    return {"test_seeds": len(accs),
            "test_mean": round(statistics.fmean(accs), 4) if accs else "",
            "test_std": round(statistics.stdev(accs), 4) if len(accs) > 1 else ("" if not accs else 0.0)}


def _validation_scores(by_candidate: dict) -> tuple[dict, list[int]]:
    """Each candidate's mean validation accuracy over the seeds that *every* candidate
    ran (so no candidate gains from a luckier or extra seed), and those seeds.
    ``by_candidate`` maps candidate -> {seed: run row}."""
    seeds = sorted(set.intersection(*(set(runs) for runs in by_candidate.values())))
    if not seeds:
        return {}, []
    scores = {c: statistics.fmean(float(runs[k]["acc_final"]) for k in seeds) for c, runs in by_candidate.items()}
    return scores, seeds


def batch_choice(docs: list[dict], family: str = SUBJECT_SAMPLING, learning_rate: float = 0.1) -> list[dict]:
    """Per alpha, the subject batch (``run_config["batch-size"]``) of the ``family`` run
    with the best *validation* accuracy at ``learning_rate`` (mean over the validation
    seeds every batch ran), and the test accuracy (mean +- std over seeds) of that run
    at that alpha. Test accuracy plays no part in the choice; a tie goes to the larger
    batch (where every silo holds fewer subjects than both batches, both run the same
    mechanism, q = 1). Alphas with fewer than two validated batches, or no validation
    seed common to them, are left out (nothing was chosen there)."""
    val: dict[float, dict[int, dict[int, dict]]] = {}
    test: dict[tuple[str, float], list[float]] = {}
    for doc in docs:
        row = doc["row"]
        if not (row["run"].startswith(family) and abs(float(row["learning_rate"]) - learning_rate) < 1e-12):
            continue
        alpha = float(row["alpha"])
        if row["evaluate_on"] == "validation":
            batch = int(doc["run_config"]["batch-size"])
            val.setdefault(alpha, {}).setdefault(batch, {})[int(row.get("seed") or 0)] = row
        elif row["evaluate_on"] == "test":
            test.setdefault((row["run"], alpha), []).append(float(row["acc_final"]))
    out = []
    for alpha, by_batch in sorted(val.items()):
        if len(by_batch) < 2:
            continue
        score, seeds = _validation_scores(by_batch)
        if not seeds:
            continue
        batch = max(score, key=lambda b: (score[b], b))  # tie: the larger batch
        chosen = by_batch[batch][seeds[0]]
        accs = test.get((chosen["run"], alpha), [])
        out.append({
            "alpha": alpha, "learning_rate": learning_rate,
            "validation": " ".join(f"{b}:{score[b]:.4f}" for b in sorted(score)),
            "validation_seeds": len(seeds), "batch": batch, "run": chosen["run"], "noise_multiplier": chosen["noise_multiplier"],
            **_test_summary(accs),
        })
    return out


def learning_rate_choice(docs: list[dict], batch_rows: list[dict]) -> list[dict]:
    """The second stage, after ``batch_choice``: per alpha, at the chosen subject batch
    (the chosen run), the learning rate with the best *validation* accuracy (mean over
    the validation seeds every rate ran), and the test accuracy (mean +- std over
    seeds) of that run at that rate. Test accuracy plays no part in the choice; a tie
    goes to the rate the batch was chosen at. Alphas where only one rate was validated
    at the chosen batch, or no validation seed is common to the rates, are left out."""
    val: dict[float, dict[float, dict[int, dict]]] = {}
    test: dict[tuple[str, float, float], list[float]] = {}
    chosen = {r["alpha"]: r for r in batch_rows}
    for doc in docs:
        row = doc["row"]
        alpha, lr = float(row["alpha"]), float(row["learning_rate"])
        if alpha not in chosen or row["run"] != chosen[alpha]["run"]:
            continue
        if row["evaluate_on"] == "validation":
            val.setdefault(alpha, {}).setdefault(lr, {})[int(row.get("seed") or 0)] = row
        elif row["evaluate_on"] == "test":
            test.setdefault((row["run"], alpha, lr), []).append(float(row["acc_final"]))
    out = []
    for alpha, by_lr in sorted(val.items()):
        if len(by_lr) < 2:
            continue
        score, seeds = _validation_scores(by_lr)
        if not seeds:
            continue
        base = float(chosen[alpha]["learning_rate"])
        lr = max(score, key=lambda x: (score[x], x == base))  # tie: the stage-one rate
        run = chosen[alpha]["run"]
        accs = test.get((run, alpha, lr), [])
        out.append({
            "alpha": alpha, "batch": chosen[alpha]["batch"], "run": run,
            "validation": " ".join(f"{x:g}:{score[x]:.4f}" for x in sorted(score)),
            "validation_seeds": len(seeds),
            "learning_rate": lr, "noise_multiplier": by_lr[lr][seeds[0]]["noise_multiplier"],
            **_test_summary(accs),
        })
    return out


def method_rate_choice(docs: list[dict], alpha: float = 1.0) -> list[dict]:
    """Per run other than the subject-sampled family (whose batch and rate are chosen
    per alpha above), the learning rate with the best *validation* accuracy at
    ``alpha``, and the test accuracy (mean +- std over seeds) of that run at that rate.

    Two stages, as the runs were made: ``screen`` is every rate's validation accuracy on
    seed 0; the *finalists* are the rates validated on the most seeds (every rate when
    each ran one seed), compared by their mean over the seeds every finalist ran
    (``finalists``, ``validation_seeds``). Test accuracy plays no part in the choice; an
    exact tie goes to the rate the test runs used, then to the smaller rate. Runs with fewer than two validated
    rates at ``alpha`` are left out."""
    val: dict[str, dict[float, dict[int, dict]]] = {}
    test: dict[tuple[str, float], list[float]] = {}
    for doc in docs:
        row = doc["row"]
        if row["run"].startswith(SUBJECT_SAMPLING) or abs(float(row["alpha"]) - alpha) > 1e-12:
            continue
        lr = float(row["learning_rate"])
        if row["evaluate_on"] == "validation":
            val.setdefault(row["run"], {}).setdefault(lr, {})[int(row.get("seed") or 0)] = row
        elif row["evaluate_on"] == "test":
            test.setdefault((row["run"], lr), []).append(float(row["acc_final"]))
    out = []
    for run, by_lr in sorted(val.items()):
        if len(by_lr) < 2:
            continue
        most = max(len(seeds) for seeds in by_lr.values())
        finalists = {lr: seeds for lr, seeds in by_lr.items() if len(seeds) == most}
        if len(finalists) < 2:  # one rate re-run: the screen decides
            finalists = by_lr
        score, seeds = _validation_scores(finalists)
        if not seeds:
            continue
        lr = max(score, key=lambda x: (score[x], (run, x) in test, -x))  # tie: the tested rate, then the smaller
        out.append({
            "run": run, "alpha": alpha,
            "screen": " ".join(f"{x:g}:{float(s[0]['acc_final']):.4f}" for x, s in sorted(by_lr.items()) if 0 in s),
            "finalists": " ".join(f"{x:g}:{score[x]:.4f}" for x in sorted(score)),
            "validation_seeds": len(seeds), "learning_rate": lr,
            "noise_multiplier": finalists[lr][seeds[0]]["noise_multiplier"],
            **_test_summary(test.get((run, lr), [])),
        })
    return out


def carried_choices(docs: list[dict], methods: list[dict], source: float = 1.0) -> list[dict]:
    """Rows for the alphas where a run was tested but not searched: the rate chosen at
    ``source`` (alpha = 1, where every run was searched) carried over, with the test
    accuracy of that run at that rate there. ``chosen_at_alpha`` says where the rate was
    chosen; the screen and finalists are blank, because nothing was validated at this
    alpha. Alphas with a choice of their own (in ``methods``) are left alone."""
    chosen = {r["run"]: r for r in methods if r["alpha"] == source}
    own = {(r["run"], r["alpha"]) for r in methods}
    test: dict[tuple[str, float], list[dict]] = {}
    for doc in docs:
        row = doc["row"]
        run, alpha = row["run"], float(row["alpha"])
        if row["evaluate_on"] != "test" or run not in chosen or (run, alpha) in own:
            continue
        if float(row["learning_rate"]) == chosen[run]["learning_rate"]:
            test.setdefault((run, alpha), []).append(row)
    out = []
    for (run, alpha), rows in sorted(test.items()):
        out.append({"run": run, "alpha": alpha, "screen": "", "finalists": "", "validation_seeds": 0,
                    "learning_rate": chosen[run]["learning_rate"], "noise_multiplier": rows[0]["noise_multiplier"],
                    **_test_summary([float(r["acc_final"]) for r in rows]), "chosen_at_alpha": source})
    return out


def write_choices(folder: Path, out_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """``batch_choice.csv``, ``learning_rate_choice.csv`` and
    ``method_learning_rate_choice.csv`` from the FEMNIST run files."""
    docs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    docs = [d for d in docs if _dataset(d) == "femnist" and "run_config" in d]
    batches = batch_choice(docs)
    rates = learning_rate_choice(docs, batches)
    alphas = sorted({float(d["row"]["alpha"]) for d in docs if d["row"]["evaluate_on"] == "validation"})
    methods = [{**row, "chosen_at_alpha": alpha} for alpha in alphas for row in method_rate_choice(docs, alpha)]
    methods = sorted(methods + carried_choices(docs, methods), key=lambda r: (r["alpha"], r["run"]))
    write_csv(out_dir / "batch_choice.csv", batches)
    write_csv(out_dir / "learning_rate_choice.csv", rates)
    write_csv(out_dir / "method_learning_rate_choice.csv", methods)
    return batches, rates, methods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "results" / "subject_dp"))
    ap.add_argument("--dataset", choices=list(TITLES), default="femnist")
    args = ap.parse_args()
    folder = Path(args.results)
    prefix = "" if args.dataset == "femnist" else f"{args.dataset}_"
    rows = aggregate([r for r in csv.DictReader((folder / f"{args.dataset}.csv").open())
                      if r["evaluate_on"] == "test"])
    run_dir = runs_folder(folder)  # folder/runs, or the same folder from folder/runs.tar.gz
    runs = load_runs(run_dir, args.dataset)
    plot_accuracy(runs, folder / f"{prefix}accuracy_rounds.png", TITLES[args.dataset])
    plot_histograms(runs, folder / f"{prefix}batch_histograms.png", TITLES[args.dataset])
    plot_alpha(rows, folder / f"{prefix}alpha_sweep.png")
    choice, rates, methods = write_choices(run_dir, folder) if args.dataset == "femnist" else ([], [], [])
    if methods:
        plot_alpha(chosen_rows(methods, rates), folder / "alpha_sweep_chosen.png")
    cols = ["run", "alpha", "accounting", "inclusion", "rounds", "noise_multiplier", "epsilon", "unit",
            "learning_rate", "seeds", "acc_final"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in sorted(rows, key=lambda r: (float(r["alpha"]), r["run"])):
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print("\nper-batch group size Z (largest records of one subject): mean, max")
    seen = set()
    for (name, alpha, _), doc in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        hist = {int(k): v for k, v in doc["group_size_histogram"].items()}
        if hist and (name, alpha) not in seen:  # the same sampling at every learning rate
            seen.add((name, alpha))
            mean = sum(k * v for k, v in hist.items()) / sum(hist.values())
            print(f"  {name} alpha={alpha:g}: {mean:.1f}, {max(hist)}")
    if choice:
        print("\nsubject batch chosen on validation (batch_choice.csv)")
        for r in choice:
            print(f"  alpha={r['alpha']:g}: validation ({r['validation_seeds']} seeds) {r['validation']} -> batch {r['batch']} (z {r['noise_multiplier']}), "
                  f"test {r['test_mean']} +- {r['test_std']} ({r['test_seeds']} seeds)")
    if rates:
        print("\nlearning rate chosen on validation at the chosen batch (learning_rate_choice.csv)")
        for r in rates:
            print(f"  alpha={r['alpha']:g} batch {r['batch']}: validation ({r['validation_seeds']} seeds) {r['validation']} -> lr {r['learning_rate']:g}, "
                  f"test {r['test_mean']} +- {r['test_std']} ({r['test_seeds']} seeds)")
    if methods:
        print("\nlearning rate of the other runs chosen on validation per alpha (method_learning_rate_choice.csv)")
        for r in methods:
            how = (f"seed-0 screen {r['screen']}; finalists ({r['validation_seeds']} seeds) {r['finalists']}"
                   if r["chosen_at_alpha"] == r["alpha"] else f"not searched, alpha={r['chosen_at_alpha']:g}'s choice")
            print(f"  {r['run']} alpha={r['alpha']:g}: {how} -> lr {r['learning_rate']:g}, test {r['test_mean']} +- "
                  f"{r['test_std']} ({r['test_seeds']} seeds)")


if __name__ == "__main__":
    main()
