"""Draw Figure 1 and write the joint-DP tables as Markdown from the sweep's CSVs.

    python examples/joint_dp/report.py [--results results/joint_dp]

Reads ``table1.csv``, ``figure1.csv``, ``table2.csv``, ``table4.csv``,
``table1_interleaved.csv`` and ``tuning.csv`` (whichever exist) and writes ``figure1.png`` and ``tables.md`` beside them. Figure 1: mean
personalized test accuracy against epsilon for joint-DP and full-DP (error bars:
std over seeds), per-silo training as a dashed line, one panel per n.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flwr_jdp.reproduce.joint_dp import read_rows

ROOT = Path(__file__).resolve().parents[2]


def _fmt(row: dict[str, str]) -> str:
    return f"{float(row['acc_mean']):.4f} ± {float(row['acc_std']):.4f} ({row['seeds']})"


def table1(rows: list[dict[str, str]]) -> str:
    """Table 1: one line per (data set, n); cells 'mean ± std (seeds)'."""
    cols = [("per-silo", "-"), ("fedavg", "-"), ("full-dp", "local"), ("joint-dp", "local"),
            ("full-dp", "central"), ("joint-dp", "central")]
    head = ("| data set | n | per-silo | without DP (FedAvg) | full-DP ε=1 local | "
            "joint-DP ε=1 local | full-DP ε=1 central | joint-DP ε=1 central |")
    lines = [head, "|" + "---|" * 8]
    keys = sorted({(r["dataset"], int(r["owners"])) for r in rows})
    for ds, n in keys:
        cells = []
        for method, trust in cols:
            hit = [r for r in rows if r["dataset"] == ds and int(r["owners"]) == n
                   and r["method"] == method and r["trust"] == trust
                   and (trust == "-" or float(r["epsilon"]) == 1.0)]
            cells.append(_fmt(hit[-1]) if hit else "not run")
        lines.append(f"| {ds} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def generic(rows: list[dict[str, str]], keys: tuple[str, ...]) -> str:
    """A plain table of ``keys`` plus accuracy."""
    lines = ["| " + " | ".join(keys) + " | accuracy (seeds) |", "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + f" | {_fmt(r)} |")
    return "\n".join(lines)


def figure1(fig_rows: list[dict[str, str]], t1_rows: list[dict[str, str]], path: Path) -> bool:
    """Accuracy vs epsilon per n; returns False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({int(r["owners"]) for r in fig_rows})
    if not ns:
        return False
    fig, axes = plt.subplots(1, len(ns), figsize=(4 * len(ns), 3.4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=False):
        for method, color in (("joint-dp", "tab:blue"), ("full-dp", "tab:orange")):
            pts = sorted((float(r["epsilon"]), float(r["acc_mean"]), float(r["acc_std"]))
                         for r in fig_rows if int(r["owners"]) == n and r["method"] == method)
            if pts:
                eps, acc, std = zip(*pts, strict=False)
                ax.errorbar(eps, acc, yerr=std, marker="o", color=color, label=method, capsize=3)
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
    axes[0][0].legend(loc="lower right", fontsize=8)
    datasets = sorted({r["dataset"] for r in fig_rows})
    trusts = sorted({r["trust"] for r in fig_rows})
    fig.suptitle(f"Figure 1 ({', '.join(datasets)}; trust: {', '.join(trusts)}; delta = 1e-4)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "results" / "joint_dp"))
    args = parser.parse_args()
    res = Path(args.results)
    t1 = read_rows(res / "table1.csv")
    f1 = read_rows(res / "figure1.csv")
    t2 = read_rows(res / "table2.csv")
    t4 = read_rows(res / "table4.csv")
    parts = []
    if t1:
        parts += ["### Table 1 (ε = 1, δ = 1e-4)", table1(t1)]
    if f1:
        parts += ["### Figure 1 points", generic(f1, ("dataset", "owners", "method", "trust", "epsilon"))]
        figure1(f1, t1, res / "figure1.png")
    if t2:
        parts += ["### Table 2 (n = 128, ε = 1)", generic(t2, ("dataset", "method", "personal_layers", "trust"))]
    if t4:
        parts += ["### Table 4 (user level)", generic(t4, ("dataset", "owners", "method", "trust", "epsilon",
                                                           "records_per_user"))]
    inter = read_rows(res / "table1_interleaved.csv")
    if inter:
        parts += ["### Joint-DP with interleaved personal layers (the paper's Algorithm 1; "
                  "record-level guarantee not established, for comparison only)",
                  generic(inter, ("dataset", "owners", "method", "trust", "epsilon"))]
    tuning = read_rows(res / "tuning.csv")
    if tuning:
        keys = ("dataset", "owners", "method", "trust", "epsilon", "coupling", "validation_fraction",
                "learning_rate", "personal_learning_rate", "noise_multiplier", "final_epsilon")
        lines = ["| " + " | ".join(keys) + " | validation accuracy |", "|" + "---|" * (len(keys) + 1)]
        lines += ["| " + " | ".join(r.get(k, "") for k in keys) + f" | {float(r['val_acc']):.4f} |"
                  for r in tuning]
        parts += ["### Learning-rate tuning on validation splits (`tune.py`; test split not read)",
                  "\n".join(lines)]
    text = "\n\n".join(parts) + "\n"
    (res / "tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
