"""User-level private mean estimation: winsorized mean vs clipped Gaussian.

n users each hold m samples in R^d; the unit of privacy is the user. Methods, at
the same (epsilon, delta) (user level, replace-one):

- ``winsorized``: :class:`flwr_jdp.winsorized.estimator.WinsorizedMean` (private
  range by noisy histogram, winsorize to the range, Gaussian noise; randomized
  Hadamard rotation for d > 1). One quarter of the budget (in 1/z^2) goes to the
  range step, the rest to the mean.
- ``gaussian-clip``: every user's average clipped to the full range B, Gaussian
  noise for sensitivity 2B/n (naive user level).
- ``non-private``: the sample mean (the statistical error floor).

Data: ``bounded`` (samples mu + 0.5 u, u uniform on the unit sphere, so ||x|| <= 1)
and ``subgaussian`` (mu + N(0, 0.25/d I), range B = ||mu|| + 3 * 0.5). The
concentration radius given to the estimator is
tau = s (1 + sqrt(2 log(2n/beta))) / sqrt(m) with s = 0.5 and beta = 0.01
(Corollary 1: the users' averages concentrate like 1/sqrt(m)).

``error`` is ||estimate - mu|| and ``privacy_error`` is ||estimate - sample mean||
(the privacy term alone), each averaged over trials. Writes
``results/winsorized/mean_estimation.csv`` and ``mean_estimation.png`` and a
summary JSON with the log-log slope of the privacy error in m (Corollary 1
predicts -1/2 for the winsorized mean, 0 for the clipped Gaussian).

    python examples/winsorized/mean_estimation.py [--trials 20]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import dp_accounting as dpa
import numpy as np

from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.winsorized.estimator import WinsorizedMean, clipped_gaussian_mean

ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.5
BETA = 0.01
RANGE_SHARE = 0.25  # share of 1/z^2 spent on the range step


def sample_users(rng: np.random.Generator, dist: str, n: int, m: int, d: int, mu: np.ndarray) -> np.ndarray:
    """Every user's average of its m samples, shape (n, d)."""
    out = np.empty((n, d))
    chunk = max(1, 2_000_000 // max(1, m * d))
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        if dist == "bounded":
            u = rng.normal(size=(k, m, d))
            u /= np.linalg.norm(u, axis=2, keepdims=True)
            out[start:start + k] = mu + SCALE * u.mean(axis=1)
        else:
            out[start:start + k] = mu + rng.normal(scale=SCALE / math.sqrt(d), size=(k, m, d)).mean(axis=1)
    return out


def noise_multipliers(eps: float, delta: float) -> tuple[float, float, float]:
    """(z of the whole budget, z of the range step, z of the mean step)."""
    z = calibrate(eps, delta, lambda s: dpa.GaussianDpEvent(s), "pld")
    z_range = z / math.sqrt(RANGE_SHARE)
    z_mean = z / math.sqrt(1.0 - RANGE_SHARE)
    # the two releases compose to exactly one Gaussian(z)
    assert epsilon(dpa.ComposedDpEvent([dpa.GaussianDpEvent(z_range), dpa.GaussianDpEvent(z_mean)]),
                   delta) <= eps * (1 + 1e-6)
    return z, z_range, z_mean


def run_point(rng, dist, n, m, d, eps, delta, trials) -> list[dict]:
    mu = np.full(d, 0.5 / math.sqrt(d))  # ||mu|| = 0.5
    bound = 1.0 if dist == "bounded" else 0.5 + 3 * SCALE
    tau = SCALE * (1 + math.sqrt(2 * math.log(2 * n / BETA))) / math.sqrt(m)
    z, z_range, z_mean = noise_multipliers(eps, delta)
    mech = WinsorizedMean(bound=bound, tau=min(tau, 2 * bound), range_noise=z_range, mean_noise=z_mean,
                          beta=BETA)
    errs: dict[str, list[tuple[float, float]]] = {"winsorized": [], "gaussian-clip": [], "non-private": []}
    for _ in range(trials):
        x = sample_users(rng, dist, n, m, d, mu)
        sample_mean = x.mean(axis=0)
        for method, est in (("winsorized", mech.estimate(x, rng)),
                            ("gaussian-clip", clipped_gaussian_mean(x, bound, z, rng)),
                            ("non-private", sample_mean)):
            est = np.atleast_1d(est)
            errs[method].append((float(np.linalg.norm(est - mu)), float(np.linalg.norm(est - sample_mean))))
    return [{"n": n, "m": m, "d": d, "epsilon": eps, "distribution": dist, "method": meth,
             "error": float(np.mean([e for e, _ in v])), "privacy_error": float(np.mean([p for _, p in v])),
             "trials": trials, "tau": tau}
            for meth, v in errs.items()]


def grid() -> list[tuple[int, int, int, float]]:
    """(n, m, d, epsilon): vary m, n, d and epsilon around n=1000, m=16, d=16, eps=1."""
    pts = set()
    for m in (1, 4, 16, 64, 256, 1024):
        pts.add((1000, m, 16, 1.0))
        pts.add((1000, m, 1, 1.0))
    for n in (250, 500, 1000, 2000, 5000):
        pts.add((n, 16, 16, 1.0))
    for d in (1, 4, 16, 64):
        pts.add((1000, 16, d, 1.0))
    for eps in (0.25, 0.5, 1.0, 2.0, 4.0):
        pts.add((1000, 16, 16, eps))
    return sorted(pts)


def slope(rows, dist, method, d) -> float:
    pts = sorted((r["m"], r["privacy_error"]) for r in rows if r["distribution"] == dist
                 and r["method"] == method and r["d"] == d and r["n"] == 1000 and r["epsilon"] == 1.0
                 and r["m"] >= 4)
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    styles = {"winsorized": "tab:blue", "gaussian-clip": "tab:orange", "non-private": "gray"}
    for dist, ls in (("bounded", "-"), ("subgaussian", "--")):
        for method, color in styles.items():
            sel = [r for r in rows if r["distribution"] == dist and r["method"] == method]
            by_m = sorted((r["m"], r["privacy_error" if method != "non-private" else "error"]) for r in sel
                          if r["n"] == 1000 and r["d"] == 16 and r["epsilon"] == 1.0)
            by_n = sorted((r["n"], r["error"]) for r in sel if r["m"] == 16 and r["d"] == 16 and r["epsilon"] == 1.0)
            by_e = sorted((r["epsilon"], r["error"]) for r in sel if r["n"] == 1000 and r["m"] == 16 and r["d"] == 16)
            for ax, pts in zip(axes, (by_m, by_n, by_e), strict=False):
                if pts:
                    ax.plot(*zip(*pts, strict=False), ls, marker="o", color=color, label=f"{method} ({dist})")
    ms = np.array([4, 1024])
    ref = [r["privacy_error"] for r in rows if r["method"] == "winsorized" and r["distribution"] == "bounded"
           and r["n"] == 1000 and r["d"] == 16 and r["epsilon"] == 1.0 and r["m"] == 4]
    if ref:
        axes[0].plot(ms, ref[0] * np.sqrt(4 / ms), ":", color="black", label="1/sqrt(m)")
    for ax, xl, title in zip(axes, ("m (samples per user)", "n (users)", "epsilon"),
                             ("privacy error vs m (n=1000, d=16, eps=1)", "error vs n (m=16, d=16, eps=1)",
                              "error vs epsilon (n=1000, m=16, d=16)"), strict=False):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xl)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("L2 error")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "results" / "winsorized"))
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for dist in ("bounded", "subgaussian"):
        for n, m, d, eps in grid():
            rows += run_point(rng, dist, n, m, d, eps, args.delta, args.trials)
            print(f"{dist} n={n} m={m} d={d} eps={eps}: " + ", ".join(
                f"{r['method']}={r['error']:.4g}" for r in rows[-3:]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cols = ["n", "m", "d", "epsilon", "distribution", "method", "error", "privacy_error", "trials", "tau"]
    with (out / "mean_estimation.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "mean_estimation.png")
    summary = {
        "privacy_error_slope_in_m": {
            f"{dist}/d={d}/{method}": slope(rows, dist, method, d)
            for dist in ("bounded", "subgaussian") for d in (1, 16) for method in ("winsorized", "gaussian-clip")
        },
        "delta": args.delta, "trials": args.trials, "range_share": RANGE_SHARE, "beta": BETA,
        "command": "python " + " ".join(sys.argv),
    }
    (out / "mean_estimation_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
