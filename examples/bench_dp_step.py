"""Benchmark: one DP-SGD step against one plain SGD step, four ways, side by side.

For each model (the seed CNN with GroupNorm, personal ``fc1``; the quickstart
example's CNN, personal ``fc3``; both on 1x28x28 inputs) and batch size B:

- ``plain``: one SGD step on all parameters (:func:`train_plain`, the owners'
  non-private step);
- ``opacus_hooks``: one DP-SGD step of the shared parameters through
  :func:`train_dp_sgd` with Opacus's ``GradSampleModule`` (per-sample gradients,
  clipping, noise, update; decoupled release, personal layer frozen);
- ``opacus_ghost``: the same step with Opacus's ghost clipping
  (``GradSampleModuleFastGradientClipping``: per-sample norms from a first
  backward pass, a second backward of the re-weighted loss; noise and update as in
  ``train_dp_sgd``), where the installed Opacus has it;
- ``ours``: :func:`train_dp_sgd` with whole-model ``torch.func`` per-sample
  gradients (``per_sample.BACKEND = "func"``: no silent fallback);
- ``plain_user_loop``: a user's own loop (a DataLoader of the B records, SGD on a
  mean cross-entropy) without DP: the baseline of the drop-in's step;
- ``ours_user_loop``: the drop-in client's DP pass: the same loop given to
  :func:`private_training` (a dry run on two synthetic records, then each record's
  term, gradient and output in one vectorised ``torch.func`` pass on the pass's own
  model and batch copy, ``BACKEND = "func"``), per step including the dry run's share;
- ``ours_user_loop_micro`` (``--micro``): the same DP pass with each record's gradient
  from a micro-batch of one record (``BACKEND = "micro"``: the path for models
  ``vmap`` cannot trace), to measure its slowdown against the vectorised pass.

Every DP variant samples at rate 1 (the batch is the B records) and runs
``--steps`` steps per call (one wrap per call, as in production), timed per step.
One torch thread. The machine is shared and noisy, so each repetition times every
variant once, in an order rotated from one repetition to the next, and the
reported figure is the median over ``--reps`` repetitions (after one untimed
warm-up repetition). Usage:

    python examples/bench_dp_step.py            # -> results/bench/dp_step.json, dp_step.png
    python examples/bench_dp_step.py --micro --batches 16 64 --reps 5   # -> results/bench/dp_step_micro.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (16, 64, 256)
LR, CLIP, Z = 0.01, 1.0, 1.0


def quickstart_net() -> torch.nn.Module:
    """The quickstart example's ``Net`` (examples/quickstart-pytorch/quickstart/task.py)."""
    path = ROOT / "examples" / "quickstart-pytorch" / "quickstart" / "task.py"
    spec = importlib.util.spec_from_file_location("quickstart_task", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def models() -> dict[str, tuple]:
    from flwr_jdp.models import SeedCNN

    return {"seed-cnn": (lambda: SeedCNN(1, 28, 10, norm="group"), r"^fc1\."),
            "quickstart-cnn": (quickstart_net, r"^fc3\.")}


def ghost_available() -> str | None:
    """None if Opacus's ghost clipping can be imported, else why not."""
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping  # noqa: F401
    except ImportError as err:
        return f"not in the installed opacus: {err}"
    return None


def make_variants(build, rule: str, batch: int, steps: int, micro: bool = False) -> dict:
    """Callables that each run ``steps`` steps of one variant on a fresh model."""
    from flwr_jdp.params import split_parameters
    from flwr_jdp.privacy.mechanisms import GaussianSumMechanism
    from flwr_jdp.training import dp_sgd, per_sample
    from flwr_jdp.training.plain import train_plain

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=batch)
    torch.manual_seed(0)
    model = build()
    split = split_parameters(model, rule)
    gen = torch.Generator().manual_seed(0)

    def plain():
        train_plain(model, list(model.parameters()), x, y, epochs=steps, batch_size=batch, lr=LR, generator=gen)

    def dp(backend: str):
        def run():
            per_sample.BACKEND = backend
            dp_sgd.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=Z, clipping_norm=CLIP,
                                sample_rate=1.0, steps=steps, lr=LR, personal_lr=0.0, generator=gen)
        return run

    def ghost():
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        params = dict(model.named_parameters())
        shared = [params[n] for n in split.shared]
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        mech = GaussianSumMechanism(Z, CLIP, float(batch))
        with dp_sgd._frozen([params[n] for n in split.personal]):  # noqa: SLF001
            gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP, use_ghost_clipping=True,
                                                       loss_reduction="sum")
            gsm.train()
            for _ in range(steps):
                for p in shared:
                    p.grad = None
                losses = F.cross_entropy(gsm(xt), yt, reduction="none")
                losses.sum().backward(retain_graph=True)  # per-sample norms (hooks)
                coef = gsm.get_clipping_coef()
                for p in shared:
                    p.grad = None
                gsm.disable_hooks()
                (coef * losses).sum().backward()  # the clipped sum
                gsm.enable_hooks()
                with torch.no_grad():
                    for p, g in zip(shared, mech.release_torch([p.grad for p in shared], gen), strict=True):
                        p.add_(g, alpha=-LR)
            gsm._close()  # noqa: SLF001

    from torch.utils.data import DataLoader, TensorDataset

    def plain_user_loop():
        data = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(steps):
            for xb, yb in data:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()

    def user_loop(backend: str = "func"):
        """The drop-in's DP pass as ``JointDPClient.train`` runs it: the user's loop given
        to ``private_training`` (its dry run on two synthetic records, then the DP steps on
        the pass's own model and batches, paced by the loop)."""
        from flwr_jdp.training.dp_pass import private_training

        def loop(net, loader):  # noqa: ANN001
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(net(xb), yb).backward()
                opt.step()

        per_sample.BACKEND = backend
        params = dict(model.named_parameters())
        data = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch)
        with dp_sgd._frozen([params[n] for n in split.personal]), \
                private_training(model, data, unit_of_record=torch.arange(batch), num_units=batch, sample_rate=1.0,
                                 steps=steps, noise_multiplier=Z, clipping_norm=CLIP, generator=gen,
                                 train_fn=loop) as (private, loader, _):  # noqa: SLF001
            loop(private, loader)

    out = {"plain": plain, "opacus_hooks": dp("opacus")}
    if ghost_available() is None:
        out["opacus_ghost"] = ghost
    out["ours"] = dp("func")
    out["plain_user_loop"] = plain_user_loop
    out["ours_user_loop"] = user_loop
    if micro:
        out["ours_user_loop_micro"] = lambda: user_loop("micro")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
    ap.add_argument("--steps", type=int, default=3, help="steps per call")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--micro", action="store_true",
                    help="also time the drop-in's micro-batch path (one record per forward/backward)")
    ap.add_argument("--out", default=None, help="default: results/bench/dp_step.json (dp_step_micro.json with "
                                                "--micro)")
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "results" / "bench" / ("dp_step_micro.json" if args.micro else "dp_step.json"))

    import opacus

    from flwr_jdp.training import dp_sgd

    torch.set_num_threads(1)
    t_start, load_start = time.time(), list(os.getloadavg())
    configs = {(name, b): make_variants(build, rule, b, args.steps, args.micro)
               for name, (build, rule) in models().items() for b in args.batches}
    samples = {key: {v: [] for v in variants} for key, variants in configs.items()}
    cpu = {key: {v: [] for v in variants} for key, variants in configs.items()}
    for rep in range(args.reps + 1):  # repetition 0: warm-up, not recorded
        for key, variants in configs.items():
            names = list(variants)
            shift = rep % len(names)
            for v in names[shift:] + names[:shift]:
                t, c = time.perf_counter(), time.process_time()
                variants[v]()
                if rep:
                    samples[key][v].append((time.perf_counter() - t) / args.steps)
                    cpu[key][v].append((time.process_time() - c) / args.steps)
    assert not dp_sgd._FUNC_FAILED, dp_sgd._FUNC_FAILED  # noqa: SLF001 - ours ran on torch.func

    results = {}
    for (name, b), per in samples.items():
        med = {v: statistics.median(s) for v, s in per.items()}
        med_cpu = {v: statistics.median(s) for v, s in cpu[(name, b)].items()}
        results.setdefault(name, {})[str(b)] = {
            "median_ms": {v: round(m * 1e3, 3) for v, m in med.items()},
            "ratio_to_plain": {v: round(m / med["plain"], 3) for v, m in med.items()},
            "median_cpu_ms": {v: round(m * 1e3, 3) for v, m in med_cpu.items()},
            "ratio_to_plain_cpu": {v: round(m / med_cpu["plain"], 3) for v, m in med_cpu.items()},
            "user_loop_ratio_to_plain_user_loop": round(med["ours_user_loop"] / med["plain_user_loop"], 3),
            **({"micro_ratio_to_vmap_user_loop": round(med["ours_user_loop_micro"] / med["ours_user_loop"], 3)}
               if "ours_user_loop_micro" in med else {}),
            "samples_ms": {v: [round(t * 1e3, 3) for t in s] for v, s in per.items()},
        }
    doc = {
        "what": "seconds per step: plain SGD step vs DP-SGD step (per-sample gradients, clipping, noise, update)",
        "command": "python examples/bench_dp_step.py" + (" --micro" if args.micro else "")
        + (f" --batches {' '.join(map(str, args.batches))}" if tuple(args.batches) != BATCHES else "")
        + (f" --reps {args.reps}" if args.reps != 15 else "") + (f" --steps {args.steps}" if args.steps != 3 else ""),
        "repetitions": args.reps, "warmup_repetitions": 1, "steps_per_call": args.steps,
        "interleaving": "every repetition times every variant of a (model, B) once, order rotated per repetition",
        "statistic": "median over repetitions of wall seconds per step (perf_counter); the same for the "
                     "process's CPU seconds (process_time, less sensitive to other processes' load)",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "opacus": opacus.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "load_average_at_start": load_start, "load_average_at_end": list(os.getloadavg()),
        "opacus_ghost": ghost_available() or "available (GradSampleModuleFastGradientClipping)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - t_start, 1),
        "target": "ours_user_loop <= 1.3x plain at B >= 64",
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    plot(doc, out.with_suffix(".png"))
    print(table(doc))
    print(f"wrote {out} and {out.with_suffix('.png')} ({doc['wall_seconds']} s)")


def table(doc: dict) -> str:
    variants = ["plain", "opacus_hooks", "opacus_ghost", "ours", "plain_user_loop", "ours_user_loop"]
    micro = any("ours_user_loop_micro" in r["median_ms"] for per_b in doc["results"].values() for r in per_b.values())
    variants += ["ours_user_loop_micro"] if micro else []
    lines = ["Per step, median; multiples of the plain step: wall (CPU).",
             "| model | B | plain wall (CPU) ms | Opacus hooks | Opacus ghost | ours | plain, user's loop | "
             "ours, user's loop |" + (" ours, user's loop, micro-batches |" if micro else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if micro else "")]
    for name, per_b in doc["results"].items():
        for b, r in per_b.items():
            cells = [f"{r['median_ms']['plain']:.1f} ({r['median_cpu_ms']['plain']:.1f})"]
            cells += [f"{r['ratio_to_plain'][v]:.2f}x ({r['ratio_to_plain_cpu'][v]:.2f}x)"
                      if v in r["ratio_to_plain"] else "n/a" for v in variants[1:]]
            lines.append(f"| {name} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["results"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names, strict=True):
        per_b = doc["results"][name]
        bs = [int(b) for b in per_b]
        for v, style in (("opacus_hooks", "s-"), ("opacus_ghost", "^-"), ("ours", "o-"),
                         ("ours_user_loop", "d--"), ("ours_user_loop_micro", "x:")):
            if v in per_b[str(bs[0])]["ratio_to_plain"]:
                ax.plot(bs, [per_b[str(b)]["ratio_to_plain"][v] for b in bs], style, label=v)
        ax.axhline(1.0, color="grey", lw=1, label="plain step")
        ax.axhline(1.3, color="red", ls="--", lw=1, label="target 1.3x")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("batch size B")
        ax.set_title(name)
    np.atleast_1d(axes)[0].set_ylabel("time per step / plain step (median)")
    np.atleast_1d(axes)[0].legend()
    fig.suptitle(f"DP-SGD step vs plain step, 1 thread, {doc['repetitions']} interleaved repetitions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
