"""Benchmark, side by side in one run: the quickstart app (examples/quickstart-pytorch*)
under plain FedAvg, JointDP (record unit, local noise), JointDP (record unit, central
noise) and Flower's own DP peer (``DifferentialPrivacyClientSideFixedClipping`` around
FedAvg, with ``fixedclipping_mod`` on the ClientApp).

Same model (the app's ``Net``), data (Fashion-MNIST, ``--records-per-owner`` records
per owner, 80% train / 20% test) and owners (one in-process node each, ``InProcessGrid``:
the real ClientApps and strategies, no Ray). One torch thread.

Per variant: seconds spent inside the ClientApp's train calls per client-round (train
seconds / (owners x rounds)), the same for evaluate calls, the wall time of each round,
the final accuracy over owners (JointDP: each owner's personalized ``eval_acc``, mean
over owners; FedAvg and DP-FedAvg: the global model's ``eval_acc``, weighted by
``num-examples``), and epsilon where there is one. Where the client time goes is
measured by wrapping the app's own ``train``/``test`` functions (no library edits).

Writes results/bench/dropin.json and results/bench/dropin.png. Usage:

    python examples/bench_dropin.py --owners 256 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
JDP_APP = ROOT / "examples" / "quickstart-pytorch"
FEDAVG_APP = ROOT / "examples" / "quickstart-pytorch-fedavg"
TRAIN, EVALUATE, QUERY = "train", "evaluate", "query"


class Clock:
    """Wall and CPU seconds (this process) by (message type, part), and the start of
    every training round. CPU seconds are the robust measure on a shared machine: other
    jobs' load inflates wall time, not (much) this process's CPU time."""

    def __init__(self) -> None:
        self.wall: dict[tuple[str, str], float] = defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.kind = ""  # message type being handled now
        self.round_starts: list[float] = []

    @contextmanager
    def timing(self, kind: str, part: str):
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[(kind, part)] += time.perf_counter() - w
            self.cpu[(kind, part)] += time.process_time() - c
            self.calls[(kind, part)] += 1


def timed_grid(clock: Clock, update_norms: list[float] | None = None):
    """An InProcessGrid that times every ClientApp call by message type (the fault
    hook, outside the timing, collects the norm of FedAvg's unclipped updates)."""
    from flwr_jdp.inprocess import InProcessGrid

    class TimedGrid(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages and messages[0].metadata.message_type.split(".")[0] == TRAIN:
                clock.round_starts.append(time.perf_counter())
            replies = []
            for msg in messages:
                kind = msg.metadata.message_type.split(".")[0]
                clock.kind = kind
                with clock.timing(kind, "handler"):
                    reply = self.client_app(msg, self.contexts[msg.metadata.dst_node_id])
                clock.kind = ""
                if update_norms is not None and kind == TRAIN and reply.has_content():
                    sent = msg.content["arrays"].to_numpy_ndarrays()
                    back = reply.content["arrays"].to_numpy_ndarrays()
                    update_norms.append(float(np.sqrt(sum(np.sum((b - s) ** 2) for b, s in zip(back, sent)))))
                replies.append(reply)
            return replies

    return TimedGrid


def timed_functions(module, clock: Clock, personal_rule: str) -> None:
    """Wrap the app's own ``train_fn``/``test_fn`` (module globals the handlers call):
    a train call with the shared parameters frozen is JointDP's personal fit, one with
    the personal parameters frozen its DP release, one with all trainable plain local
    training."""
    rule = re.compile(personal_rule)
    train_fn, test_fn = module.train_fn, module.test_fn

    def train(net, loader, *args, **kwargs):
        flags = [(bool(rule.search(n.removeprefix("_module."))), p.requires_grad)
                 for n, p in net.named_parameters()]
        shared = any(g for personal, g in flags if not personal)
        personal = any(g for is_p, g in flags if is_p)
        part = "local training" if shared and personal else "DP release" if shared else "personal fit"
        with clock.timing(clock.kind, part):
            return train_fn(net, loader, *args, **kwargs)

    def test(net, loader):
        with clock.timing(clock.kind, "test"):
            return test_fn(net, loader)

    module.train_fn, module.test_fn = train, test


def load_apps():
    """The JointDP example's modules (as ``quickstart``) and the FedAvg example's
    client_app under a distinct name (its ``quickstart.task`` import resolves to the
    identical, already-imported task module)."""
    sys.path.insert(0, str(JDP_APP))
    try:
        from quickstart import client_app as jdp_client
        from quickstart import task
    finally:
        sys.path.remove(str(JDP_APP))
    spec = importlib.util.spec_from_file_location("quickstart_fedavg_client_app",
                                                  FEDAVG_APP / "quickstart" / "client_app.py")
    fedavg_client = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fedavg_client
    spec.loader.exec_module(fedavg_client)
    return task, jdp_client, fedavg_client


def gaussian_epsilon(z: float, rounds: int, delta: float) -> dict[str, float]:
    """Epsilon of ``rounds`` Gaussian releases of noise multiplier ``z`` (sampling rate 1,
    add/remove one client), by dp-accounting's PLD and RDP accountants."""
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    event = SelfComposedDpEvent(GaussianDpEvent(z), rounds)
    return {"pld": float(PLDAccountant().compose(event).get_epsilon(delta)),
            "rdp": float(RdpAccountant().compose(event).get_epsilon(delta))}


def noise_for_epsilon(target: float, rounds: int, delta: float) -> float:
    """The smallest noise multiplier (to 1e-3) with PLD epsilon <= ``target``."""
    lo, hi = 0.05, 50.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gaussian_epsilon(mid, rounds, delta)["pld"] <= target else (mid, hi)
    return hi


def run_variant(name: str, args, apps, base_cfg: dict) -> dict:
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

    from flwr_jdp.strategies import JointDP

    task, jdp_client, fedavg_client = apps
    cfg = dict(base_cfg)
    clock = Clock()
    norms: list[float] | None = None
    out: dict = {}
    jdp = name.startswith("jointdp")
    if jdp:
        cfg["jdp.noise-placement"] = "central" if name == "jointdp-central" else "local"
        client_app, module = jdp_client.app, jdp_client
    elif name == "fedavg":
        client_app, module = fedavg_client.app, fedavg_client
        norms = args.fedavg_update_norms
    else:  # Flower's DP-FedAvg peer: the FedAvg app's own handlers behind fixedclipping_mod.
        # On the train handler only: flwr 1.41's fixedclipping_mod does not skip other
        # message types, so ClientApp(mods=[fixedclipping_mod]) (as Flower's docs show)
        # fails every evaluate message ("requires the key 'clipping_norm'").
        client_app, module = ClientApp(), fedavg_client
        client_app.train(mods=[fixedclipping_mod])(fedavg_client.train)
        client_app.evaluate()(fedavg_client.evaluate)
    saved = module.train_fn, module.test_fn
    timed_functions(module, clock, cfg["jdp.personal-layers"])
    grid = timed_grid(clock, norms)(client_app, args.owners, cfg)
    if jdp:
        strategy = JointDP.from_run_config(cfg, node_settle_s=0.0)
    else:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0)
        if name == "dp-fedavg":
            strategy = DifferentialPrivacyClientSideFixedClipping(
                strategy, noise_multiplier=args.dp_fedavg_noise, clipping_norm=args.dp_fedavg_clip,
                num_sampled_clients=args.owners)
    print(f"--- {name}: {args.owners} owners, {args.rounds} rounds", flush=True)
    t0 = time.perf_counter()
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()),
                                num_rounds=args.rounds,
                                train_config=ConfigRecord({"lr": cfg["learning-rate"]}))
    finally:
        module.train_fn, module.test_fn = saved
    end = time.perf_counter()
    final = result.evaluate_metrics_clientapp[args.rounds]
    client_rounds = args.owners * args.rounds
    starts = clock.round_starts + [end]
    for unit, table in (("s", clock.wall), ("cpu_s", clock.cpu)):
        train_s, eval_s, setup_s = (table.get((k, "handler"), 0.0) for k in (TRAIN, EVALUATE, QUERY))
        out.update({
            f"train_{unit}_per_client_round": train_s / client_rounds,
            f"evaluate_{unit}_per_client_round": eval_s / client_rounds,
            f"train_plus_evaluate_{unit}_per_client_round": (train_s + eval_s) / client_rounds,
            f"setup_{unit}_per_owner": setup_s / args.owners,
        })
    out.update({
        "round_wall_s": [b - a for a, b in zip(starts[:-1], starts[1:])],
        "before_round_1_wall_s": starts[0] - t0,
        "run_wall_s": end - t0,
        "final_accuracy": float(final["accuracy"] if jdp else final["eval_acc"]),
        "final_accuracy_kind": ("mean over owners of each owner's personalized eval_acc" if jdp
                                else "global model's eval_acc, weighted by num-examples"),
    })
    for unit, table in (("s", clock.wall), ("cpu_s", clock.cpu)):
        parts = {}
        for kind in (TRAIN, EVALUATE):
            named = {part: s for (k, part), s in table.items() if k == kind and part != "handler"}
            parts[kind] = {p: s / client_rounds for p, s in sorted(named.items())}
            parts[kind]["rest of the handler"] = (table.get((kind, "handler"), 0.0)
                                                  - sum(named.values())) / client_rounds
        out[f"where_time_goes_{unit}_per_client_round"] = parts
    out["calls"] = {f"{k}/{p}": n for (k, p), n in sorted(clock.calls.items())}
    if jdp:
        out["epsilon"] = float(strategy.ledger.epsilon())
        out["delta"] = float(strategy.cfg.delta)
        out["noise_multiplier"] = float(strategy.noise_multiplier)
        out["privacy_unit"] = "record (joint DP; personal fc3 layer kept on the owner)"
    elif name == "dp-fedavg":
        eps = gaussian_epsilon(args.dp_fedavg_noise, args.rounds, args.delta)
        out.update({"epsilon": eps["pld"], "epsilon_rdp": eps["rdp"], "delta": args.delta,
                    "noise_multiplier": args.dp_fedavg_noise, "clipping_norm": args.dp_fedavg_clip,
                    "privacy_unit": "owner (client-level central DP, trusted server)",
                    "epsilon_note": "not accounted by Flower here; dp-accounting PLD (and RDP), "
                                    f"{args.rounds} Gaussian releases, sampling rate 1, add/remove one owner"})
    else:
        out["epsilon"] = None
    if norms:
        out["update_norm_median"] = float(np.median(norms))
        out["update_norm_p90"] = float(np.percentile(norms, 90))
    print(f"    train {out['train_s_per_client_round'] * 1e3:.1f} ms/client-round "
          f"({out['train_cpu_s_per_client_round'] * 1e3:.1f} CPU), evaluate "
          f"{out['evaluate_s_per_client_round'] * 1e3:.1f} ms, accuracy {out['final_accuracy']:.4f}, "
          f"epsilon {out['epsilon']}, wall {out['run_wall_s']:.1f}s", flush=True)
    return out


def warm_up(task, args, num_records: int) -> None:
    """Outside the timing: the data partitions (cached), torch's first optimizer step
    (seconds, once per process) and Opacus's per-sample gradient hooks."""
    from opacus import GradSampleModule

    trainloader, testloader = task.load_data(0, args.owners, data_dir=args.data_dir, records=num_records)
    task.train(task.Net(), trainloader, 1, 0.01)
    task.test(task.Net(), testloader)
    gsm = GradSampleModule(task.Net())
    batch = next(iter(trainloader))
    torch.nn.functional.cross_entropy(gsm(batch["img"]), batch["label"]).backward()
    gsm._close()  # noqa: SLF001


def plot(path: Path, variants: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(variants)
    train = [variants[n]["train_cpu_s_per_client_round"] * 1e3 for n in names]
    evals = [variants[n]["evaluate_cpu_s_per_client_round"] * 1e3 for n in names]
    acc = [variants[n]["final_accuracy"] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
    x = np.arange(len(names))
    ax1.bar(x, train, label="train calls")
    ax1.bar(x, evals, bottom=train, label="evaluate calls")
    ax1.set_xticks(x, names, rotation=20, fontsize=8)
    ax1.set_ylabel("CPU ms per client-round")
    ax1.legend(fontsize=8)
    ax2.bar(x, acc, color="tab:green")
    ax2.set_xticks(x, names, rotation=20, fontsize=8)
    ax2.set_ylabel("final accuracy")
    ax2.set_ylim(0, 1)
    for i, n in enumerate(names):
        eps = variants[n].get("epsilon")
        ax2.text(i, acc[i] + 0.02, f"eps {eps:.2g}" if eps else "no DP", ha="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--owners", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--records-per-owner", type=int, default=100, help="80%% train, 20%% test")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    p.add_argument("--variants", default="fedavg,jointdp-local,jointdp-central,dp-fedavg")
    p.add_argument("--dp-fedavg-clip", type=float, default=None,
                   help="clipping norm of DP-FedAvg's updates (default: the median norm of FedAvg's "
                        "updates in this run, else 1.0)")
    p.add_argument("--dp-fedavg-noise", type=float, default=None,
                   help="noise multiplier of DP-FedAvg (default: epsilon = JointDP's target at --delta)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--out", default=str(ROOT / "results" / "bench" / "dropin.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from flwr.common.config import flatten_dict

    apps = load_apps()
    torch.set_num_threads(1)  # the client modules set it too
    logging.getLogger("flwr").setLevel(logging.WARNING)  # fixedclipping_mod logs every reply
    raw = tomllib.loads((JDP_APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    base = flatten_dict(raw)
    tmp = tempfile.TemporaryDirectory()
    base.update({"data-dir": args.data_dir, "num-records": args.owners * args.records_per_owner,
                 "num-server-rounds": args.rounds, "jdp.num-rounds": args.rounds, "jdp.delta": args.delta})
    if args.dp_fedavg_noise is None:
        args.dp_fedavg_noise = noise_for_epsilon(float(base["jdp.target-epsilon"]), args.rounds, args.delta)
    warm_up(apps[0], args, base["num-records"])
    args.fedavg_update_norms = []
    variants = {}
    for name in args.variants.split(","):
        if name == "dp-fedavg" and args.dp_fedavg_clip is None:
            norms = args.fedavg_update_norms
            args.dp_fedavg_clip = float(np.median(norms)) if norms else 1.0
        cfg = dict(base, **{"jdp.results-dir": os.path.join(tmp.name, name)})
        variants[name] = run_variant(name, args, apps, cfg)
    tmp.cleanup()
    if "fedavg" in variants:
        ref = variants["fedavg"]
        for v in variants.values():
            for unit in ("s", "cpu_s"):
                for what in ("train", "train_plus_evaluate"):
                    key = f"{what}_{unit}_per_client_round"
                    v[f"ratio_to_fedavg_{what}_{unit}"] = v[key] / ref[key]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
        "machine": (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with "
                    "other jobs, one torch thread, torch " + torch.__version__),
        "owners": args.owners, "rounds": args.rounds,
        "records_per_owner": args.records_per_owner,
        "train_records_per_owner": int(0.8 * args.records_per_owner),
        "jdp_config": {k: v for k, v in base.items() if k.startswith("jdp.")},
        "app_config": {k: v for k, v in base.items() if not k.startswith("jdp.") and k != "data-dir"},
        "target": "JointDP <= 1.3x FedAvg per client-round (train calls)",
        "notes": [
            "*_s: wall seconds inside the ClientApp calls; *_cpu_s: this process's CPU seconds over "
            "the same calls (robust to other jobs on the shared cores); per client-round = total / "
            "(owners x rounds).",
            "JointDP's personal fit (the user's train on the owner's loader, shared parameters "
            "frozen) runs in the first train call and then in every evaluate call (on the new "
            "broadcast), so train + evaluate is the fair total.",
            "dp-fedavg: fixedclipping_mod on the train handler only (flwr 1.41's mod fails "
            "evaluate messages when set on the whole ClientApp); noise multiplier chosen for "
            "JointDP's target epsilon under a different unit (one owner, trusted server).",
        ],
        "variants": variants,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(out.with_suffix(".png"), variants)
    print(f"{'variant':16s} {'train ms':>9s} {'CPU ms':>7s} {'xFedAvg':>7s} {'+eval ms':>9s} {'CPU ms':>7s} "
          f"{'xFedAvg':>7s} {'round s':>8s} {'acc':>6s} {'eps':>6s}")
    for n, v in variants.items():
        eps = v.get("epsilon")
        print(f"{n:16s} {v['train_s_per_client_round'] * 1e3:9.1f} {v['train_cpu_s_per_client_round'] * 1e3:7.1f} "
              f"{v.get('ratio_to_fedavg_train_cpu_s', 0):7.2f} "
              f"{v['train_plus_evaluate_s_per_client_round'] * 1e3:9.1f} "
              f"{v['train_plus_evaluate_cpu_s_per_client_round'] * 1e3:7.1f} "
              f"{v.get('ratio_to_fedavg_train_plus_evaluate_cpu_s', 0):7.2f} "
              f"{np.mean(v['round_wall_s']):8.1f} {v['final_accuracy']:6.3f} "
              f"{'-' if eps is None else f'{eps:.2f}':>6s}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
