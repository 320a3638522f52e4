"""The winsorized user-level DP wrapper around a Flower strategy: what it releases,
what it charges, what it drops, and its noise against Flower's fixed clipping."""

import dp_accounting as dpa
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.strategies.winsorized import DifferentialPrivacyWinsorizedMean
from flwr_jdp.winsorized.estimator import WinsorizedMean

N, DIM = 512, 64  # the range step needs n >> z sqrt(2 d) (its histogram noise)
MU = np.linspace(-0.02, 0.02, DIM)  # the clients' common update direction
SPREAD = 0.001  # L2 radius of each client's deviation from MU


def _client_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context):  # noqa: ANN001, ANN202
        pid = int(context.node_config["partition-id"])
        dev = np.random.default_rng(pid).standard_normal(DIM)
        update = MU + SPREAD * dev / np.linalg.norm(dev)
        w = msg.content["arrays"]["w"].numpy()
        content = RecordDict({"arrays": ArrayRecord({"w": Array(w + update)}),
                              "metrics": MetricRecord({"num-examples": 1})})
        return Message(content, reply_to=msg)

    return app


def _updates() -> np.ndarray:
    out = []
    for pid in range(N):
        dev = np.random.default_rng(pid).standard_normal(DIM)
        out.append(MU + SPREAD * dev / np.linalg.norm(dev))
    return np.stack(out)


def _round(strategy, grid):  # noqa: ANN001, ANN202
    arrays = ArrayRecord({"w": Array(np.zeros(DIM))})
    msgs = strategy.configure_train(1, arrays, ConfigRecord(), grid)
    replies = grid.send_and_receive(msgs)
    new, _ = strategy.aggregate_train(1, replies)
    return None if new is None else new["w"].numpy()


def _fedavg() -> FedAvg:
    return FedAvg(fraction_train=1.0, min_train_nodes=N, min_available_nodes=N)


def _estimator(noise: float) -> WinsorizedMean:
    return WinsorizedMean(bound=1.0, tau=SPREAD, range_noise=noise, mean_noise=noise)


def test_release_is_the_client_mean_up_to_the_stated_noise_and_both_steps_are_charged():
    grid = InProcessGrid(_client_app(), N, {})
    strategy = DifferentialPrivacyWinsorizedMean(_fedavg(), _estimator(1e-3), N, noise_seed=1)
    got = _round(strategy, grid)
    assert np.allclose(got, _updates().mean(axis=0), atol=1e-4)  # winsorization clips nothing here
    ledger = PrivacyLedger(delta=1e-5, unit="user")
    strategy = DifferentialPrivacyWinsorizedMean(_fedavg(), _estimator(1.5), N, ledger=ledger, noise_seed=1)
    _round(strategy, grid)
    expected = dpa.ComposedDpEvent([dpa.GaussianDpEvent(1.5), dpa.GaussianDpEvent(1.5)])
    assert ledger.epsilon() == pytest.approx(epsilon(expected, 1e-5))
    assert [r["round"] for r in ledger.rounds] == [1] and SERVER_SCOPE in ledger.scopes


def test_noise_scales_with_concentration_not_with_the_clipping_norm():
    """At equal user-level epsilon (replace-one; the wrapper pays for its range step
    too), concentrated updates get far less noise than Flower's fixed clipping to
    the smallest norm that covers them."""
    grid = InProcessGrid(_client_app(), N, {})
    truth = _updates().mean(axis=0)
    clip = float(np.linalg.norm(_updates(), axis=1).max())
    eps = epsilon(_estimator(2.0).event(), 1e-5)
    z_fixed = calibrate(eps, 1e-5, dpa.GaussianDpEvent, relation="replace-one")
    assert epsilon(dpa.GaussianDpEvent(z_fixed), 1e-5, relation="replace-one") <= eps
    errs_w, errs_f = [], []
    for seed in range(5):
        w = DifferentialPrivacyWinsorizedMean(_fedavg(), _estimator(2.0), N, noise_seed=seed)
        errs_w.append(np.linalg.norm(_round(w, grid) - truth))
        np.random.seed(seed)  # Flower draws its noise from numpy's global generator
        f = DifferentialPrivacyServerSideFixedClipping(_fedavg(), z_fixed, clip, N)
        errs_f.append(np.linalg.norm(_round(f, grid) - truth))
    assert np.mean(errs_w) < 0.5 * np.mean(errs_f)


def test_malformed_replies_are_dropped_and_a_short_round_is_skipped():
    def corrupt(instruction, reply):  # noqa: ANN001, ANN202
        if instruction.metadata.dst_node_id == 1003:  # one node
            return Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3))}),
                                       "metrics": MetricRecord({"num-examples": 1})}), reply_to=instruction)
        return reply

    grid = InProcessGrid(_client_app(), N, {}, fault=corrupt)
    strategy = DifferentialPrivacyWinsorizedMean(_fedavg(), _estimator(1.0), N, noise_seed=0)
    assert _round(strategy, grid) is None
    assert len(strategy.dropped) == 1 and "shape" in strategy.dropped[0]


def test_budget_exhaustion_stops_before_the_release():
    grid = InProcessGrid(_client_app(), N, {})
    ledger = PrivacyLedger(delta=1e-5, unit="user", budget=0.5)
    strategy = DifferentialPrivacyWinsorizedMean(_fedavg(), _estimator(1.0), N, ledger=ledger, noise_seed=0)
    with pytest.raises(PrivacyBudgetExhausted):
        _round(strategy, grid)
    assert ledger.epsilon() == 0.0


def test_user_level_dp_sgd_charges_every_step_and_learns_from_concentrated_users():
    from flwr_jdp.models.linear import LinearModel
    from flwr_jdp.winsorized.user_level_sgd import UserData, user_level_dp_sgd

    rng = np.random.default_rng(0)
    w_star = np.array([0.6, -0.8])
    users = []
    for _ in range(400):
        x = rng.standard_normal((200, 2))
        users.append(UserData(x, x @ w_star + 0.1 * rng.standard_normal(200)))
    model = LinearModel("squared", 2)
    est = WinsorizedMean(bound=3.0, tau=0.5, range_noise=1.0, mean_noise=1.0)
    w, event = user_level_dp_sgd(model, users, steps=15, lr=0.5, estimator=est, rng=np.random.default_rng(1))
    assert event == dpa.SelfComposedDpEvent(est.event(), 15)
    assert np.linalg.norm(w - w_star) < 0.1
    w_c, event_c = user_level_dp_sgd(model, users, steps=15, lr=0.5, estimator=None,
                                     rng=np.random.default_rng(1), clip=3.0, noise_multiplier=1.0)
    assert event_c == dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.0), 15)
    assert np.linalg.norm(w_c - w_star) < 0.1
