"""Benchmark: what joint DP costs over plain Flower FedAvg, and DP-SGD over SGD.

1. Flower's Ray simulation, N owners (one per SuperNode), R rounds, the seed CNN
   on Fashion-MNIST (10,000 training records split evenly, <= 8 classes per
   owner): wall seconds per client-round of plain Flower FedAvg (no DP) and of
   joint DP (local DP-SGD on the shared parameters, record unit), in the same run.
2. The cost of one DP-SGD step on the shared parameters (Opacus per-sample
   gradients, clipping, noise; personal head trained plainly) over one ordinary
   SGD step on the same batch.

Writes results/bench/overhead.json. Usage:

    python examples/bench_overhead.py --data-dir ../shared/data/fashion-mnist \
        --owners 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def simulate(kind: str, run_config: dict, owners: int) -> float:
    """Run one Flower simulation; return wall seconds of the ServerApp's rounds."""
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation
    from flwr_jdp.apps import client_app as jdp_client
    from flwr_jdp.apps import fedavg_app, server_app

    def configured(context):  # run_simulation has no run-config argument
        return Context(context.run_id, context.node_id, context.node_config, context.state,
                       {**context.run_config, **run_config})

    def with_config(handler):
        def wrapped(msg, context):
            return handler(msg, configured(context))
        return wrapped

    client = ClientApp()
    server = ServerApp()
    if kind == "fedavg":
        client.train()(with_config(fedavg_app.train))
        client.evaluate()(with_config(fedavg_app.evaluate_owner))
        server_main = fedavg_app.main
    else:
        client.query()(with_config(jdp_client.setup))
        client.train()(with_config(jdp_client.train))
        client.evaluate()(with_config(jdp_client.evaluate_owners))
        server_main = server_app.main
    timing = {}

    @server.main()
    def main(grid, context):
        t0 = time.time()
        server_main(grid, configured(context))
        timing["seconds"] = time.time() - t0

    run_simulation(server_app=server, client_app=client, num_supernodes=owners,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR", "log_to_driver": False}})
    return timing["seconds"]


def dp_step_ratio(data_dir: str, batch: int = 64, steps: int = 60) -> dict:
    """Seconds per DP-SGD step (shared params) / seconds per plain SGD step."""
    from flwr_jdp.data import load_dataset
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import split_parameters
    from flwr_jdp.training.dp_sgd import train_dp_sgd
    from flwr_jdp.training.plain import train_plain

    torch.set_num_threads(1)
    ds = load_dataset("fashion-mnist", data_dir, 0)
    x, y = ds.x_train[: batch * 4], ds.y_train[: batch * 4]
    gen = torch.Generator().manual_seed(0)
    model = SeedCNN(1, 28, 10)
    split = split_parameters(model, r"^fc1\.")
    # plain: `steps` full-batch SGD steps over all parameters on a batch of `batch`
    xb, yb = x[:batch], y[:batch]
    train_plain(model, list(model.parameters()), xb, yb, epochs=3, batch_size=batch, lr=0.01, generator=gen)
    t = time.perf_counter()
    train_plain(model, list(model.parameters()), xb, yb, epochs=steps, batch_size=batch, lr=0.01, generator=gen)
    plain = (time.perf_counter() - t) / steps
    # DP: Poisson sampling with rate 1 on the same `batch` records -> same batch
    train_dp_sgd(model, split, xb, yb, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                 sample_rate=1.0, steps=3, lr=0.01, personal_lr=0.01, generator=gen)
    t = time.perf_counter()
    train_dp_sgd(model, split, xb, yb, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                 sample_rate=1.0, steps=steps, lr=0.01, personal_lr=0.01, generator=gen)
    dp = (time.perf_counter() - t) / steps
    return {"plain_step_s": plain, "dp_step_s": dp, "dp_step_ratio": dp / plain, "batch_size": batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--owners", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "overhead.json"))
    args = parser.parse_args()

    step = dp_step_ratio(args.data_dir)
    print(f"DP-SGD step / SGD step: {step['dp_step_ratio']:.2f}", flush=True)
    base = {
        "num-owners": args.owners, "num-rounds": args.rounds, "local-epochs": 1, "batch-size": 16,
        "dataset": "fashion-mnist", "data-dir": os.path.abspath(args.data_dir), "max-records": 10000,
        "classes-per-owner": 8, "noise-multiplier": 1.0, "target-epsilon": 1e6, "resume": False,
    }
    out_dir = Path(args.out).parent
    fedavg_s = simulate("fedavg", dict(base, **{"method": "fedavg",
                                               "results-dir": str(out_dir / "tmp-fedavg")}), args.owners)
    print(f"FedAvg: {fedavg_s:.1f}s", flush=True)
    jdp_s = simulate("joint-dp", dict(base, **{"method": "joint-dp", "privacy-unit": "record",
                                               "noise-placement": "local",
                                               "results-dir": str(out_dir / "tmp-jointdp")}), args.owners)
    print(f"joint-DP: {jdp_s:.1f}s", flush=True)
    client_rounds = args.owners * args.rounds
    doc = {
        "fedavg_s_per_client_round": fedavg_s / client_rounds,
        "jointdp_s_per_client_round": jdp_s / client_rounds,
        "ratio": jdp_s / fedavg_s,
        "dp_step_ratio": step["dp_step_ratio"],
        "fedavg_wall_s": fedavg_s,
        "jointdp_wall_s": jdp_s,
        "dp_step": step,
        "owners": args.owners,
        "rounds": args.rounds,
        "config": base,
        "notes": "wall seconds of the ServerApp (set-up, all rounds, federated evaluation every "
                 "round); joint-DP includes its set-up query and PLD accounting",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
        "command": "python " + " ".join(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("fedavg_s_per_client_round", "jointdp_s_per_client_round",
                                          "ratio", "dp_step_ratio")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
