"""``flwr-jdp``: privacy computations from the shell.

    flwr-jdp epsilon   --noise-multiplier Z --sample-rate Q --steps T --delta D [--accountant pld|rdp]
    flwr-jdp calibrate --epsilon E --delta D --sample-rate Q --steps T [--accountant pld|rdp]

Both describe DP-SGD: ``T`` Poisson-sampled (rate ``Q``) Gaussian releases with noise
multiplier ``Z`` under add/remove neighbouring, as TF-Privacy's
``compute_dp_sgd_privacy``. The last line printed is the number alone.

The paper reproductions are research scripts, not part of this command (see
``research/`` in the repository: ``python -m research.reproduce_joint_dp``).
"""

from __future__ import annotations

import argparse
import sys

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
