"""Draw Figure 1 and write the joint-DP tables as Markdown from the sweep's CSVs.

    python examples/joint_dp/report.py [--results results/joint_dp]

Reads ``table1.csv``, ``figure1.csv``, ``table2.csv``, ``table4.csv``,
``table1_personal.csv``, ``table1_interleaved.csv``, ``tuning.csv`` and ``memory_*.csv`` (from
``simulation_memory.py``; whichever exist) and the per-run ``results.json`` under ``runs/`` (or, without
that folder, from the committed ``runs.tar.gz``), and writes ``figure1.png`` and ``tables.md`` beside them. Figure 1: mean
personalized test accuracy against epsilon for joint-DP and full-DP (error bars:
std over seeds), per-silo training as a dashed line, one panel per n; local-noise curves solid,
central-noise curves dotted. Table 1's epsilon = 1 cells are points of the curves.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from flwr_jdp.joint_dp.config import FINETUNE_LEARNING_RATE

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.reproduce_joint_dp import (  # noqa: E402
    PERSONAL_RULES,
    Cell,
    hparams_for,
    personal_parameter_count,
    read_rows,
    shared_parameter_count,
)
from research.runs_archive import runs_folder  # noqa: E402


def _fmt(row: dict[str, str]) -> str:
    return f"{float(row['acc_mean']):.4f} ± {float(row['acc_std']):.4f} ({row['seeds']})"


def table1(rows: list[dict[str, str]]) -> str:
    """Table 1: one line per (data set, n); cells 'mean ± std (seeds)'."""
    cols = [("per-silo", "-"), ("fedavg", "-"), ("full-dp", "local"), ("joint-dp", "local"),
            ("full-dp", "central"), ("joint-dp", "central"), ("joint-dp", "distributed")]
    head = ("| data set | n | per-silo | without DP (FedAvg) | full-DP ε=1 local | "
            "joint-DP ε=1 local | full-DP ε=1 central | joint-DP ε=1 central | joint-DP ε=1 distributed |")
    lines = [head, "|" + "---|" * 9]
    keys = sorted({(r["dataset"], int(r["owners"])) for r in rows})
    for ds, n in keys:
        cells = []
        for method, trust in cols:
            hit = [r for r in rows if r["dataset"] == ds and int(r["owners"]) == n
                   and r["method"] == method and r["trust"] == trust
                   and (trust == "-" or float(r["epsilon"]) == 1.0)
                   and (method != "joint-dp" or _rule(r) == "fc1") and not _overridden(r)]
            cells.append(_fmt(hit[-1]) if hit else "not run")
        lines.append(f"| {ds} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chosen_rate_table(rows: list[dict[str, str]]) -> str:
    """Table 1 cells (FC1 personal) run at a shared learning rate chosen on
    validation (``learning_rate`` set in ``table1.csv``), beside the same cell at the
    :data:`HPARAMS` rate; the latest row of each."""
    lines = ["| n | method | trust | ε | learning rate | accuracy at it | HPARAMS rate | accuracy at HPARAMS rate |",
             "|---|---|---|---|---|---|---|---|"]
    picked = [r for r in rows if cell_of(r).lr and _rule(r) == "fc1"]
    for key in sorted({(int(r["owners"]), r["method"], r["trust"], float(r["epsilon"]), cell_of(r).lr)
                       for r in picked}):
        n, method, trust, eps, lr = key
        same = [r for r in rows if (int(r["owners"]), r["method"], r["trust"], float(r["epsilon"])) == key[:4]
                and _rule(r) == "fc1"]
        chosen = [r for r in same if cell_of(r).lr == lr]
        base = [r for r in same if not _overridden(r)]
        default_lr = hparams_for(method, trust)["learning-rate"]
        lines.append(f"| {n} | {method} | {trust} | {eps:g} | {lr:g} | {_fmt(chosen[-1])} | {default_lr:g} | "
                     + (_fmt(base[-1]) if base else "not run") + " |")
    return "\n".join(lines)


def _rule(row: dict[str, str]) -> str:
    """The personal-layer rule of a row (rows written before the column existed: FC1)."""
    return row.get("personal_layers") or "fc1"


def _overridden(row: dict[str, str]) -> bool:
    """True for a row run with a validation-chosen learning rate, personal learning
    rate, moving average, user batch or adaptation before evaluation (not a Table 1 cell)."""
    cell = cell_of(row)
    return bool(cell.lr or cell.personal_lr or cell.ema_decay or cell.user_batch or cell.finetune_epochs
                or cell.augment or cell.release != "seeded")


def _settings(row: dict[str, str]) -> tuple[str, float, float, float, int, float, int, str]:
    """(personal rule, personal learning rate, shared learning rate, EMA decay, adaptation
    epochs and rate, augmentation shift, public personal values of the release) of a row;
    rows written before those columns existed ran at the HPARAMS learning rates, no EMA,
    no adaptation, no augmentation, seeded personal values in the release."""
    cell = cell_of(row)
    return (cell.personal, cell.personal_learning_rate, cell.learning_rate, cell.ema_decay, cell.finetune_epochs,
            cell.finetune_lr, cell.augment, cell.release)


def _finetune_text(epochs: int, lr: float) -> str:
    return f"{epochs} epochs at {lr:g}" if epochs else "none"


def personal_rule_table(rows: list[dict[str, str]], t1_rows: list[dict[str, str]],
                        runs: Path | None = None) -> str:
    """Joint DP at epsilon = 1 with settings chosen on validation
    (``table1_personal.csv``): a personal-layer rule other than Table 1's FC1, a
    personal or shared learning rate, a moving average of the evaluated shared model, an
    adaptation of each owner's evaluated model to its own records, a random translation
    of the owners' own training images, public personal values other than the seeded ones in
    the release (shown after the rule: "release with zero-head"). One line per (n, trust, settings), beside Table
    1's FC1 cell of the same n and trust, Table 1's per-silo cell and per-silo with the
    same translation (a per-silo row of ``rows``; Table 1's without translation); the
    latest row of each wins. With ``runs``, the last column is these settings minus
    per-silo with the same translation, paired by seed (``paired_difference``)."""
    lines = ["| n | trust | personal | shared params | personal lr | shared lr | EMA decay | adapted after the last round "
             "| translation (pixels) | joint DP, these settings "
             "| joint DP, FC1 personal (Table 1) | per-silo (Table 1) | per-silo, same translation "
             "| these settings − per-silo (same translation), paired by seed |",
             "|" + "---|" * 14]
    silo = [r for r in rows if r["method"] == "per-silo"]
    rows = [r for r in rows if r["method"] == "joint-dp" and float(r["epsilon"]) == 1.0]
    t1_fc1 = [r for r in t1_rows if float(r["epsilon"]) == 1.0 and _rule(r) == "fc1"]
    for n, trust, settings in sorted({(int(r["owners"]), r["trust"], _settings(r)) for r in rows}):
        rule, plr, lr, decay, ft, ftlr, shift, release = settings
        cells = [_latest([r for r in rows if _settings(r) == settings], owners=str(n), trust=trust),
                 _latest(t1_fc1, owners=str(n), method="joint-dp", trust=trust),
                 _latest(t1_rows, owners=str(n), method="per-silo")]
        same = (_latest([r for r in silo if cell_of(r).augment == shift], owners=str(n)) if shift
                else cells[2])
        paired = paired_difference(runs, cells[0], same) if runs and cells[0] and same else ""
        shown = rule if release == "seeded" else f"{rule}, release with {release}"
        lines.append(f"| {n} | {trust} | {shown} | {shared_parameter_count(rule):,} | {plr:g} | {lr:g} | {decay:g} | "
                     f"{_finetune_text(ft, ftlr)} | {shift} | "
                     + " | ".join(_fmt(c) if c else "not run" for c in [*cells, same]) + f" | {paired} |")
    return "\n".join(lines)


def seed_accuracies(runs: Path, row: dict[str, str]) -> dict[int, float]:
    """Final accuracy of each completed seed of ``row``'s cell that the row averages
    (seeds 0 .. seeds - 1), read from the runs' results.json."""
    out = {}
    for seed in range(int(row["seeds"])):
        f = runs / cell_of(row).name / f"seed{seed}" / "results.json"
        if f.is_file():
            res = json.loads(f.read_text())
            if res.get("status") == "completed" and res.get("final_accuracy") is not None:
                out[seed] = float(res["final_accuracy"])
    return out


def paired_difference(runs: Path, a: dict[str, str], b: dict[str, str]) -> str:
    """Accuracy of ``a`` minus ``b`` paired by seed, as "mean ± std (k of m above)".

    Pairing is sound because a run's seed fixes its data: the N-record subset, the
    owners' classes and their train and test splits depend on the seed, n and the data
    settings every cell shares, not on the method (``flwr_jdp.joint_dp.seed_model.owner_data``), so seed s of both cells sees the same owners. Only seeds that both
    rows average are paired; an empty string when there is none."""
    acc_a, acc_b = seed_accuracies(runs, a), seed_accuracies(runs, b)
    diffs = [acc_a[s] - acc_b[s] for s in sorted(acc_a.keys() & acc_b.keys())]
    if not diffs:
        return ""
    std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    above = sum(d > 0 for d in diffs)
    return f"{statistics.mean(diffs):+.4f} ± {std:.4f} ({above} of {len(diffs)} seeds above)"


def cell_of(row: dict[str, str]) -> Cell:
    """The cell a table row was produced by."""
    dp = row["method"] in ("full-dp", "joint-dp")
    return Cell(row["dataset"], int(row["owners"]), row["method"], row["trust"] if dp else "local",
                float(row["epsilon"]) if dp else 1.0, int(row.get("records_per_user") or 1),
                row.get("personal_layers") or "fc1",
                (row.get("coupling") or "decoupled") if row["method"] == "joint-dp" else "decoupled",
                lr=float(row.get("learning_rate") or 0.0),
                personal_lr=float(row.get("personal_learning_rate") or 0.0),
                ema_decay=float(row.get("ema_decay") or 0.0),
                user_batch=float(row.get("user_batch_size") or 0.0),
                finetune_epochs=int(row.get("finetune_epochs") or 0),
                finetune_lr=float(ftlr) if (ftlr := row.get("finetune_learning_rate") or "-") != "-"
                else FINETUNE_LEARNING_RATE, augment=int(row.get("augment_shift") or 0),
                release=row.get("release_personal") or "seeded")


def run_seconds(runs: Path, cell: Cell) -> list[float]:
    """Wall seconds of each finished seed of ``cell`` (from its results.json)."""
    base = runs / cell.name
    files = sorted(base.glob("seed*/results.json")) or sorted(base.glob("results.json"))
    out = []
    for f in files:
        res = json.loads(f.read_text())
        if res.get("status") == "completed" and res.get("wall_seconds"):
            out.append(float(res["wall_seconds"]))
    return out


def timing(rows: list[dict[str, str]], runs: Path) -> str:
    """Wall time of one seed of every Table 1 cell and of a whole row (one seed
    per cell), and seconds per client-round (wall / (owners x rounds))."""
    lines = ["| n | method | trust | seeds timed | s per run | s per client-round |", "|---|---|---|---|---|---|"]
    totals: dict[int, float] = {}
    seen = set()
    for r in sorted(rows, key=lambda r: (int(r["owners"]), r["method"], r["trust"])):
        cell = cell_of(r)
        if (cell.name in seen or cell.records_per_user != 1 or (cell.dp and cell.epsilon != 1.0)
                or _overridden(r)):
            continue
        seen.add(cell.name)
        secs = run_seconds(runs, cell)
        if not secs:
            continue
        mean = sum(secs) / len(secs)
        per = mean / (cell.owners * int(r["rounds"] or 1))
        totals[cell.owners] = totals.get(cell.owners, 0.0) + mean
        lines.append(f"| {cell.owners} | {cell.method} | {r['trust']} | {len(secs)} | {mean:.0f} | {per:.3f} |")
    lines += [""] + [f"Row n = {n} (one seed of each cell run): {t:.0f} s ({t / 60:.1f} min)"
                     for n, t in sorted(totals.items())]
    return "\n".join(lines)


def memory(samples: list[dict[str, str]]) -> str:
    """Peak summed PSS of the simulation's processes per cell (``simulation_memory.py``
    samples, labelled with the cell running when they were taken), and that peak
    divided by the number of owners: an upper bound on memory per owner, since it
    includes Ray's and Flower's fixed cost. Samples taken before the sampler recorded
    m/r and the personal layers (or with those options left at their defaults) count
    as m/r = 1 and, for joint DP, FC1 personal."""
    peaks: dict[tuple[int, str, str, float, int, str], tuple[float, int]] = {}
    for r in samples:
        if not r.get("owners"):
            continue  # between two cells
        dp = r["method"] in ("full-dp", "joint-dp")  # the others ignore --trust and --epsilon
        personal = (r.get("personal") or Cell.personal) if r["method"] == "joint-dp" else "-"
        # epsilon as a number: "1" and "1.0" are one cell, and 10 sorts after 2
        key = (int(r["owners"]), r["method"], r["trust"] if dp else "-",
               float(r["epsilon"] or Cell.epsilon) if dp else math.inf,
               int(r.get("records_per_user") or 1), personal)
        peak, count = peaks.get(key, (0.0, 0))
        peaks[key] = (max(peak, float(r["pss_mib"])), count + 1)
    lines = ["| n | method | trust | ε | m/r | personal | samples | peak PSS (MiB) | peak / owner (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (n, method, trust, eps, mr, personal), (peak, count) in sorted(peaks.items()):
        shown = f"{eps:g}" if math.isfinite(eps) else "-"
        lines.append(f"| {n} | {method} | {trust} | {shown} | {mr} | {personal} | {count} | {peak:.0f} "
                     f"| {peak / n:.2f} |")
    return "\n".join(lines)


def generic(rows: list[dict[str, str]], keys: tuple[str, ...]) -> str:
    """A plain table of ``keys`` plus accuracy."""
    lines = ["| " + " | ".join(keys) + " | accuracy (seeds) |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + f" | {_fmt(r)} |")
    return "\n".join(lines)


def table2(rows: list[dict[str, str]]) -> str:
    """Table 2 in the paper's layout: which of Conv1, Conv2, FC1 are personal (FC2 is
    always shared), how many parameters that keeps personal, and the accuracy under
    each trust model run (the latest row of each rule and trust wins). The rule
    ``none`` is full DP (every parameter shared)."""
    trusts = [t for t in ("local", "central") if any(r["trust"] == t for r in rows)]
    head = "| Conv1 | Conv2 | FC1 | personal params | " + " | ".join(f"accuracy, {t} noise" for t in trusts) + " |"
    lines = [head, "|" + "---|" * (4 + len(trusts))]
    for rule in PERSONAL_RULES:
        parts = rule.split("+")
        if "fc2" in parts or "norms" in parts:  # beyond the paper's table (FC2 shared, no norms)
            continue
        cells = []
        for trust in trusts:
            hit = [r for r in rows if r["trust"] == trust and (r.get("personal_layers") or "fc1") == rule]
            cells.append(_fmt(hit[-1]) if hit else "not run")
        if all(c == "not run" for c in cells):
            continue
        flags = ["YES" if layer in parts else "No" for layer in ("conv1", "conv2", "fc1")]
        lines.append("| " + " | ".join(flags) + f" | {personal_parameter_count(rule):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Table 4's DP columns: (method, epsilon), as in the paper, then full-DP at epsilon = 3 and 8
#: (not in the paper's table; the issue asks joint-DP >= full-DP at every epsilon <= 10).
TABLE4_COLUMNS = (("full-dp", 1.0), ("joint-dp", 1.0), ("joint-dp", 3.0), ("joint-dp", 8.0),
                  ("full-dp", 3.0), ("full-dp", 8.0))


def table4(rows: list[dict[str, str]], baselines: list[dict[str, str]] = ()) -> str:
    """Table 4 in the paper's layout: one block per (data set, n, trust model), one
    line per m/r (records per user: the privacy unit is the user), columns per-silo
    and FedAvg (no DP, so independent of m/r: shown on the block's first line),
    full-DP at epsilon = 1 and joint-DP at epsilon = 1, 3, 8 (then full-DP at 3 and 8,
    beyond the paper's table). The latest row of a
    cell wins. Per-silo and FedAvg are taken from ``baselines`` (Table 1's rows: the
    same cells) where ``rows`` has none, and so is a DP cell at m/r = 1 (record level:
    Table 1's cell at epsilon = 1, FC1 personal, marked "T1"). A DP accuracy above per-silo's is in bold
    (the paper underlines it). Rows run with a user batch chosen on validation
    (``user_batch_size`` > 0) or a shared learning rate chosen on validation (``learning_rate``
    other than HPARAMS') form their own block, its trust column naming the batch and the rate."""
    head = ("| data set | n | trust | m/r | per-silo | without DP (FedAvg) | full-DP ε=1 | "
            "joint-DP ε=1 | joint-DP ε=3 | joint-DP ε=8 | full-DP ε=3 | full-DP ε=8 |")
    lines = [head, "|" + "---|" * 12]
    dp_rows = [r for r in rows if r["method"] in ("full-dp", "joint-dp")]
    for ds, n, trust, ub, lr in sorted({(r["dataset"], int(r["owners"]), r["trust"], _user_batch(r),
                                         _chosen_lr(r)) for r in dp_rows}):
        everything = [r for r in rows if r["dataset"] == ds and int(r["owners"]) == n]
        block = [r for r in everything if _user_batch(r) == ub and _chosen_lr(r) == lr]
        base = [r for r in baselines if r["dataset"] == ds and int(r["owners"]) == n]
        silo = _latest(everything, method="per-silo") or _latest(base, method="per-silo")
        fed = _latest(everything, method="fedavg") or _latest(base, method="fedavg")
        mrs = {_mr(r) for r in dp_rows if r in block and r["trust"] == trust}
        if not ub and not lr and any(float(r["epsilon"]) == 1.0 and _figure_point(r, n, m, trust)
                          for r in base for m in ("full-dp", "joint-dp")):
            mrs.add(1)
        label = trust + (f", {ub:g} users/batch" if ub else "") + (f", lr {lr:g}" if lr else "")
        mrs = sorted(mrs)
        for i, mr in enumerate(mrs):
            cells = ["", ""] if i else [_fmt(silo) if silo else "not run", _fmt(fed) if fed else "not run"]
            for method, eps in TABLE4_COLUMNS:
                hit = _latest([r for r in block if float(r["epsilon"]) == eps and _mr(r) == mr],
                              method=method, trust=trust)
                mark = ""
                if not hit and mr == 1 and not ub and not lr:  # record level at epsilon = 1: Table 1's own cell
                    hit = _latest([r for r in base if float(r["epsilon"]) == eps and _mr(r) == 1
                                   and _figure_point(r, n, method, trust)])
                    mark = " T1" if hit else ""
                if not hit:
                    cells.append("not run")
                elif silo and float(hit["acc_mean"]) > float(silo["acc_mean"]):
                    cells.append(f"**{_fmt(hit)}**{mark}")
                else:
                    cells.append(_fmt(hit) + mark)
            lines.append(f"| {ds} | {n} | {label} | {mr} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _user_batch(row: dict[str, str]) -> float:
    """Users per DP batch a row's runs were given (0: the default, batch / m/r)."""
    return float(row.get("user_batch_size") or 0.0)


def _chosen_lr(row: dict[str, str]) -> float:
    """Shared learning rate a row's runs were given, if chosen on validation (0: HPARAMS')."""
    return cell_of(row).lr


def _mr(row: dict[str, str]) -> int:
    """Records per user of a row (1: record level)."""
    return int(row.get("records_per_user") or 1)


def _latest(rows: list[dict[str, str]], **match: str) -> dict[str, str] | None:
    """The last of ``rows`` whose fields equal ``match`` (None if there is none)."""
    hit = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return hit[-1] if hit else None


#: Figure 1 curves: (method, trust) -> (colour, line style).
_CURVES = {("joint-dp", "local"): ("tab:blue", "-"), ("full-dp", "local"): ("tab:orange", "-"),
           ("joint-dp", "central"): ("tab:blue", ":"), ("full-dp", "central"): ("tab:orange", ":")}


def _figure_point(r: dict[str, str], n: int, method: str, trust: str) -> bool:
    """True if row ``r`` is a Figure 1 point of this curve: record level, FC1
    personal, decoupled, HPARAMS settings (Table 1 rows at epsilon = 1 count too)."""
    return (int(r["owners"]) == n and r["method"] == method and r["trust"] == trust
            and int(r.get("records_per_user") or 1) == 1 and r.get("personal_layers", "fc1") == "fc1"
            and (r.get("coupling") or "decoupled") in ("decoupled", "-") and not _overridden(r))


def figure1_points(fig_rows: list[dict[str, str]], t1_rows: list[dict[str, str]],
                   runs: Path | None = None) -> str:
    """Figure 1's points as a table: one line per (n, trust, epsilon) with joint DP and
    full DP side by side and their difference, sorted by n, trust and epsilon. Table 1's
    epsilon = 1 rows count too (marked "T1"); the latest row of a point wins. With
    ``runs``, a last column gives joint DP minus per-silo paired by seed
    (``paired_difference``: a one-seed point pairs with per-silo's seed 0)."""
    rows = t1_rows + fig_rows
    lines = ["| n | trust | ε | joint DP | full DP | joint − full | per-silo "
             "| joint − per-silo, paired by seed |", "|" + "---|" * 8]
    keys = sorted({(int(r["owners"]), r["trust"], float(r["epsilon"])) for r in fig_rows})
    for n, trust in sorted({(n, t) for n, t, _ in keys}):
        eps = sorted({float(r["epsilon"]) for r in rows for m in ("joint-dp", "full-dp")
                      if _figure_point(r, n, m, trust)})
        silo = [r for r in rows if int(r["owners"]) == n and r["method"] == "per-silo"]
        silo_txt = f"{float(silo[-1]['acc_mean']):.4f}" if silo else "not run"
        for e in eps:
            got = {}
            for m in ("joint-dp", "full-dp"):
                hit = [(r, r in t1_rows) for r in rows
                       if _figure_point(r, n, m, trust) and float(r["epsilon"]) == e]
                got[m] = hit[-1] if hit else None
            cells = [(_fmt(r) + (" T1" if from_t1 else "")) if r else "not run"
                     for r, from_t1 in (got[m] or (None, False) for m in ("joint-dp", "full-dp"))]
            diff = (f"{float(got['joint-dp'][0]['acc_mean']) - float(got['full-dp'][0]['acc_mean']):+.4f}"
                    if got["joint-dp"] and got["full-dp"] else "")
            paired = (paired_difference(runs, got["joint-dp"][0], silo[-1])
                      if runs and got["joint-dp"] and silo else "")
            lines.append(f"| {n} | {trust} | {e:g} | {cells[0]} | {cells[1]} | {diff} | {silo_txt} | {paired} |")
    return "\n".join(lines)


def _rates_only(r: dict[str, str]) -> bool:
    """True if row ``r`` is a Figure 1 cell (record level, FC1 personal, decoupled)
    whose only departures from :data:`HPARAMS` are learning rates chosen on validation."""
    cell = cell_of(r)
    return (cell.records_per_user == 1 and cell.personal == "fc1" and cell.coupling == "decoupled"
            and not (cell.ema_decay or cell.user_batch or cell.finetune_epochs or cell.augment
                     or cell.release != "seeded"))


def _at_rates_chosen(r: dict[str, str]) -> bool:
    """True if row ``r`` is a Figure 1 cell run at learning rates chosen on validation."""
    return _overridden(r) and _rates_only(r)


def _rates_text(r: dict[str, str]) -> str:
    cell = cell_of(r)
    rates = f"lr {cell.learning_rate:g}" + (f", plr {cell.personal_learning_rate:g}" if cell.method == "joint-dp" else "")
    return rates + ("" if _overridden(r) else ", HPARAMS")


def _at_chosen_rates(rows: list[dict[str, str]], n: int, trust: str, method: str, epsilon: float,
                     fallback: bool = True) -> dict[str, str] | None:
    """The latest of ``rows`` for this point run at learning rates chosen on
    validation; with ``fallback``, else its latest HPARAMS row (None if neither)."""
    same = [r for r in rows if int(r["owners"]) == n and r["trust"] == trust and r["method"] == method
            and float(r["epsilon"]) == epsilon and _rates_only(r)]
    chosen = [r for r in same if _at_rates_chosen(r)] or (same if fallback else [])
    return chosen[-1] if chosen else None


def validated_rate_points(fig_rows: list[dict[str, str]], t1_rows: list[dict[str, str]],
                          rule_rows: list[dict[str, str]] = (), runs: Path | None = None) -> str:
    """Figure 1 points run at learning rates chosen on validation: one line per
    (n, trust, epsilon) where ``figure1.csv`` has such a row, joint DP and full DP side
    by side with their rates, their difference and, with ``runs``, joint DP minus
    full DP paired by seed. Each method's point is its latest row at chosen rates
    (``table1.csv`` and ``table1_personal.csv`` give epsilon = 1, marked "T1"), or
    its HPARAMS row where it has none (a method whose validation kept HPARAMS' rates)."""
    t1_like = list(t1_rows) + list(rule_rows)
    rows = t1_like + list(fig_rows)
    keys = sorted({(int(r["owners"]), r["trust"]) for r in fig_rows if _at_rates_chosen(r)})
    lines = ["| n | trust | ε | joint DP (rates) | full DP (rates) | joint − full | joint − full, paired by seed |",
             "|" + "---|" * 7]
    for n, trust in keys:
        eps = sorted({float(r["epsilon"]) for r in rows if int(r["owners"]) == n and r["trust"] == trust
                      and r["method"] in ("joint-dp", "full-dp") and _at_rates_chosen(r)})
        for e in eps:
            got = {m: _at_chosen_rates(rows, n, trust, m, e) for m in ("joint-dp", "full-dp")}
            cells = [f"{_fmt(r)}{' T1' if any(r is t for t in t1_like) else ''}, {_rates_text(r)}" if r else "not run"
                     for r in (got["joint-dp"], got["full-dp"])]
            both = got["joint-dp"] and got["full-dp"]
            diff = f"{float(got['joint-dp']['acc_mean']) - float(got['full-dp']['acc_mean']):+.4f}" if both else ""
            paired = paired_difference(runs, got["joint-dp"], got["full-dp"]) if runs and both else ""
            lines.append(f"| {n} | {trust} | {e:g} | {cells[0]} | {cells[1]} | {diff} | {paired} |")
    return "\n".join(lines)


def legend_handles(axes) -> dict[str, object]:
    """One handle per label over all panels, in first-drawn order, so the single
    legend names every curve even when the first panel lacks some of them."""
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    return handles


def figure1(fig_rows: list[dict[str, str]], t1_rows: list[dict[str, str]], path: Path,
            rule_rows: list[dict[str, str]] = ()) -> bool:
    """Accuracy vs epsilon per n; returns False when there is nothing to draw. Where
    ``figure1.csv`` has points at learning rates chosen on validation, their curve is
    drawn dash-dotted beside the HPARAMS one (epsilon = 1 from ``table1.csv`` or
    ``rule_rows``, the rows of ``table1_personal.csv``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({int(r["owners"]) for r in fig_rows})
    if not ns:
        return False
    fig, axes = plt.subplots(1, len(ns), figsize=(max(5.5, 4 * len(ns)), 3.6), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=False):
        for (method, trust), (color, style) in _CURVES.items():
            pts = sorted({float(r["epsilon"]): (float(r["acc_mean"]), float(r["acc_std"]))
                          for r in t1_rows + fig_rows
                          if _figure_point(r, n, method, trust)}.items())
            if pts and any(_figure_point(r, n, method, trust) for r in fig_rows):
                eps = [e for e, _ in pts]
                ax.errorbar(eps, [a for _, (a, _) in pts], yerr=[s for _, (_, s) in pts],
                            marker="o" if trust == "local" else "s",
                            color=color, ls=style, label=f"{method} ({trust})", capsize=3)
        for (method, trust), (color, _) in _CURVES.items():
            if not any(int(r["owners"]) == n and r["method"] == method and r["trust"] == trust
                       and _at_rates_chosen(r) for r in fig_rows):
                continue
            rows = list(t1_rows) + list(rule_rows) + list(fig_rows)
            chosen = [r for e in sorted({float(r["epsilon"]) for r in rows})
                      if (r := _at_chosen_rates(rows, n, trust, method, e, fallback=False))]
            ax.errorbar([float(r["epsilon"]) for r in chosen], [float(r["acc_mean"]) for r in chosen],
                        yerr=[float(r["acc_std"]) for r in chosen], marker="^", color=color, ls="-.",
                        label=f"{method} ({trust}, rates chosen on validation)", capsize=3)
        silo = [float(r["acc_mean"]) for r in t1_rows + fig_rows
                if int(r["owners"]) == n and r["method"] == "per-silo"]
        if silo:
            ax.axhline(silo[-1], ls="--", color="gray", label="per-silo")
        ax.set_xscale("log")
        ax.set_title(f"n = {n}")
        ax.set_xlabel("epsilon")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean personalized test accuracy")
    handles = legend_handles(axes[0])
    axes[0][0].legend(list(handles.values()), list(handles), loc="lower right", fontsize=8)
    datasets = sorted({r["dataset"] for r in fig_rows})
    trusts = sorted({r["trust"] for r in fig_rows})
    fig.suptitle(f"Figure 1 ({', '.join(datasets)}; trust: {', '.join(trusts)}; delta = 1e-4)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


#: Values an empty tuning-table cell stands for (rows from before the column existed).
_TUNING_DEFAULTS = {"ema_decay": "0", "records_per_user": "1", "user_batch_size": "0", "finetune_epochs": "0",
                    "finetune_learning_rate": "-", "seed": "0", "augment_shift": "0", "validation_source": "carve",
                    "release_personal": "seeded"}


def tuning_table(rows: list[dict[str, str]]) -> str:
    """One line per ``tuning.csv`` row, with the parameters its DP noise covers: the
    rule's shared parameters for joint DP, every parameter for the other methods (whose
    rows still carry the cell's default ``personal_layers``)."""
    keys = ("dataset", "owners", "method", "trust", "epsilon", "personal_layers", "coupling",
            "validation_fraction", "validation_source",
            "learning_rate", "personal_learning_rate", "clipping_norm", "ema_decay", "records_per_user",
            "user_batch_size", "finetune_epochs", "finetune_learning_rate", "augment_shift", "release_personal",
            "noise_multiplier",
            "final_epsilon", "seed")
    lines = ["| " + " | ".join(keys) + " | shared params | validation accuracy |", "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        shared = shared_parameter_count(r["personal_layers"] if r["method"] == "joint-dp" else "none")
        lines.append("| " + " | ".join(r.get(k) or _TUNING_DEFAULTS.get(k, "") for k in keys)
                     + f" | {shared:,} | {float(r['val_acc']):.4f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "results" / "joint_dp"))
    args = parser.parse_args()
    res = Path(args.results)
    t1 = read_rows(res / "table1.csv")
    f1 = read_rows(res / "figure1.csv")
    t2 = read_rows(res / "table2.csv")
    t4 = read_rows(res / "table4.csv")
    rule_rows = read_rows(res / "table1_personal.csv")
    runs = runs_folder(res)  # res/runs, or the same folder from res/runs.tar.gz
    parts = []
    if t1:
        parts += ["### Table 1 (ε = 1, δ = 1e-4)", table1(t1),
                  "### Wall time of the Table 1 cells (2-core CPU, Flower Ray simulation, 2 SuperNodes)",
                  timing(t1, runs)]
        if any(cell_of(r).lr for r in t1):
            parts += ["### Table 1 cells at a shared learning rate chosen on validation (`tune.py`; "
                      "beside the same cell at the HPARAMS rate)", chosen_rate_table(t1)]
    if f1:
        parts += ["### Figure 1 points (record level, FC1 personal; T1: the Table 1 cell at ε = 1)",
                  figure1_points(f1, t1, runs)]
        figure1(f1, t1, res / "figure1.png", rule_rows)
        if any(_at_rates_chosen(r) for r in f1):
            parts += ["### Figure 1 points at learning rates chosen on validation (record level, FC1 personal; "
                      "T1: the ε = 1 cell of `table1.csv` or `table1_personal.csv`)",
                      validated_rate_points(f1, t1, rule_rows, runs)]
    if t2:
        parts += ["### Table 2 (which layers are personal; n = 128, ε = 1, δ = 1e-4; FC2 always shared)",
                  table2(t2)]
    if t4:
        parts += ["### Table 4 (user level: m/r records per user, δ = 1e-4; bold: above per-silo)",
                  table4(t4, t1)]
    samples = [r for f in sorted(res.glob("memory_*.csv")) for r in read_rows(f)]
    if samples:
        parts += ["### Memory of the simulation (summed PSS of Ray's and Flower's processes, "
                  "sampled every few seconds by `simulation_memory.py`)", memory(samples)]
    if rule_rows:
        parts += ["### Joint DP with settings chosen on validation (more layers personal, personal "
                  "learning rate, moving average, adaptation to the owner's records, translated training images; ε = 1, δ = 1e-4; "
                  "`tuning.csv`)",
                  personal_rule_table(rule_rows, t1, runs)]
    inter = read_rows(res / "table1_interleaved.csv")
    if inter:
        parts += ["### Joint-DP with interleaved personal layers (the paper's Algorithm 1; "
                  "record-level guarantee not established, for comparison only)",
                  generic(inter, ("dataset", "owners", "method", "trust", "epsilon"))]
    tuning = read_rows(res / "tuning.csv")
    if tuning:
        parts += ["### Learning-rate, clipping-norm and personal-layer tuning on validation splits (`tune.py`; test split not read)",
                  tuning_table(tuning)]
    text = "\n\n".join(parts) + "\n"
    (res / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
