"""Charge, save, release, in every strategy: when the first message of a round
leaves the server, the ledger on disk already charges that round (a server killed
from then on cannot under-charge it)."""

import json

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.winsorized.estimator import WinsorizedMean


class SpyGrid(InProcessGrid):
    """Before delivering train messages, note the rounds the ledger on disk charges."""

    def __init__(self, *args, ledger_path, round_of, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger_path, self.round_of = ledger_path, round_of
        self.seen: list[tuple[int, list[int]]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        trains = [m for m in messages if m.metadata.message_type.startswith("train")]
        if trains:
            charged = ([int(r["round"]) for r in json.loads(self.ledger_path.read_text())["rounds"]]
                       if self.ledger_path.is_file() else [])
            self.seen.append((self.round_of(trains[0]), charged))
        return super().send_and_receive(messages, timeout=timeout)


def _assert_each_round_charged_on_disk_before_sending(grid, rounds):
    assert [r for r, _ in grid.seen] == list(rounds)
    for rnd, charged in grid.seen:
        assert rnd in charged, f"round {rnd} sent with only rounds {charged} on disk"


def test_joint_dp(run_config, tmp_path):
    from apps.joint_dp.joint_dp.client_app import app
    from apps.joint_dp.joint_dp.server_app import initial_arrays
    from flwr_jdp.joint_dp import protocol
    from flwr_jdp.joint_dp.config import parse_config
    from flwr_jdp.strategies import JointDP

    for placement in ("local", "central"):
        rc = dict(run_config, **{"noise-placement": placement, "results-dir": str(tmp_path / placement)})
        grid = SpyGrid(app, 2, rc, ledger_path=tmp_path / placement / "ledger.json",
                       round_of=lambda m: int(m.content[protocol.CONFIG][protocol.ROUND]))
        cfg = parse_config(rc)
        JointDP(cfg, node_settle_s=0.0).start(grid=grid, initial_arrays=initial_arrays(cfg))
        _assert_each_round_charged_on_disk_before_sending(grid, [1, 2])


def test_dp_mtl(tmp_path):
    from apps.dp_mtl.dp_mtl.client_app import client
    from flwr_jdp.mtl.config import parse_mtl_config
    from flwr_jdp.strategies import DPMeanRegularizedMTL

    rc = {"num-tasks": 8, "samples-per-task": 10, "dim": 4, "rounds": 2, "target-epsilon": 3.0,
          "noise-seed": 4, "results-dir": str(tmp_path / "res"), "resume": False}
    source, cfg, extras = parse_mtl_config(rc)
    grid = SpyGrid(client, 2, rc, ledger_path=tmp_path / "res" / "ledger.json",
                   round_of=lambda m: int(m.content["config"]["round"]))
    DPMeanRegularizedMTL(source.num_tasks, source.model().num_params, cfg, extras["results-dir"],
                         noise_seed=4, run_config=rc, resume=False).start(grid)
    _assert_each_round_charged_on_disk_before_sending(grid, [1, 2])


def test_priv_altmin_ledger_grows_on_disk_before_each_epoch(tmp_path):
    from apps.priv_altmin.priv_altmin.client_app import client
    from flwr_jdp.altmin.config import parse_altmin_config
    from flwr_jdp.strategies import PrivAltMin

    rc = {"num-users": 300, "dim": 4, "rank": 2, "epochs": 2, "target-epsilon": 4.0,
          "noise-seed": 11, "results-dir": str(tmp_path / "run")}
    spec, cfg, extras = parse_altmin_config(rc)
    path = tmp_path / "run" / "ledger.json"
    spent = []

    class EpsilonSpy(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if messages[0].metadata.message_type.startswith("train"):
                spent.append(PrivacyLedger.load(path).epsilon())
            return super().send_and_receive(messages, timeout=timeout)

    strategy = PrivAltMin(spec, cfg, extras["results-dir"], 11)
    strategy.start(EpsilonSpy(client, 1, rc))
    assert spent[0] > 0 and spent == sorted(spent) and len(set(spent)) == 3
    assert spent[-1] == strategy.ledger.epsilon()  # the last epoch's charge was on disk before it ran
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "completed"


def test_winsorized_wrapper(tmp_path):
    from flwr_jdp.strategies.winsorized import DifferentialPrivacyWinsorizedMean

    n, dim = 4, 3
    client = ClientApp()

    @client.train()
    def train(msg, context):  # noqa: ANN001, ANN202
        w = msg.content["arrays"]["w"].numpy()
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w + 0.01)}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    path = tmp_path / "ledger.json"
    grid = SpyGrid(client, n, {}, ledger_path=path, round_of=lambda m: len(grid.seen) + 1)
    estimator = WinsorizedMean(bound=1.0, tau=0.01, range_noise=2.0, mean_noise=2.0)
    wrapper = DifferentialPrivacyWinsorizedMean(
        FedAvg(fraction_train=1.0, min_train_nodes=n, min_available_nodes=n, fraction_evaluate=0.0),
        estimator, n, ledger=PrivacyLedger(delta=1e-5, unit="user"), ledger_path=path, noise_seed=0)
    wrapper.start(grid=grid, initial_arrays=ArrayRecord({"w": Array(np.zeros(dim))}), num_rounds=2)
    _assert_each_round_charged_on_disk_before_sending(grid, [1, 2])
