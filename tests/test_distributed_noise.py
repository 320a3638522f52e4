"""Distributed noise (``noise-placement = "distributed"``): Skellam shares summed by
Flower's SecAgg+, as the server and an attacker see it.

Every pipeline test runs the real :class:`JointDP` strategy against a ClientApp written
as a user's (:class:`JointDPClient` on a small probe model, one owner per node) on an
in-process grid: the owners' DP pass, rounding and noise shares, Flower's
``secaggplus_mod`` on every node, and the strategy's SecAgg+ stages
(:class:`~flwr_jdp.strategies.joint_dp.secagg.SecureSum`) and decoding.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from scipy.stats import skellam
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flwr_jdp.joint_dp.distributed as distributed
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient, owner_id
from flwr_jdp.joint_dp.config import ConfigError, namespaced_config
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.skellam import (
    MODULUS,
    SkellamDpEvent,
    SkellamPlan,
    event_rdp,
    from_field,
    round_units,
    skellam_rdp,
)
from flwr_jdp.strategies import JointDP

DIM, HIDDEN, CLASSES, RECORDS = 32, 64, 3, 24


class Probe(nn.Module):
    """A user's model: ``body`` shared, ``head`` personal."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(DIM, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _data(owner: int) -> DataLoader:
    g = torch.Generator().manual_seed(100 + owner)
    x, y = torch.randn(RECORDS, DIM, generator=g), torch.randint(0, CLASSES, (RECORDS,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _train_fn(net: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def user_app() -> ClientApp:
    """A user's ClientApp converted as the README shows: nothing in it says which
    noise placement the run uses."""
    app = ClientApp()
    jdp = JointDPClient(app, model_fn=Probe, train_data=lambda ctx: _data(owner_id(ctx)))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return jdp.train(msg, context, Probe(), _data(owner_id(context)), _train_fn)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = jdp.load(Probe(), msg, context)
        x, y = _data(owner_id(context)).dataset.tensors
        acc = float((model(x).argmax(1) == y).float().mean())
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": acc, "num-examples": len(y)})}),
                       reply_to=msg)

    return app


def _rc(owners: int, **over: object) -> dict:
    rc = {"jdp.personal-layers": r"^head\.", "jdp.noise-placement": "distributed", "jdp.num-owners": owners,
          "jdp.num-rounds": 2, "jdp.batch-size": 8, "jdp.target-epsilon": 8.0, "jdp.clipping-norm": 1.0,
          "jdp.learning-rate": 0.5, "jdp.dropout-tolerance": 0.0, "jdp.noise-seed": 5}
    rc.update({f"jdp.{k}" if not k.startswith("jdp.") else k: v for k, v in over.items()})
    return rc


def _initial() -> object:
    return protocol.to_record({n: p.detach().numpy() for n, p in Probe().named_parameters()})


class Spy:
    """Records what each owner encodes: its integer sum, its field vector, and the
    noise it added (the difference of the two, modulo 2**31)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.vectors: list[dict] = []

        def encode(integer_sum, plan, rng):  # noqa: ANN001, ANN202
            out = distributed.encode_release(integer_sum, plan, rng)  # looked up now: a mutant may replace it
            ints = [np.rint(a).astype(np.int64) for a in integer_sum]
            self.vectors.append({"ints": ints, "field": out, "plan": plan,
                                 "noise": [from_field(f - i) for f, i in zip(out, ints, strict=True)]})
            return out

        monkeypatch.setattr("flwr_jdp.joint_dp.client.encode_release", encode)


def _round(rc: dict, nodes: int, fault=None, rounds: int = 1, errors_as_replies: bool = True):  # noqa: ANN001
    rc = {**rc, "jdp.num-rounds": rounds}
    grid = InProcessGrid(user_app(), nodes, rc, fault=fault, errors_as_replies=errors_as_replies)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    result = strategy.start(grid=grid, initial_arrays=_initial())
    return strategy, grid, result


def _masked_replies(grid: InProcessGrid) -> dict[int, list[np.ndarray]]:
    out = {}
    for reply in grid.sent:
        rec = reply.content.config_records.get(RECORD_KEY_CONFIGS) if reply.has_content() else None
        if rec is not None and Key.MASKED_PARAMETERS in rec:
            out[reply.metadata.src_node_id] = [bytes_to_ndarray(b) for b in rec[Key.MASKED_PARAMETERS]]
    return out


# ------------------------------------------------------------------ the pipeline
def test_server_holds_only_masked_vectors_and_their_sum_decodes_exactly(tmp_path, monkeypatch):
    """Three owners on three nodes, one round. What each node sends the server is
    masked: uniform-looking field elements uncorrelated with the owner's vector; the
    server's decoded sum equals the owners' integer sums plus their noise shares,
    exactly (modulo 2**31), and is within rounding of the clipped sums."""
    spy = Spy(monkeypatch)
    rc = _rc(3, **{"results-dir": str(tmp_path)})
    strategy, grid, _ = _round(rc, 3)
    masked = _masked_replies(grid)
    assert len(masked) == 3 and len(spy.vectors) == 3
    # the replies carry nothing per owner but the masked vector (no num-examples, no metrics)
    for reply in grid.sent:
        if reply.has_content() and Key.MASKED_PARAMETERS in reply.content.config_records.get(RECORD_KEY_CONFIGS, {}):
            assert not any(len(r) for r in reply.content.array_records.values())
            assert all(r["num_examples"] == 1 for r in reply.content.metric_records.values())
    fields = sorted((np.concatenate([a.ravel() for a in v["field"]]) for v in spy.vectors), key=lambda a: a[0])
    for vec in masked.values():
        body = np.concatenate([a.ravel() for a in vec[1:]]).astype(np.int64)
        assert body.min() >= 0 and body.max() < MODULUS
        for own in fields:  # no node's vector shows through its masked reply
            assert not np.array_equal(body, own)
            corr = np.corrcoef(body.astype(float), own.astype(float))[0, 1]
            assert abs(corr) < 0.5
        assert 0.2 * MODULUS < body.mean() < 0.8 * MODULUS  # mask-dominated, not near 0 or M
    # The sum of the masked vectors is not the sum either: the private masks remain until unmasked
    raw = sum(np.concatenate([a.ravel() for a in vec[1:]]).astype(np.int64) for vec in masked.values()) % MODULUS
    total = sum(fields) % MODULUS
    assert not np.array_equal(raw, total)
    # ... and once unmasked it is exactly the owners' integer sums plus their noise
    decoded = np.concatenate([a.ravel() for a in strategy._secure.total[1:]])
    assert np.array_equal(decoded, total)
    ints = sum(np.concatenate([a.ravel() for a in v["ints"]]) for v in spy.vectors)
    noise = sum(np.concatenate([a.ravel() for a in v["noise"]]) for v in spy.vectors)
    assert np.array_equal(from_field(decoded), ints + noise)


def test_rounded_sum_is_the_clipped_sum_within_rounding():
    """Each unit's rounded vector has norm <= delta_2 and is within sqrt(d) of gamma g."""
    rng = np.random.default_rng(0)
    plan = SkellamPlan(1.0, 1000.0, 50, 1.0, 4, 4)
    rows = rng.normal(size=(30, 50))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)  # norm C = 1
    rounded = round_units(rows * plan.scale, plan.delta_2, rng)
    assert (np.linalg.norm(rounded, axis=1) <= plan.delta_2 + 1e-9).all()
    assert (np.abs(rounded - rows * plan.scale) < 1).all()
    assert abs(rounded.sum(0) / plan.scale - rows.sum(0)).max() < 30 / plan.scale


# ------------------------------------------------------------------ the noise
def _measured_noise(monkeypatch, tmp_path, nodes: int = 4, rounds: int = 2) -> tuple[float, float, float]:
    """(measured variance of the server's decoded noise per coordinate, the variance
    the honest survivors bring by the ledger's event, the event's mu) over ``rounds``
    rounds of ``nodes`` owners."""
    spy = Spy(monkeypatch)
    rc = _rc(nodes, **{"results-dir": str(tmp_path), "noise-multiplier": 0.5, "target-epsilon": 1e6})
    strategy, _, _ = _round(rc, nodes, rounds=rounds)
    noise = []
    for r in range(rounds):
        vecs = spy.vectors[r * nodes:(r + 1) * nodes]
        noise.append(sum(np.concatenate([a.ravel() for a in v["noise"]]) for v in vecs))
    measured = float(np.var(np.concatenate(noise)))
    event = strategy.ledger.scope_event("server")
    inner = event
    while not isinstance(inner, SkellamDpEvent):
        inner = inner.events[0] if isinstance(inner, dpa.ComposedDpEvent) else inner.event
    return measured, 2 * inner.mu, inner.mu


def test_noise_variance_matches_the_ledgers_mechanism(monkeypatch, tmp_path):
    """The noise in the decoded sum has the variance of the ledger's Skellam event
    (the shares of the survivors; dropout-tolerance 0: exactly the planned noise)."""
    measured, claimed, _ = _measured_noise(monkeypatch, tmp_path)
    assert measured == pytest.approx(claimed, rel=0.1)


def test_a_tenfold_noise_cut_in_one_owners_share_fails(monkeypatch, tmp_path):
    """An owner whose share is 10x smaller (the mutant) leaves the sum with less
    variance than the ledger claims: the check above fails."""
    real = distributed.encode_release
    cut_owner = []

    def cut(integer_sum, plan, rng):  # noqa: ANN001, ANN202
        import dataclasses

        cut_owner.append(1)
        if len(cut_owner) % 3 == 1:  # one owner of three: its share's mu 10x smaller
            plan = dataclasses.replace(plan, noise_multiplier=plan.noise_multiplier / math.sqrt(10))
        return real(integer_sum, plan, rng)

    monkeypatch.setattr(distributed, "encode_release", cut)
    measured, claimed, _ = _measured_noise(monkeypatch, tmp_path, nodes=3)
    with pytest.raises(AssertionError):
        assert measured == pytest.approx(claimed, rel=0.1)


def test_owner_refuses_a_noise_multiplier_cut_tenfold(tmp_path):
    """The server asks for a tenth of the calibrated noise: every owner checks the
    instruction against its own plan and budget and refuses before reading its data;
    the run fails as it cannot progress, its epsilon charged."""
    rc = _rc(3, **{"results-dir": str(tmp_path), "target-epsilon": 2.0, "max-skipped-rounds": 1})
    grid = InProcessGrid(user_app(), 3, rc, errors_as_replies=True)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    real_configure = strategy.configure_train

    def lying_server(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - charges its ledger, then asks for less
        messages = list(real_configure(*args, **kwargs))
        for m in messages:
            m.content[protocol.CONFIG][protocol.NOISE_MULTIPLIER] /= 10
        return messages

    strategy.configure_train = lying_server
    with pytest.raises(Exception, match="rounds in a row"):
        strategy.start(grid=grid, initial_arrays=_initial())
    assert any("too small" in r for r in strategy.last_drop_reasons), strategy.last_drop_reasons


# ------------------------------------------------------------------ dropouts
def _drop_at(stage: str, nodes: set[int]):  # noqa: ANN202
    def fault(msg, reply):  # noqa: ANN001, ANN202
        rec = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if rec is not None and msg.metadata.dst_node_id in nodes and rec.get(Key.STAGE, stage) == stage:
            if stage == Stage.COLLECT_MASKED_VECTORS and Key.CIPHERTEXT_LIST not in rec:
                return reply
            return None  # the node went silent
        return reply
    return fault


def test_an_owner_dropping_mid_round_leaves_a_completed_run_within_target(tmp_path, monkeypatch):
    """Five owners, dropout-tolerance 0.2 (noise planned for 4 survivors): owner 2's
    node goes silent after sharing its keys, in every round. The server removes its
    masks, the sum is exactly the four survivors' vectors, and the run completes
    within its target epsilon."""
    spy = Spy(monkeypatch)
    rc = _rc(5, **{"results-dir": str(tmp_path), "dropout-tolerance": 0.2, "target-epsilon": 4.0})

    def fault(msg, reply):  # noqa: ANN001, ANN202
        rec = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if msg.metadata.dst_node_id == 1002 and rec is not None and Key.CIPHERTEXT_LIST in rec \
                and Key.DESTINATION_LIST not in rec and Key.SOURCE_LIST in rec:
            return None  # silent at the collect stage (after sharing keys)
        return reply

    strategy, _, _ = _round(rc, 5, fault=fault, rounds=2)
    assert strategy.status == "completed"
    assert [h["valid_owners"] for h in strategy.history] == [4, 4]
    assert strategy.ledger.epsilon() <= 4.0
    survivors = [v for v in spy.vectors[-5:]]
    # owner 2 computed its vector (the fault drops its reply, not its work): the sum is the other four's
    by_owner = {i: np.concatenate([a.ravel() for a in v["field"]]) for i, v in enumerate(survivors)}
    decoded = np.concatenate([a.ravel() for a in strategy._secure.total[1:]])
    expected = sum(vec for i, vec in by_owner.items() if i != 2) % MODULUS
    assert np.array_equal(decoded, expected)


def test_too_many_dropouts_stop_before_unmasking(tmp_path):
    """Two of four owners silent where the noise was planned for four: the server
    stops before the unmask stage (it never learns the sum), the round is skipped and
    charged, and the run fails as it cannot progress."""
    rc = _rc(4, **{"results-dir": str(tmp_path), "num-rounds": 3})
    fault = _drop_at(Stage.COLLECT_MASKED_VECTORS, {1000, 1001})
    grid = InProcessGrid(user_app(), 4, rc, fault=fault, errors_as_replies=True)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    with pytest.raises(Exception, match="rounds in a row"):
        strategy.start(grid=grid, initial_arrays=_initial())
    assert "not unmasked" in strategy._secure.stopped
    assert not any(r.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.NODE_ID_LIST) is not None
                   for r in grid.sent if r.has_content())  # no unmask stage ran
    assert strategy.ledger.epsilon() > 0


def test_a_node_whose_owner_fails_leaves_the_secure_sum_whole(run_config, tmp_path):
    """flwr-jdp's own app, six owners on three nodes: owner 4's train raises in every
    round. Its node must not send its other owner's vector alone (the server counts a
    node's owners as survivors): the whole node leaves, and with dropout-tolerance 0
    the server stops before unmasking."""
    import apps.joint_dp.joint_dp.client_app as own_app
    from apps.joint_dp.joint_dp.server_app import initial_arrays
    from flwr_jdp.joint_dp.config import parse_config

    real = own_app.jdp.train

    def failing(msg, context, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if owner_id(context) == 4:
            raise RuntimeError("owner 4's data breaks its code")
        return real(msg, context, *args, **kwargs)

    own_app.jdp.train = failing
    try:
        rc = {**run_config, "num-owners": 6, "noise-placement": "distributed", "dropout-tolerance": 0.0,
              "num-rounds": 1, "max-skipped-rounds": 1}
        cfg = parse_config(rc)
        grid = InProcessGrid(own_app.app, 3, rc, errors_as_replies=True)
        strategy = JointDP(cfg, node_settle_s=0.0)
        with pytest.raises(Exception, match="rounds in a row"):
            strategy.start(grid=grid, initial_arrays=initial_arrays(cfg))
        assert "not unmasked" in strategy._secure.stopped
        assert any("did not release" in r for r in strategy.last_drop_reasons), strategy.last_drop_reasons
    finally:
        own_app.jdp.train = real


def test_a_node_refuses_a_secure_sum_it_was_not_planned_for():
    """At the set-up stage a node checks the field, the unit weights and the threshold."""
    from flwr.app import ConfigRecord as CR

    from flwr_jdp.joint_dp.secure_sum import _check_setup

    good = {Key.STAGE: Stage.SETUP, Key.CLIPPING_RANGE: float(MODULUS // 2), Key.TARGET_RANGE: MODULUS,
            Key.MOD_RANGE: MODULUS, Key.MAX_WEIGHT: 1.0, Key.THRESHOLD: 3, Key.SAMPLE_NUMBER: 3,
            Key.SHARE_NUMBER: 3}
    _check_setup(CR(good))
    for key, value in ((Key.THRESHOLD, 2), (Key.TARGET_RANGE, 2**22), (Key.MAX_WEIGHT, 1000.0)):
        with pytest.raises(RuntimeError, match="refused"):
            _check_setup(CR({**good, key: value}))


# ------------------------------------------------------------------ accounting
def _exact_rdp_1d(delta: int, mu: float, q: float, alpha: int) -> float:
    """Renyi divergence of order ``alpha`` of the Poisson-subsampled 1-D Skellam
    mechanism with integer shift ``delta``, both directions, by summing the pmfs (in
    log space)."""
    from scipy.special import logsumexp

    k = np.arange(-int(60 * math.sqrt(mu)) - 100, int(60 * math.sqrt(mu)) + 100)
    base = skellam.logpmf(k, mu, mu)
    shifted = skellam.logpmf(k - delta, mu, mu)
    mix = np.logaddexp(np.log1p(-q) + base, math.log(q) + shifted) if q < 1 else shifted
    keep = np.isfinite(base) & np.isfinite(mix)

    def renyi(p: np.ndarray, r: np.ndarray) -> float:
        return float(logsumexp(alpha * p[keep] + (1 - alpha) * r[keep]) / (alpha - 1))

    return max(renyi(mix, base), renyi(base, mix))


@pytest.mark.parametrize("delta,mu,q", [(3, 40.0, 1.0), (3, 40.0, 0.3), (10, 400.0, 0.1)])
def test_accountant_bounds_an_independent_numerical_computation(delta, mu, q):
    """1-D Skellam with integer sensitivity: the RDP the ledger uses (Agarwal et al.'s
    bound, Zhu and Wang's Poisson subsampling) is at least the exact Renyi divergence
    of the mechanism computed from its pmf, at every order, and the epsilon the
    accountant reports is at least the one the exact curve gives."""
    event = SkellamDpEvent(float(delta), float(delta), float(mu))
    sampled = dpa.PoissonSampledDpEvent(q, event) if q < 1 else event
    orders = np.arange(2, 41)
    ours = event_rdp(sampled, orders)
    exact = np.array([_exact_rdp_1d(delta, mu, q, int(a)) for a in orders])
    assert (ours >= exact - 1e-9).all()
    if q == 1.0:  # unsampled: the bound is close (within 35 % at these small mu, high orders)
        assert (ours <= 1.35 * exact + 1e-6).all()
    steps = 5
    eps_exact, _ = compute_epsilon(list(orders), exact * steps, 1e-5)
    assert epsilon(dpa.SelfComposedDpEvent(sampled, steps), 1e-5) >= eps_exact - 1e-9


def test_skellam_rdp_matches_the_gaussian_for_fine_scales():
    """With a fine scale (delta_2 large) the Skellam bound is the Gaussian's of the same
    variance, up to its small correction terms."""
    plan = SkellamPlan(1.0, 2.0**16, 1000, 1.0, 4, 4)
    for alpha in (2, 10, 50):
        gauss = alpha / (2 * plan.noise_multiplier**2)
        assert skellam_rdp(alpha, plan.delta_2, plan.delta_1, plan.mu) == pytest.approx(gauss, rel=1e-6)


def test_events_round_trip_and_recompute():
    """The ledger stores Skellam events as data and re-accounts them identically."""
    plan = SkellamPlan(1.0, 1000.0, 100, 1.2, 8, 7, 1)
    event = dpa.SelfComposedDpEvent(plan.event(0.2), 4)
    again = ev.from_dict(ev.to_dict(event))
    assert again == event
    assert epsilon(again, 1e-5) == epsilon(event, 1e-5) > 0
    # the honest survivors' noise: (7 - 1) shares of mu / 6
    assert plan.event(0.2).event.mu == pytest.approx(plan.mu)


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("over,key", [
    ({"privacy-unit": "owner"}, "noise-placement"),
    ({"neighbouring": "replace-one"}, "neighbouring"),
    ({"num-owners": 1}, "num-owners"),
    ({"dropout-tolerance": 0.6}, "dropout-tolerance"),
    ({"colluding-owners": 4}, "colluding-owners"),
])
def test_bad_distributed_settings_fail_at_startup_naming_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        namespaced_config(_rc(4, **over))


def test_one_node_hosting_every_owner_is_refused_before_any_release(run_config):
    """flwr-jdp's own app on one SuperNode hosting all four owners: nothing to
    aggregate securely; refused at set-up, nothing spent."""
    from tests.helpers import run_inprocess

    with pytest.raises(ConfigError, match="at least 3 nodes"):
        run_inprocess({**run_config, "noise-placement": "distributed"}, num_nodes=1)


def test_share_is_planned_for_the_fewest_honest_survivors():
    plan = SkellamPlan(1.0, 1000.0, 100, 1.0, num_owners=10, min_survivors=8, colluding=2)
    assert plan.share_mu * 6 == pytest.approx(plan.mu)
