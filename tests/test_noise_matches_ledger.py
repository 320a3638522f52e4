"""The noise each system adds has the std its recorded ledger event implies.

Every mechanism goes through :mod:`flwr_jdp.privacy.mechanisms`; here each system's
production path runs with its data signal removed (zero contributions), so what it
releases is its noise alone, and the measured std is compared with
``z * sensitivity / denominator`` where ``z`` (and the sampling rate, where there is
one) is read back from the event the strategy recorded in its ledger, and the
sensitivity is the clipping bound of the unit's contribution. The tolerance is a
few standard errors of a sample std (``1/sqrt(2n)`` for Gaussian noise), below
0.25, so noise cut by 2 (or 10) cannot pass.

JointDP's central releases are checked the same way in
``tests/test_trainer_sensitivity_and_state.py``
(``test_central_noise_std_is_the_ledgers_z_times_c_over_the_expected_count``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.privacy import mechanisms
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger, owner_scope

from .helpers import run_inprocess

#: Standard errors of a sample std allowed either way.
K = 6.0


def _leaves(event: dict, q: float = 1.0, count: int = 1) -> list[tuple[str, float, float, int]]:
    """``(class, z, sampling rate, self-compositions)`` of every Gaussian/Laplace
    leaf of a recorded event (``to_dict`` form), in order."""
    name = event["class_name"]
    if name in ("GaussianDpEvent", "LaplaceDpEvent"):
        return [(name, float(event["noise_multiplier"]), q, count)]
    if name == "PoissonSampledDpEvent":
        return _leaves(event["event"], q * float(event["sampling_probability"]), count)
    if name == "SelfComposedDpEvent":
        return _leaves(event["event"], q, count * int(event["count"]))
    if name == "ComposedDpEvent":
        return [leaf for e in event["events"] for leaf in _leaves(e, q, count)]
    raise AssertionError(f"unexpected event {name}")


def _scope_leaves(scopes: dict, scope: str) -> list[tuple[str, float, float, int]]:
    """The leaves of every charge of ``scope`` (a charge recorded ``c`` times: ``c`` copies)."""
    return [leaf for event, count in scopes[scope] for _ in range(int(count)) for leaf in _leaves(event)]


def _check_std(noise: np.ndarray, expected: float, laplace: bool = False, what: str = "") -> None:
    noise = np.asarray(noise, dtype=np.float64).ravel()
    n = noise.size
    # relative standard error of a sample std: sqrt((kurtosis - 1) / (4 n))
    tol = K * math.sqrt((5.0 if laplace else 2.0) / (4.0 * n))
    assert tol < 0.25, f"{what}: too few draws ({n}) to tell a 2x noise cut"
    measured = float(np.sqrt(np.mean(noise ** 2)))  # mean 0 by construction
    assert measured == pytest.approx(expected, rel=tol), (
        f"{what}: noise std {measured:.5g} != {expected:.5g} implied by the ledger "
        f"(ratio {measured / expected:.3f}, n={n})")


# ------------------------------------------------------------- JointDP, local noise


@pytest.mark.parametrize("unit", ["record", "owner"])
def test_joint_dp_local_noise_std_is_each_owners_recorded_event(run_config, unit, monkeypatch):
    """Local placement, through the project's ClientApp (``run_inprocess``: the real
    :class:`JointDP` against ``client_app``, whose owners release through
    :meth:`JointDPClient.train` around the app's ``task.train``), each owner's data
    signal removed (record unit: every clipped per-record gradient sum of the DP step
    is zero; owner unit: the app's local training leaves the model as it came). Each
    owner's release minus the broadcast is then its noise alone:

    - record unit: ``steps`` DP-SGD steps of ``task.train``'s plain SGD, each
      ``-lr N(0, (z C)^2) / (q n_o)``, std ``lr z C sqrt(steps) / (q n_o)`` with
      ``(z, q, steps)`` of the owner's recorded
      ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)``;
    - owner unit: the clipped update plus ``N(0, (z C)^2)``, ``Gaussian(z)`` recorded.
    """
    from apps.joint_dp.joint_dp import client_app
    from apps.joint_dp.joint_dp.task import owner_data
    from flwr_jdp.training.dp_pass import step

    if unit == "record":  # the DP step's clipped sum (the optimizer pre-step hook's)
        monkeypatch.setattr(step, "batch_sums",
                            lambda params, batch, c: [torch.zeros_like(p) for p in params])
    else:  # the app's own train function, as the owner-unit release calls it
        monkeypatch.setattr(client_app, "train", lambda *args, **kwargs: None)
    run_config.update({"privacy-unit": unit, "noise-placement": "local", "num-rounds": 1,
                       "clipping-norm": 0.7, "learning-rate": 0.3, "batch-size": 128,
                       "accountant": "rdp"})  # the ledger's epsilon in ms (PLD: seconds)
    cfg = parse_config(run_config)
    noise: dict[int, np.ndarray] = {}

    def capture(instruction, reply):  # noqa: ANN001, ANN202
        if instruction.metadata.message_type != "train" or reply.has_error():
            return reply
        shared = instruction.content[protocol.SHARED]
        for key in reply.content.keys():
            o = protocol.parse_owner_key(key)
            if o is None:
                continue
            rec = reply.content[key]
            parts = []
            for name in rec.keys():
                released = rec[name].numpy().astype(np.float64)
                base = 0.0 if unit == "owner" else shared[name].numpy().astype(np.float64)
                parts.append((released - base).ravel())
            noise[o] = np.concatenate(parts)
        return reply

    run_inprocess(run_config, fault=capture)
    ledger = json.loads((Path(run_config["results-dir"]) / "ledger.json").read_text())
    sizes = {o: len(d.y_train) for o, d in enumerate(owner_data(cfg))}
    assert sorted(noise) == sorted(sizes) and len(noise) == cfg.num_owners
    normalised = []
    for o, draws in noise.items():
        ((cls, z, q, steps),) = _scope_leaves(ledger["scopes"], owner_scope(o))
        assert cls == "GaussianDpEvent" and z > 0
        if unit == "record":
            expected = cfg.learning_rate * z * cfg.clipping_norm * math.sqrt(steps) / (q * sizes[o])
        else:
            assert q == 1.0 and steps == 1
            expected = z * cfg.clipping_norm
        _check_std(draws, expected, what=f"owner {o}")
        normalised.append(draws / expected)
    _check_std(np.concatenate(normalised), 1.0, what="all owners")


# ------------------------------------------------------------------------ DP-MTL


@pytest.mark.parametrize("mode,relation,q", [("tight", "replace-one", 1.0), ("tight", "add-remove", 0.5),
                                             ("paper", "replace-one", 1.0)])
def test_dp_mtl_mean_noise_std_is_the_recorded_event(tmp_path, mode, relation, q, monkeypatch):
    """The DP-MTL strategy on an in-process grid, every task's sent model replaced by
    zeros: each released mean ``w~`` is the noise alone, std ``z B / (q m)`` with ``z``
    and ``q`` of the recorded event (``B`` the ball radius, the add/remove
    sensitivity the event is relative to). In ``paper`` mode the ledger records
    half the multiplier (Theorem 1's constant), so the noise is twice the recorded one.
    The tight calibration (tested in ``test_mtl.py``; seconds of PLD) is replaced by a
    fixed ``z = 10``: what is checked here is the noise against the recorded event."""
    from apps.dp_mtl.dp_mtl.client_app import client
    from flwr_jdp.mtl import noise as mtl_noise
    from flwr_jdp.mtl.config import parse_mtl_config
    from flwr_jdp.strategies import DPMeanRegularizedMTL
    from flwr_jdp.strategies import dp_mtl as dp_mtl_module

    def fixed_sigma(eps, delta, radius, rounds, num_tasks, sample_rate=1.0, *args, **kwargs):  # noqa: ANN001, ANN202
        return 10.0 * radius / (sample_rate * num_tasks)

    monkeypatch.setattr(mtl_noise, "tight_sigma", fixed_sigma)
    monkeypatch.setattr(dp_mtl_module, "tight_sigma", fixed_sigma)

    rc = {"num-tasks": 12, "samples-per-task": 5, "dim": 399, "rounds": 3, "target-epsilon": 3.0,
          "calibration": mode, "neighbouring": relation, "fraction-train": q, "noise-seed": 4,
          "results-dir": str(tmp_path / "res"), "resume": False, "finetune-steps": 0}
    source, cfg, extras = parse_mtl_config(rc)
    means: dict[int, np.ndarray] = {}  # round -> the mean broadcast for evaluation

    def zero_models(instruction, reply):  # noqa: ANN001, ANN202
        kind = instruction.metadata.message_type
        rnd = int(instruction.content["config"]["round"])
        if kind == "evaluate" and rnd >= 1:
            means.setdefault(rnd, instruction.content["mean"]["mean"].numpy().copy())
        if kind == "train" and not reply.has_error() and "models" in reply.content:
            rec = reply.content["models"]
            for key in list(rec.keys()):
                rec[key] = Array(np.zeros_like(rec[key].numpy()))
        return reply

    strategy = DPMeanRegularizedMTL(source.num_tasks, source.model().num_params, cfg, extras["results-dir"],
                                    noise_seed=4, run_config=rc, resume=False)
    strategy.start(InProcessGrid(client, 2, rc, fault=zero_models))
    ledger = json.loads((tmp_path / "res" / "ledger.json").read_text())
    leaves = _scope_leaves(ledger["scopes"], SERVER_SCOPE)
    assert len(leaves) == cfg.rounds and len(set(leaves)) == 1  # one release a round, all alike
    cls, z, rate, count = leaves[0]
    assert cls == "GaussianDpEvent" and count == 1 and rate == pytest.approx(q)
    implied = z * cfg.radius / (rate * source.num_tasks)
    assert sorted(means) == list(range(1, cfg.rounds + 1))
    _check_std(np.concatenate(list(means.values())), implied * (2.0 if mode == "paper" else 1.0), what=f"DP-MTL {mode}")


# ------------------------------------------------------------------- Priv-AltMin


def test_priv_altmin_release_noise_std_is_the_recorded_events(monkeypatch):
    """PrivAltMin charges each round as ``start`` does, then releases from all-zero
    sums (no replies): the initialisation matrix is symmetric with Wigner noise of
    std ``z_0 S_0`` per upper-triangle entry, epoch 1's ``A`` likewise with
    ``z_A S_A`` and ``b`` with ``z_b S_b``, each ``z`` read from the ledger and each
    ``S`` the clipping bound of one user's statistic."""
    from flwr_jdp.altmin import algorithm
    from flwr_jdp.altmin.config import parse_altmin_config
    from flwr_jdp.strategies import PrivAltMin

    spec, cfg, _ = parse_altmin_config({"num-users": 200, "dim": 30, "rank": 2, "epochs": 1,
                                        "target-epsilon": 4.0, "clip-a": 80.0, "a-share": 0.3,
                                        "u-step": "statistics", "accountant": "rdp"})
    released: dict[str, list[np.ndarray]] = {"init": [], "a": [], "b": []}
    init, sums = algorithm.embedding_from_init, algorithm.embedding_from_sums

    def spy_init(m, rank):  # noqa: ANN001, ANN202
        released["init"].append(m.copy())
        return init(m, rank)

    def spy_sums(a, b, *args, **kwargs):  # noqa: ANN001, ANN202
        released["a"].append(a.copy())
        released["b"].append(b.copy())
        return sums(a, b, *args, **kwargs)

    monkeypatch.setattr(algorithm, "embedding_from_init", spy_init)
    monkeypatch.setattr(algorithm, "embedding_from_sums", spy_sums)
    strategy = PrivAltMin(spec, cfg, noise_seed=3)
    events = strategy.release_events()
    zs = {}
    for rnd, names in ((0, ("init",)), (1, ("a", "b"))):
        strategy.ledger = PrivacyLedger(delta=cfg.delta, unit="user")
        strategy._charge(rnd, events)  # noqa: SLF001 - as start() does before the round
        leaves = _scope_leaves(strategy.ledger.scopes, SERVER_SCOPE)
        assert [leaf[0] for leaf in leaves] == ["GaussianDpEvent"] * len(names)
        assert all(leaf[2] == 1.0 and leaf[3] == 1 for leaf in leaves)
        zs.update({name: leaf[1] for name, leaf in zip(names, leaves, strict=True)})
        for _ in range(20):
            strategy.aggregate_train(rnd, [])
    assert zs["a"] != zs["b"]  # a-share 0.3: the two epoch releases differ, and are told apart
    s_init = cfg.init_clip(spec.samples_per_user)
    s_a, s_b = cfg.clips(0)
    for name, z, s in (("init", zs["init"], s_init), ("a", zs["a"], s_a)):
        mats = np.stack(released[name])
        assert np.array_equal(mats, mats.transpose(0, 2, 1))  # symmetric (Wigner) noise
        iu = np.triu_indices(mats.shape[1])
        _check_std(mats[:, iu[0], iu[1]], z * s, what=f"Priv-AltMin {name}")
    _check_std(np.stack(released["b"]), zs["b"] * s_b, what="Priv-AltMin b")
    whole = PrivacyLedger(delta=cfg.delta, unit="user", accountant="rdp")
    for rnd in (0, 1):
        strategy.ledger = whole
        strategy._charge(rnd, events)  # noqa: SLF001
    assert whole.epsilon() <= cfg.target_epsilon * (1 + 1e-6)  # the noise measured is the noise calibrated


# ---------------------------------------------------------------- winsorized mean

N_USERS = 256


def _zero_client() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context):  # noqa: ANN001, ANN202
        w = msg.content["arrays"]["w"].numpy()
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w.copy())}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return app


@pytest.mark.parametrize("kind,dim", [("gaussian", 64), ("laplace", 16)])
def test_winsorized_mean_noise_std_is_the_recorded_events(kind, dim, monkeypatch):
    """The winsorized-mean strategy wrapper, every client's update zero: the released
    update is the mean release's noise alone (rotated back, which keeps the std).
    With ``(z_range, z_mean)`` from the recorded ``Composed([range, mean])`` event,
    ``r = 2.5 tau_inf`` and ``d`` coordinates, the mean noise has std
    ``z_mean 2 r sqrt(d) / n`` (Gaussian) or ``sqrt(2) z_mean 2 r d / n`` (Laplace,
    L1); the noisy counts of the range step (read from the mechanism's output) have
    std ``z_range sqrt(2 d)`` or ``sqrt(2) z_range 2 d``. One round goes through the
    grid and the ledger; more draws call the strategy's estimator as
    ``aggregate_train`` does (``dim`` a power of two: the rotation pads nothing)."""
    from flwr_jdp.strategies.winsorized import DifferentialPrivacyWinsorizedMean
    from flwr_jdp.winsorized.estimator import RADIUS_FACTOR, WinsorizedMean, histogram, rotated_radius

    counts_noise = []
    cls = mechanisms.LaplaceSumMechanism if kind == "laplace" else mechanisms.GaussianSumMechanism
    release = cls.release_numpy

    def spy(self, sums, rng):  # noqa: ANN001, ANN202
        out = release(self, sums, rng)
        if self.denominator == 1.0 and np.ndim(sums[0]) == 2:  # the range step's counts
            counts_noise.append(out[0] - sums[0])
        return out

    monkeypatch.setattr(cls, "release_numpy", spy)
    tau = 0.05
    estimator = WinsorizedMean(bound=1.0, tau=tau, range_noise=0.5, mean_noise=0.8, kind=kind)
    ledger = PrivacyLedger(delta=1e-5, unit="user")
    fedavg = FedAvg(fraction_train=1.0, min_train_nodes=N_USERS, min_available_nodes=N_USERS)
    strategy = DifferentialPrivacyWinsorizedMean(fedavg, estimator, N_USERS, ledger=ledger, noise_seed=2)
    grid = InProcessGrid(_zero_client(), N_USERS, {})
    arrays = ArrayRecord({"w": Array(np.zeros(dim))})
    replies = grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    new, _ = strategy.aggregate_train(1, replies)
    noise = [new["w"].numpy()]
    draws = 200 if kind == "laplace" else 20
    noise += [np.asarray(strategy.estimator.estimate(np.zeros((N_USERS, dim)), strategy.rng))
              for _ in range(draws)]
    ((cls_range, z_range, q1, n1), (cls_mean, z_mean, q2, n2)) = _scope_leaves(ledger.scopes, SERVER_SCOPE)
    want = "LaplaceDpEvent" if kind == "laplace" else "GaussianDpEvent"
    assert cls_range == cls_mean == want and q1 == q2 == 1.0 and n1 == n2 == 1
    assert (z_range, z_mean) == (0.5, 0.8)
    tau_inf = rotated_radius(tau, N_USERS, dim, estimator.beta)
    radius = RADIUS_FACTOR * tau_inf
    laplace = kind == "laplace"
    mean_sens = 2 * radius * (dim if laplace else math.sqrt(dim))
    range_sens = 2 * dim if laplace else math.sqrt(2 * dim)
    factor = math.sqrt(2.0) if laplace else 1.0  # a Laplace of scale b has std sqrt(2) b
    _check_std(np.stack(noise), factor * z_mean * mean_sens / N_USERS, laplace, f"winsorized {kind} mean")
    assert len(counts_noise) == 1 + draws
    assert counts_noise[0].shape == histogram(np.zeros((1, dim)), 1.0, tau_inf)[1].shape
    _check_std(np.stack(counts_noise), factor * z_range * range_sens, laplace, f"winsorized {kind} range")


# ------------------------------------------------------------------ subject level


@pytest.mark.parametrize("method", ["local-item-dp", "higradavg-dp"])
def test_subject_level_silo_noise_std_is_the_recorded_events(method):
    """A silo round as the subject-level ClientApp runs it (the plan's ``z`` and the
    silo's rate), on all-zero features and a bias-free model (zero gradients): the
    change of the weights is the noise alone, ``lr z C sqrt(steps) / (q u)``, with
    ``z`` of every Gaussian in the events the strategy charges (local-item-dp also
    ``q`` and ``steps``: ``SelfComposed(PoissonSampled(q, Gaussian(z)), steps)``)."""
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
    from flwr_jdp.subject.config import SubjectDPConfig
    from flwr_jdp.subject.plan import make_plan
    from flwr_jdp.subject.silo_data import SiloData
    from flwr_jdp.training.subject_level import SiloPlan, train_silo_round

    records, subjects_per_silo = 60, 12
    counts = np.full((subjects_per_silo * 2, 2), 0, dtype=np.int64)
    counts[:subjects_per_silo, 0] = records // subjects_per_silo
    counts[subjects_per_silo:, 1] = records // subjects_per_silo
    cfg = SubjectDPConfig(method=method, accounting="exact", target_epsilon=4.0, budget_rounds=3,
                          batch_size=15, local_steps=2, learning_rate=0.5, clipping_norm=0.3,
                          num_silos=2, results_dir="", noise_multiplier=1.3,  # given z: no calibration
                          max_records_per_subject=0)  # reported counts
    strategy = SubjectLevelFedAvg(cfg, nn.Linear(4, 2), accountant="rdp")
    strategy.counts, strategy.plan = counts, make_plan(cfg, counts, accountant="rdp")
    events = strategy.round_events()
    leaves = [leaf for e in events.values() for leaf in _leaves(_to_dict(e))]
    assert leaves and {leaf[0] for leaf in leaves} == {"GaussianDpEvent"}
    zs = {leaf[1] for leaf in leaves}
    assert len(zs) == 1
    z = zs.pop()
    q = strategy.plan.sample_rates[0]
    if method == "local-item-dp":
        ((_, _, q_rec, steps),) = _leaves(_to_dict(events["silo/0"]))
        assert q_rec == q and steps == cfg.local_steps
    subject = np.repeat(np.arange(subjects_per_silo), records // subjects_per_silo)
    data = SiloData.from_numpy(np.zeros((records, 4)), np.zeros(records, dtype=int), subject)
    model = nn.Linear(4, 3000, bias=False)
    nn.init.zeros_(model.weight)
    plan = SiloPlan(cfg.method, q, cfg.local_steps, cfg.learning_rate, cfg.clipping_norm, z)
    train_silo_round(model, data, plan, torch.Generator().manual_seed(0))
    expected = cfg.learning_rate * z * cfg.clipping_norm * math.sqrt(cfg.local_steps) / (q * records)
    _check_std(model.weight.detach().numpy(), expected, what=f"subject-level {method}")


def test_subject_level_user_ldp_noise_std_is_the_recorded_event():
    """The user-level local-DP baseline (``user-ldp``): each step adds ``N(0, (z 2C)^2)``
    to the clipped batch-mean gradient, with ``z`` the Gaussian of the event charged
    for every subject; on zero gradients the weights move by ``lr z 2C sqrt(steps)``."""
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
    from flwr_jdp.subject.config import SubjectDPConfig
    from flwr_jdp.subject.plan import make_plan
    from flwr_jdp.subject.silo_data import SiloData
    from flwr_jdp.training.subject_level import SiloPlan, train_silo_round

    records, subjects_per_silo = 60, 12
    counts = np.zeros((subjects_per_silo * 2, 2), dtype=np.int64)
    counts[:subjects_per_silo, 0] = records // subjects_per_silo
    counts[subjects_per_silo:, 1] = records // subjects_per_silo
    cfg = SubjectDPConfig(method="user-ldp", accounting="exact", target_epsilon=4.0, budget_rounds=3,
                          batch_size=15, local_steps=2, learning_rate=0.5, clipping_norm=0.3,
                          num_silos=2, results_dir="", noise_multiplier=1.3, max_records_per_subject=0)
    strategy = SubjectLevelFedAvg(cfg, nn.Linear(4, 2), accountant="rdp")
    strategy.counts, strategy.plan = counts, make_plan(cfg, counts, accountant="rdp")
    leaves = [leaf for e in strategy.round_events().values() for leaf in _leaves(_to_dict(e))]
    assert leaves and {leaf[0] for leaf in leaves} == {"GaussianDpEvent"}
    ((z,),) = {(leaf[1],) for leaf in leaves}
    assert z == 1.3
    subject = np.repeat(np.arange(subjects_per_silo), records // subjects_per_silo)
    data = SiloData.from_numpy(np.zeros((records, 4)), np.zeros(records, dtype=int), subject)
    model = nn.Linear(4, 3000, bias=False)
    nn.init.zeros_(model.weight)
    plan = SiloPlan(cfg.method, strategy.plan.sample_rates[0], cfg.local_steps, cfg.learning_rate,
                    cfg.clipping_norm, z)
    train_silo_round(model, data, plan, torch.Generator().manual_seed(0))
    expected = cfg.learning_rate * z * 2 * cfg.clipping_norm * math.sqrt(cfg.local_steps)
    _check_std(model.weight.detach().numpy(), expected, what="subject-level user-ldp")


def _to_dict(event):  # noqa: ANN001, ANN202
    from flwr_jdp.privacy import events as ev

    return ev.to_dict(event)
