"""``flwr-jdp``: privacy computations from the shell.

    flwr-jdp epsilon   --noise-multiplier Z --sample-rate Q --steps T --delta D [--accountant pld|rdp]
    flwr-jdp calibrate --epsilon E --delta D --sample-rate Q --steps T [--accountant pld|rdp]
    flwr-jdp reproduce joint-dp --dataset fashion-mnist --data-dir DIR --owners N \
        --method joint-dp --epsilon E --seeds K --trust local --out DIR

Both describe DP-SGD: ``T`` Poisson-sampled (rate ``Q``) Gaussian releases with noise
multiplier ``Z`` under add/remove neighbouring, as TF-Privacy's
``compute_dp_sgd_privacy``. The last line printed is the number alone.

``reproduce joint-dp`` runs one cell of the joint-DP paper's tables as Flower
simulations (one per seed) and appends a row to ``OUT/table.csv``.
"""

from __future__ import annotations

import argparse
import sys

from .config import FINETUNE_LEARNING_RATE, RELEASE_PERSONAL
from .data.partition import VALIDATION_SOURCES
from .privacy import events as ev
from .privacy.accountants import ACCOUNTANTS, epsilon
from .privacy.calibration import calibrate, pld_grid


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _delta(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flwr-jdp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--sample-rate", type=_rate, required=True, help="Poisson sampling rate q in (0, 1]")
        p.add_argument("--steps", type=_positive(int), required=True, help="number of noisy steps T")
        p.add_argument("--delta", type=_delta, required=True, help="delta in (0, 1)")
        p.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                       help="pld (dp-accounting's privacy-loss distributions, default) or rdp")

    p_eps = sub.add_parser("epsilon", help="epsilon of DP-SGD")
    p_eps.add_argument("--noise-multiplier", type=_positive(float), required=True,
                       help="Gaussian noise std divided by the clipping norm (z > 0)")
    common(p_eps)
    p_cal = sub.add_parser("calibrate", help="smallest noise multiplier reaching an epsilon")
    p_cal.add_argument("--epsilon", type=_positive(float), required=True,
                       help="target epsilon (> 0) the whole run must stay within")
    common(p_cal)

    p_rep = sub.add_parser("reproduce", help="run one cell of a paper's experiments")
    papers = p_rep.add_subparsers(dest="paper", required=True)
    jdp = papers.add_parser("joint-dp", help="joint-DP across data owners (Tables 1, 2, 4)")
    jdp.add_argument("--dataset", choices=("fashion-mnist", "mnist", "digits"), default="fashion-mnist",
                     help="data set of the owners")
    jdp.add_argument("--data-dir", default="", help="folder with the four IDX .gz files "
                     "(empty: Hugging Face through flwr-datasets)")
    jdp.add_argument("--owners", type=_positive(int), required=True, help="number of owners n")
    jdp.add_argument("--method", choices=("per-silo", "fedavg", "full-dp", "joint-dp"), required=True,
                     help="the method of the table's row")
    jdp.add_argument("--epsilon", type=_positive(float), default=1.0, help="target epsilon of each run")
    jdp.add_argument("--seeds", type=_positive(int), default=3, help="seeds (runs) per cell")
    jdp.add_argument("--quick", action="store_true", help="one seed")
    jdp.add_argument("--trust", choices=("local", "central"), default="local",
                     help="noise placement: local (owners noise) or central (trusted server)")
    jdp.add_argument("--records-per-user", type=_positive(int), default=1, help="m/r (user unit if > 1)")
    jdp.add_argument("--personal", default="fc1", help="personal layers: fc1, conv1, conv2, "
                     "conv1+fc1, conv2+fc1, conv1+conv2, conv1+conv2+fc1 (the paper's Table 2), "
                     "fc1+fc2, conv1+fc1+fc2 (both heads personal)")
    jdp.add_argument("--coupling", choices=("decoupled", "interleaved"), default="decoupled",
                     help="joint-dp personal layers: decoupled from the shared release (DP holds) or "
                     "interleaved (the paper's Algorithm 1; record-level guarantee not established)")
    jdp.add_argument("--learning-rate", type=_positive(float), default=None,
                     help="learning rate of the shared parameters (default: the method's; choose it "
                     "on validation with examples/joint_dp/tune.py --learning-rates)")
    jdp.add_argument("--personal-learning-rate", type=_positive(float), default=None,
                     help="personal learning rate (default: the method's; choose it on validation "
                     "with examples/joint_dp/tune.py)")
    jdp.add_argument("--ema-decay", type=float, default=0.0,
                     help="in [0, 1): evaluate the owners on a moving average of the shared model "
                     "(post-processing, no privacy cost); 0 = the last aggregate")
    jdp.add_argument("--user-batch-size", type=float, default=0.0,
                     help="user level (--records-per-user > 1): expected users per DP batch "
                     "(default 0: as many users as fill the method's batch of records; choose it on "
                     "validation with examples/joint_dp/tune.py --user-batch-sizes)")
    jdp.add_argument("--finetune-epochs", type=int, default=0,
                     help="joint-dp: epochs of plain SGD on all layers over the owner's own records that "
                     "adapt each owner's model after the last round, before it is evaluated (never "
                     "sent, no privacy cost; 0 = none)")
    jdp.add_argument("--finetune-learning-rate", type=float, default=FINETUNE_LEARNING_RATE,
                     help="learning rate of that adaptation")
    jdp.add_argument("--augment-shift", type=int, default=0,
                     help="pixels of random translation of the owners' own non-private training "
                     "batches (personal layers, per-silo, FedAvg, adaptation; DP-SGD releases are not "
                     "augmented, so no privacy cost); choose it on validation with "
                     "examples/joint_dp/tune.py --augment-shifts; 0 = none")
    jdp.add_argument("--release-personal", choices=RELEASE_PERSONAL, default="seeded",
                     help="joint-dp, decoupled: the public values of the personal layers in the model "
                     "each release is computed on (seeded initialisation, or the personal head at "
                     "zero); a constant either way, so the release is the same DP-SGD")
    jdp.add_argument("--supernodes", type=_positive(int), default=2,
                     help="simulated SuperNodes; the owners are spread over them")
    jdp.add_argument("--local-epochs", type=_positive(int), default=None, help="default: paper Table 3")
    jdp.add_argument("--rounds", type=_positive(int), default=None, help="default: paper Table 3")
    jdp.add_argument("--validation-fraction", type=float, default=0.0,
                     help="> 0: evaluate on a validation split of the training data (tuning)")
    jdp.add_argument("--validation-source", choices=VALIDATION_SOURCES, default="carve",
                     help="carve: part of each owner's training records; pool: training-set records "
                     "outside the 10,000 used, dealt like the test split (owners train on all theirs)")
    jdp.add_argument("--table", default="table.csv", help="CSV file name inside --out")
    jdp.add_argument("--ray-address", default=None,
                     help="run on an existing Ray cluster (ray start --head ...), e.g. 127.0.0.1:6379")
    jdp.add_argument("--out", required=True, help="results folder (rows appended to OUT/TABLE)")
    return parser


def _reproduce(args: argparse.Namespace) -> int:
    from .reproduce.joint_dp import Cell, run_cell

    try:
        cell = Cell(args.dataset, args.owners, args.method, args.trust, args.epsilon,
                    args.records_per_user, args.personal, args.coupling,
                    lr=args.learning_rate or 0.0,
                    personal_lr=args.personal_learning_rate or 0.0, ema_decay=args.ema_decay,
                    user_batch=args.user_batch_size, finetune_epochs=args.finetune_epochs,
                    finetune_lr=args.finetune_learning_rate, augment=args.augment_shift,
                    release=args.release_personal)
    except ValueError as err:
        print(f"flwr-jdp reproduce: {err}", file=sys.stderr)
        return 2
    row = run_cell(cell, 1 if args.quick else args.seeds, args.data_dir, args.out,
                   supernodes=args.supernodes, table=args.table, ray_address=args.ray_address,
                   local_epochs=args.local_epochs, rounds=args.rounds,
                   validation_fraction=args.validation_fraction,
                   validation_source=args.validation_source)
    print(", ".join(f"{k}={v}" for k, v in row.items()))
    print(f"{row['acc_mean']:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "reproduce":
        return _reproduce(args)
    q, steps, delta, acc = args.sample_rate, args.steps, args.delta, args.accountant
    if args.command == "epsilon":
        eps = epsilon(ev.dp_sgd(args.noise_multiplier, q, steps), delta, acc)
        print(f"DP-SGD with noise multiplier {args.noise_multiplier}, sample rate {q}, "
              f"{steps} steps satisfies ({eps:.6g}, {delta:g})-DP ({acc} accountant).")
        print(f"{eps:.6f}")
        return 0
    try:
        z = calibrate(args.epsilon, delta, lambda s: ev.dp_sgd(s, q, steps), acc)
    except ValueError as err:
        print(f"flwr-jdp calibrate: {err} (sample rate {q}, {steps} steps, delta {delta:g}): "
              "raise --epsilon or lower --steps or --sample-rate", file=sys.stderr)
        return 2
    reached = epsilon(ev.dp_sgd(z, q, steps), delta, acc, discretization=pld_grid(args.epsilon))
    print(f"Noise multiplier {z:.6g} gives epsilon {reached:.6g} <= {args.epsilon:g} at delta "
          f"{delta:g} (sample rate {q}, {steps} steps, {acc} accountant).")
    print(f"{z:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
