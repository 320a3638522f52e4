"""Driver for the joint-DP paper's sweeps (Table 1, Figure 1, Table 2, Table 4).

Every cell is one call of ``python -m research.reproduce_joint_dp`` (the same code,
:func:`research.reproduce_joint_dp.run_cell`): Flower simulations of the project's
ServerApp/ClientApp, one per seed, appending a row to a CSV. Cells already in the
CSV are skipped, so an interrupted sweep continues where it stopped.

    python examples/joint_dp/sweep.py --table 1 --data-dir ../shared/data/fashion-mnist
    python examples/joint_dp/sweep.py --table figure1 --owners 256 --quick
    python examples/joint_dp/sweep.py --table 2 --dataset mnist --data-dir ../shared/data/mnist
    python examples/joint_dp/sweep.py --table 4 --owners 256 --trust central --quick

Then ``python examples/joint_dp/report.py`` draws Figure 1 and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.reproduce_joint_dp import Cell, read_rows, run_cell  # noqa: E402

ALL_OWNERS = (4, 16, 64, 128, 256, 512)
TABLE4_OWNERS = (4, 256)
EPSILONS = (1.0, 2.0, 5.0, 10.0, 100.0)


def cells(table: str, dataset: str, owners: list[int], trusts: list[str]) -> list[tuple[str, Cell]]:
    """(csv name, cell) of one table, in the order they run."""
    out: list[tuple[str, Cell]] = []
    if table == "1":
        for n in owners:
            out.append(("table1.csv", Cell(dataset, n, "per-silo")))
            out.append(("table1.csv", Cell(dataset, n, "fedavg")))
            for trust in trusts:
                out.append(("table1.csv", Cell(dataset, n, "full-dp", trust, 1.0)))
                out.append(("table1.csv", Cell(dataset, n, "joint-dp", trust, 1.0)))
    elif table == "figure1":
        for n in owners:
            for eps in EPSILONS:
                for method in ("joint-dp", "full-dp"):
                    out.append(("figure1.csv", Cell(dataset, n, method, trusts[0], eps)))
    elif table == "2":
        for rule in ("none", "conv1", "conv2", "conv1+conv2", "fc1", "conv1+fc1", "conv2+fc1",
                     "conv1+conv2+fc1"):
            method = "full-dp" if rule == "none" else "joint-dp"
            out.append(("table2.csv", Cell(dataset, 128, method, trusts[0], 1.0, 1, rule)))
    elif table == "4":
        for n in owners:
            out.append(("table4.csv", Cell(dataset, n, "per-silo")))
            out.append(("table4.csv", Cell(dataset, n, "fedavg")))
            for mr in (1, 2, 5, 10, 20):
                out.append(("table4.csv", Cell(dataset, n, "full-dp", trusts[0], 1.0, mr)))
                for eps in (1.0, 3.0, 8.0):
                    out.append(("table4.csv", Cell(dataset, n, "joint-dp", trusts[0], eps, mr)))
            for mr in (1, 2, 5, 10, 20):  # beyond the paper's table: full-DP at epsilon 3 and 8
                for eps in (3.0, 8.0):
                    out.append(("table4.csv", Cell(dataset, n, "full-dp", trusts[0], eps, mr)))
    else:
        raise ValueError(f"unknown table {table!r}")
    return out


def done(rows: list[dict[str, str]], cell: Cell, seeds: int = 1) -> bool:
    """True if ``cell`` already has a row over at least ``seeds`` seeds (a row with
    fewer is rerun: finished seeds are reused, the missing ones run)."""
    for r in rows:
        if int(r.get("seeds") or 1) < seeds:
            continue
        if (r["dataset"], int(r["owners"]), r["method"]) != (cell.dataset, cell.owners, cell.method):
            continue
        if int(r.get("records_per_user") or 1) != cell.records_per_user:
            continue
        if cell.method == "joint-dp" and r.get("personal_layers", "fc1") != cell.personal:
            continue
        if cell.method == "joint-dp" and (r.get("coupling") or "decoupled") != cell.coupling:
            continue
        if cell.dp and (r["trust"] != cell.trust or float(r["epsilon"]) != cell.epsilon):
            continue
        return True
    return False


def existing_rows(out: Path, csv_name: str, cell: Cell) -> list[dict[str, str]]:
    """Rows that may already hold ``cell``: its table's and, for Table 4's per-silo
    and FedAvg cells (no DP, so independent of m/r), Table 1's as well."""
    rows = read_rows(out / csv_name)
    if csv_name == "table4.csv" and not cell.dp:
        rows += read_rows(out / "table1.csv")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=("1", "figure1", "2", "4"), required=True)
    parser.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "mnist"))
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--owners", type=int, nargs="+", default=None,
                        help="default: every n of Table 1 (Figure 1, Table 1); 4 and 256 (Table 4)")
    parser.add_argument("--trust", nargs="+", default=["local", "central"], choices=("local", "central"))
    parser.add_argument("--seeds", type=int, default=0,
                        help="seeds per cell (default: 1 for n < 64, 3 for n >= 64)")
    parser.add_argument("--quick", action="store_true", help="one seed per cell")
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "results" / "joint_dp"))
    args = parser.parse_args()

    owners = args.owners or list(TABLE4_OWNERS if args.table == "4" else ALL_OWNERS)
    plan = cells(args.table, args.dataset, owners, args.trust)
    print(f"{len(plan)} cells", flush=True)
    for csv_name, cell in plan:
        seeds = 1 if args.quick else (args.seeds or (3 if cell.owners >= 64 else 1))
        if done(existing_rows(Path(args.out), csv_name, cell), cell, seeds):
            print(f"skip {cell.name} (in {csv_name} with >= {seeds} seeds)", flush=True)
            continue
        row = run_cell(cell, seeds, args.data_dir, args.out, supernodes=args.supernodes, table=csv_name)
        print(f"{csv_name}: {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
