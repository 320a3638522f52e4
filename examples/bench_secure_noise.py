"""Benchmark: what ``secure-noise = true`` costs (OS-CSPRNG float64 noise, sum of
four draws) over the default generator-seeded noise.

1. One local DP-SGD step of the seed CNN's shared parameters (Opacus per-sample
   gradients, clipping, noise; decoupled release, personal head frozen), record
   unit, sampling rate 1 on a batch of ``--batch`` random records.
2. One central aggregation of the JointDP server (validation excluded): re-clip
   ``--owners`` owners' contributions, sum, noise, normalise.
3. Raw draws: seconds per million noise values.

The default and the secure variant are timed alternately (``--repeats`` pairs, so
both see the same machine load); prints the median seconds of each and the median
of the per-pair differences, as one JSON object. Usage:

    python examples/bench_secure_noise.py --image 28 --batch 64 --owners 16

and writes the same object to ``--out`` (default ``results/bench/secure_noise.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def paired(default, secure, repeats: int, per: int = 1) -> dict[str, float]:
    """Median seconds (divided by ``per``) of ``default`` and ``secure``, timed
    alternately, and the median per-pair extra cost of ``secure``."""
    default(), secure()  # warm-up
    pairs = [(_seconds(default) / per, _seconds(secure) / per) for _ in range(repeats)]
    return {"default_s": statistics.median(d for d, _ in pairs),
            "secure_s": statistics.median(s for _, s in pairs),
            "extra_s": statistics.median(s - d for d, s in pairs)}


def dp_sgd_step(image: int, batch: int, repeats: int) -> dict[str, float]:
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import split_parameters
    from flwr_jdp.training.dp_sgd import train_dp_sgd

    torch.manual_seed(0)
    model = SeedCNN(1, image, 10)
    split = split_parameters(model, r"^fc1\.")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 1, image, image)).astype(np.float32)
    y = rng.integers(0, 10, size=batch)
    gen = torch.Generator().manual_seed(0)
    steps = 5

    def run(secure: bool):
        return lambda: train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=1.0,
                                    clipping_norm=1.0, sample_rate=1.0, steps=steps, lr=0.01,
                                    personal_lr=0.0, generator=gen, secure_noise=secure)

    return paired(run(False), run(True), repeats, per=steps)


def central_aggregation(image: int, owners: int, repeats: int, unit: str) -> tuple[dict[str, float], int]:
    from flwr_jdp.joint_dp import protocol
    from flwr_jdp.joint_dp.config import parse_config
    from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
    from flwr_jdp.joint_dp.validation import spec_of
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import get_arrays, split_parameters
    from flwr_jdp.strategies import JointDP

    model = SeedCNN(1, image, 10)
    shared = get_arrays(model, split_parameters(model, r"^fc1\.").shared)
    rng = np.random.default_rng(0)
    arrays = {o: [rng.normal(size=a.shape).astype(np.float32) * 1e-3 for a in shared.values()]
              for o in range(owners)}
    weights = dict.fromkeys(range(owners), 1.0)

    def server(secure: bool) -> JointDP:
        cfg = parse_config({"privacy-unit": unit, "noise-placement": "central", "noise-multiplier": 1.0,
                            "secure-noise": secure, "num-owners": owners})
        strategy = JointDP(cfg)
        strategy.sizes = {o: OwnerSize(600, 600) for o in range(owners)}
        strategy.owner_node = {o: o for o in range(owners)}
        strategy.schedule = build_schedule(cfg, strategy.sizes)
        strategy._current = protocol.to_record(shared)
        strategy.spec = spec_of(strategy._current)
        return strategy

    default, secure = server(False), server(True)
    size = int(sum(a.size for a in shared.values()))
    return paired(lambda: default._aggregate(arrays, weights, 1),
                  lambda: secure._aggregate(arrays, weights, 1), repeats), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", type=int, default=28, help="image side (8: digits, 28: (fashion-)MNIST)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--owners", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/bench/secure_noise.json", help="JSON written here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flwr_jdp.privacy.mechanisms import secure_gaussian

    out: dict[str, object] = {"image": args.image, "batch": args.batch, "owners": args.owners}
    out["dp_sgd_step"] = dp_sgd_step(args.image, args.batch, args.repeats)
    for unit in ("record", "owner"):
        out[f"central_{unit}_aggregation"], out["shared_parameters"] = central_aggregation(
            args.image, args.owners, args.repeats, unit)
    rng = np.random.default_rng(0)
    out["million_draws"] = paired(lambda: rng.normal(0.0, 1.0, size=1_000_000),
                                  lambda: secure_gaussian(1_000_000, 1.0), 5)
    text = json.dumps(out, indent=1)
    print(text)
    from pathlib import Path
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
