"""Tune a joint-DP-paper cell's learning rates and clipping norm on a validation split,
never on test.

Each grid point is one Flower simulation of the project's apps
(:func:`research.reproduce_joint_dp.run_seed`, Ray backend), the same as a table
cell, except that ``validation-fraction`` carves a validation split out of every
owner's *training* records: the owners train on the rest, and the accuracy that is
reported, and used to choose, is on that validation split. The test split is not
read. The privacy schedule (noise multiplier, epsilon) is that of the smaller
training split, at the same target epsilon.

    python examples/joint_dp/tune.py --owners 256 --method joint-dp --trust local \\
        --learning-rates 0.02 0.05 0.1 0.2 --data-dir ../shared/data/fashion-mnist

``--clipping-norms 0.5 1 2`` adds the DP cells' clipping norm C to the grid (the
noise is z * C, so z is unchanged: C trades clipping bias against noise).
``--ema-decays 0.5 0.8`` adds the decay of the moving average the owners are
evaluated with (run-config ``ema-decay``; post-processing, z and epsilon unchanged).
``--records-per-user 10 --user-batch-sizes 3.2 32`` tunes a user-level cell (m/r
records per user) over the expected users per DP batch (run-config
``user-batch-size``; z is recalibrated to the same epsilon for each).
``--finetune-epochs 10 20 --finetune-learning-rates 0.02 0.05`` (joint DP) adds the
epochs and learning rate of the plain SGD, on all layers over each owner's own
training records, that adapts the owner's model before it is evaluated (run-config
``finetune-epochs``; the adapted copy is never sent, so z and epsilon are unchanged).
``--augment-shifts 0 2`` adds the pixels of random translation of the owners' own
non-private training batches (run-config ``augment-shift``; personal layers,
per-silo, FedAvg, adaptation; DP-SGD releases are not augmented, so z and epsilon
are unchanged).
The grid is the product of the learning rates, personal learning rates, clipping
norms, decays, user batches, adaptations and shifts.

``--validation-source pool`` takes the validation split from training-set records
that no owner holds (outside the 10,000 used), dealt to the owners as the test split
is; the owners then train on all their records, as in the cell being tuned. The
default, ``carve``, holds out part of each owner's records, which with ~20-40 records
per owner (n = 256, 512) leaves a held-out record's class rarer in the owner's
training split and so understates personal models (see
:mod:`flwr_jdp.data.partition`).

``--seed 1`` runs the grid on another seed (another split, initialisation and
validation carve-out); the seed is part of a point, so a finalist can be checked on
a second seed.

Appends one row per grid point to ``results/joint_dp/tuning.csv`` (points already
there are skipped) and prints the best point.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from flwr_jdp.data.partition import VALIDATION_SOURCES
from flwr_jdp.joint_dp.config import FINETUNE_LEARNING_RATE, MAX_AUGMENT_SHIFT, RELEASE_PERSONAL

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.reproduce_joint_dp import Cell, append_row, finetune_columns, run_seed  # noqa: E402
from research.reproduce_joint_dp import upgrade_table as upgrade_rows  # noqa: E402

COLUMNS = ("dataset", "owners", "method", "trust", "epsilon", "personal_layers", "coupling",
           "validation_fraction", "learning_rate", "personal_learning_rate", "noise_multiplier",
           "final_epsilon", "val_acc", "seconds", "clipping_norm", "ema_decay", "records_per_user",
           "user_batch_size", "finetune_epochs", "finetune_learning_rate", "seed", "augment_shift",
           "validation_source", "release_personal")


def _added_columns(r: dict[str, str]) -> dict[str, str]:
    """The columns a tuning table written before them lacks, at the value its runs
    used: the clipping norm of :data:`HPARAMS` (empty for a cell without DP), no
    moving average (``ema_decay`` 0), the record level (``records_per_user`` 1, so
    ``user_batch_size`` 0), no adaptation before evaluation (``finetune_epochs`` 0),
    seed 0 (the only seed tuned before the column), no augmentation (``augment_shift`` 0),
    a validation split carved from the owners' records (``validation_source`` carve),
    personal parameters at their seeded values in every release (``release_personal`` seeded)."""
    old = Cell(r["dataset"], int(r["owners"]), r["method"],
               r["trust"] if r["trust"] != "-" else "local",
               float(r["epsilon"]) if r["epsilon"] != "inf" else 1.0, 1, r["personal_layers"])
    return {"clipping_norm": f"{old.hparams['clipping-norm']:g}" if old.dp else "", "ema_decay": "0",
            "records_per_user": "1", "user_batch_size": "0", **finetune_columns(0, 0.0), "seed": "0",
            "augment_shift": "0", "validation_source": "carve", "release_personal": "seeded"}


def upgrade_table(table: Path) -> list[dict[str, str]]:
    """Rows of ``table``, rewritten first with any column of :data:`COLUMNS` it lacks
    (``_added_columns``)."""
    return upgrade_rows(table, COLUMNS, _added_columns)


def _seconds(res: dict, t0: float) -> float:
    """Wall seconds of a grid point: the recorded time of a reused finished run, else
    the time since ``t0``."""
    timing = res.get("timing") or {}
    return float(timing["seconds"]) if timing.get("reused") else time.time() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "mnist"))
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--owners", type=int, required=True)
    parser.add_argument("--method", choices=("per-silo", "fedavg", "full-dp", "joint-dp"), required=True)
    parser.add_argument("--trust", choices=("local", "central"), default="local")
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--personal", default="fc1")
    parser.add_argument("--learning-rates", type=float, nargs="+", required=True,
                        help="shared learning rates to try")
    parser.add_argument("--personal-learning-rates", type=float, nargs="*", default=[],
                        help="personal learning rates to try (default: the cell's)")
    parser.add_argument("--clipping-norms", type=float, nargs="*", default=[],
                        help="clipping norms C to try, DP cells only (default: the cell's)")
    parser.add_argument("--ema-decays", type=float, nargs="*", default=[],
                        help="moving-average decays of the evaluated shared model to try "
                        "(run-config ema-decay; default 0 = none)")
    parser.add_argument("--records-per-user", type=int, default=1,
                        help="m/r: > 1 tunes a user-level cell (the privacy unit is the user)")
    parser.add_argument("--user-batch-sizes", type=float, nargs="*", default=[],
                        help="expected users per DP batch to try, user-level DP cells only "
                        "(run-config user-batch-size; default 0 = batch-size / m/r)")
    parser.add_argument("--finetune-epochs", type=int, nargs="*", default=[],
                        help="adaptation epochs to try, joint-dp only (run-config finetune-epochs; "
                        "default 0 = none)")
    parser.add_argument("--finetune-learning-rates", type=float, nargs="*", default=[],
                        help=f"adaptation learning rates to try (default {FINETUNE_LEARNING_RATE:g})")
    parser.add_argument("--augment-shifts", type=int, nargs="*", default=[],
                        help="pixels of random translation of the owners' own training batches to try "
                        "(run-config augment-shift; default 0 = none)")
    parser.add_argument("--release-personals", nargs="*", default=[], choices=RELEASE_PERSONAL,
                        help="public values of the personal layers in each release to try, joint-dp "
                        "only (run-config release-personal; default seeded)")
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--validation-source", choices=VALIDATION_SOURCES, default="carve",
                        help="carve: --validation-fraction of each owner's training records; pool: "
                        "training-set records no owner holds, dealt like the test split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--supernodes", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "results" / "joint_dp"))
    args = parser.parse_args()
    if not 0 < args.validation_fraction < 1:
        parser.error("--validation-fraction must be in (0, 1): tuning never reads the test split")

    if args.records_per_user < 1:
        parser.error(f"--records-per-user must be >= 1, got {args.records_per_user}")
    cell = Cell(args.dataset, args.owners, args.method, args.trust, args.epsilon, args.records_per_user,
                args.personal)
    if args.user_batch_sizes and (not cell.dp or args.records_per_user == 1):
        parser.error("--user-batch-sizes applies to DP cells at the user level (--records-per-user > 1)")
    if any(not b >= 0 for b in args.user_batch_sizes):
        parser.error(f"--user-batch-sizes must be >= 0, got {args.user_batch_sizes}")
    if args.clipping_norms and not cell.dp:
        parser.error(f"--clipping-norms applies to DP cells only, not to {cell.method}")
    if any(c <= 0 for c in args.clipping_norms):
        parser.error(f"--clipping-norms must be > 0, got {args.clipping_norms}")
    if any(not 0 <= b < 1 for b in args.ema_decays):
        parser.error(f"--ema-decays must be in [0, 1), got {args.ema_decays}")
    if any(e < 0 for e in args.finetune_epochs):
        parser.error(f"--finetune-epochs must be >= 0, got {args.finetune_epochs}")
    if any(e > 0 for e in args.finetune_epochs) and cell.method != "joint-dp":
        parser.error("--finetune-epochs applies to joint-dp only")
    if any(not lr > 0 for lr in args.finetune_learning_rates):
        parser.error(f"--finetune-learning-rates must be > 0, got {args.finetune_learning_rates}")
    if any(not 0 <= k <= MAX_AUGMENT_SHIFT for k in args.augment_shifts):
        parser.error(f"--augment-shifts must be in [0, {MAX_AUGMENT_SHIFT}], got {args.augment_shifts}")
    base = cell.hparams
    personal_lrs = args.personal_learning_rates or [base["personal-learning-rate"]]
    clips = args.clipping_norms or ([base["clipping-norm"]] if cell.dp else [None])
    decays = args.ema_decays or [0.0]
    user_batches = args.user_batch_sizes or [0.0]
    shifts = args.augment_shifts or [0]
    releases = args.release_personals or ["seeded"]
    if releases != ["seeded"] and args.method != "joint-dp":
        parser.error("--release-personals applies to --method joint-dp only")
    # (epochs, rate) pairs; without adaptation the rate is unused, so one point
    adaptations = sorted({(e, lr if e else 0.0) for e in (args.finetune_epochs or [0])
                          for lr in (args.finetune_learning_rates or [FINETUNE_LEARNING_RATE])})
    mr = str(cell.records_per_user)
    table = Path(args.out) / "tuning.csv"
    work = Path(args.out) / "tuning_runs"
    rows = upgrade_table(table)
    for lr, plr, clip, decay, ub, (ft, ftlr), shift, release in itertools.product(
            args.learning_rates, personal_lrs, clips, decays, user_batches, adaptations, shifts, releases):
        ft_cols = finetune_columns(ft, ftlr)
        clip_txt = f"{clip:g}" if clip is not None else ""
        point = (f"lr={lr:g} personal lr={plr:g}" + (f" C={clip_txt}" if clip_txt else "")
                 + (f" ema-decay={decay:g}" if decay else "")
                 + (f" m/r={mr}" if mr != "1" else "") + (f" user-batch={ub:g}" if ub else "")
                 + (f" finetune={ft} epochs at {ftlr:g}" if ft else "")
                 + (f" augment-shift={shift}" if shift else "")
                 + (f" release-personal={release}" if release != "seeded" else ""))
        key = (cell.dataset, str(cell.owners), cell.method, cell.trust if cell.dp else "-",
               f"{cell.epsilon:g}" if cell.dp else "inf", cell.personal, f"{lr:g}", f"{plr:g}", clip_txt,
               f"{decay:g}", mr, f"{ub:g}", ft_cols["finetune_epochs"], ft_cols["finetune_learning_rate"],
               str(args.seed), str(shift), args.validation_source, release)
        if any((r["dataset"], r["owners"], r["method"], r["trust"], r["epsilon"], r["personal_layers"],
                r["learning_rate"], r["personal_learning_rate"], r["clipping_norm"],
                r.get("ema_decay") or "0", r.get("records_per_user") or "1",
                r.get("user_batch_size") or "0", r.get("finetune_epochs") or "0",
                r.get("finetune_learning_rate") or "-", r.get("seed") or "0",
                r.get("augment_shift") or "0", r.get("validation_source") or "carve",
                r.get("release_personal") or "seeded") == key for r in rows):
            print(f"skip {point} (in {table.name})", flush=True)
            continue
        extra = {"learning-rate": lr, "personal-learning-rate": plr}
        run_dir = f"lr{lr:g}-plr{plr:g}"
        if clip is not None and clip != base["clipping-norm"]:
            extra["clipping-norm"] = clip
            run_dir += f"-c{clip:g}"
        if decay:
            extra["ema-decay"] = decay
            run_dir += f"-ema{decay:g}"
        if ub:
            extra["user-batch-size"] = ub
            run_dir += f"-ub{ub:g}"
        if ft:
            extra.update({"finetune-epochs": ft, "finetune-learning-rate": ftlr})
            run_dir += f"-ft{ft}-ftlr{ftlr:g}"
        if shift:
            extra["augment-shift"] = shift
            run_dir += f"-aug{shift}"
        if release != "seeded":
            extra["release-personal"] = release
            run_dir += f"-rel{release}"
        if args.validation_source != "carve":
            run_dir += f"-val{args.validation_source}"
        t0 = time.time()
        res = run_seed(cell, args.seed, args.data_dir, work / run_dir, args.supernodes,
                       validation_fraction=args.validation_fraction,
                       validation_source=args.validation_source, extra=extra)
        if res.get("final_accuracy") is None:
            raise RuntimeError(f"{point}: no round completed (status {res.get('status')})")
        row = dict(zip(COLUMNS, (*key[:6], res["config"].get("personal-coupling", ""),
                                 args.validation_fraction, *key[6:8],
                                 res.get("noise_multiplier", 0.0),
                                 round(float(res.get("final_epsilon", 0.0)), 4),
                                 round(float(res["final_accuracy"]), 4),
                                 round(_seconds(res, t0), 1), clip_txt, *key[9:]), strict=True))
        append_row(table, row, COLUMNS)
        rows.append({k: str(v) for k, v in row.items()})
        print(f"{point}: validation accuracy {row['val_acc']:.4f} "
              f"(z {row['noise_multiplier']}, epsilon {row['final_epsilon']})", flush=True)
    mine = [r for r in rows if (r["dataset"], r["owners"], r["method"], r["trust"], r["personal_layers"])
            == (cell.dataset, str(cell.owners), cell.method, cell.trust if cell.dp else "-", cell.personal)
            and r["epsilon"] == (f"{cell.epsilon:g}" if cell.dp else "inf")
            and (r.get("records_per_user") or "1") == mr and (r.get("seed") or "0") == str(args.seed)
            and (r.get("validation_source") or "carve") == args.validation_source]
    best = max(mine, key=lambda r: float(r["val_acc"]))
    print(f"best on validation: lr={best['learning_rate']} personal lr={best['personal_learning_rate']}"
          + (f" C={best['clipping_norm']}" if best["clipping_norm"] else "")
          + (f" ema-decay={best['ema_decay']}" if best.get("ema_decay", "0") != "0" else "")
          + (f" user-batch={best['user_batch_size']}" if best.get("user_batch_size", "0") != "0" else "")
          + (f" finetune={best['finetune_epochs']} epochs at {best['finetune_learning_rate']}"
             if best.get("finetune_epochs", "0") != "0" else "")
          + (f" augment-shift={best['augment_shift']}" if best.get("augment_shift", "0") != "0" else "")
          + (f" release-personal={best['release_personal']}"
             if best.get("release_personal", "seeded") != "seeded" else "")
          + f" -> {float(best['val_acc']):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
