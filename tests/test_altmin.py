"""Priv-AltMin: sensitivities, releases, solver, accounting, Flower equivalence."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant

from flwr_jdp.altmin.algorithm import AltMinConfig, client_statistics, run_single_process
from flwr_jdp.altmin.config import parse_altmin_config
from flwr_jdp.altmin.exponential import scores, sphere_net
from flwr_jdp.altmin.plan import BudgetSplit, NoisePlan, calibrate_plan
from flwr_jdp.altmin.problem import ProblemSpec, Users, all_users, true_embedding
from flwr_jdp.altmin.release import GaussianRelease, wigner
from flwr_jdp.altmin.solver import embedding_from_sums, newton_update, orthonormal, subspace_distance
from flwr_jdp.altmin.statistics import SampleSplit, init_statistic
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger


def adversarial_users(n: int = 40, m: int = 10, d: int = 6, seed: int = 0) -> Users:
    """Users with wild scales: huge features, huge labels, zeros, duplicated samples."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 4, size=(n, 1, 1))
    x = rng.standard_normal((n, m, d)) * scale
    x[0] = 0.0
    x[1] = x[1, :1]  # one sample repeated m times
    y = rng.standard_normal((n, m)) * 10.0 ** rng.uniform(-3, 5, size=(n, 1))
    y[2] = 1e9
    return Users(np.arange(n), x, y, rng.standard_normal((n, 2)))


@pytest.mark.parametrize("u_step", ["newton", "statistics"])
def test_per_user_contribution_bounded_and_removal_sensitivity(u_step):
    users = adversarial_users()
    emb = orthonormal(np.random.default_rng(1).standard_normal((6, 2)))
    cfg = AltMinConfig(u_step=u_step, clip_a=3.0, clip_b=2.0, clip_g=1.5, clip_decay=0.5, zeta=1.0)
    for epoch in (0, 2):
        s_a, s_2 = cfg.clips(epoch)
        full = client_statistics(users, emb, cfg, epoch)
        for j in range(len(users)):
            one = Users(users.ids[j:j + 1], users.x[j:j + 1], users.y[j:j + 1], users.v_true[j:j + 1])
            alone = client_statistics(one, emb, cfg, epoch)
            assert np.linalg.norm(alone.a) <= s_a * (1 + 1e-9)
            assert np.linalg.norm(alone.b) <= s_2 * (1 + 1e-9)
            keep = np.arange(len(users)) != j
            rest = Users(users.ids[keep], users.x[keep], users.y[keep], users.v_true[keep])
            without = client_statistics(rest, emb, cfg, epoch)
            # the upper triangle's L2 change is bounded by the Frobenius change
            assert np.linalg.norm(np.triu(full.a - without.a)) <= s_a * (1 + 1e-6)
            assert np.linalg.norm(full.b - without.b) <= s_2 * (1 + 1e-6)


def test_init_statistic_bounded_per_user():
    users = adversarial_users()
    for clip in (0.5, 5.0 * 1.0):
        for j in range(len(users)):
            one = Users(users.ids[j:j + 1], users.x[j:j + 1], users.y[j:j + 1], users.v_true[j:j + 1])
            m_j = init_statistic(one, zeta=1.0, clip_init=clip, split=SampleSplit("full"))
            assert np.allclose(m_j, m_j.T)
            assert np.linalg.norm(m_j) <= clip * (1 + 1e-9)
    # the paper's bound (m/2) zeta^2 holds without extra clipping
    m_all = [init_statistic(Users(users.ids[j:j + 1], users.x[j:j + 1], users.y[j:j + 1], users.v_true[j:j + 1]),
                            zeta=1.0, clip_init=np.inf, split=SampleSplit("full")) for j in range(len(users))]
    assert max(np.linalg.norm(m) for m in m_all) <= 5.0 * (1 + 1e-9)


def test_wigner_noise_symmetric_with_stated_variance():
    rng = np.random.default_rng(0)
    std = 2.5
    samples = np.stack([wigner(8, std, rng) for _ in range(4000)])
    assert np.array_equal(samples, samples.transpose(0, 2, 1))
    iu = np.triu_indices(8)
    upper = samples[:, iu[0], iu[1]]
    assert abs(upper.std() / std - 1.0) < 0.02
    assert abs(np.diagonal(samples, axis1=1, axis2=2).std() / std - 1.0) < 0.03
    # distinct upper entries are uncorrelated
    corr = np.corrcoef(upper[:, 1], upper[:, 2])[0, 1]
    assert abs(corr) < 0.06
    rel = GaussianRelease(1.7, 3.0, symmetric=True)
    assert rel.std == pytest.approx(5.1)
    assert rel.event() == dpa.GaussianDpEvent(1.7)


def test_solvers_return_orthonormal_embeddings():
    rng = np.random.default_rng(3)
    d, k = 7, 3
    a = rng.standard_normal((d * k, d * k))
    b = rng.standard_normal(d * k)
    for u in (embedding_from_sums(a, b, d, k, noise_std_a=0.3),
              newton_update(orthonormal(rng.standard_normal((d, k))), a + a.T, b, 0.3)):
        assert u.shape == (d, k)
        assert np.allclose(u.T @ u, np.eye(k), atol=1e-10)


def test_ledger_epsilon_matches_dp_accounting_reference():
    split = BudgetSplit(epochs=5, init_share=0.2, a_share=0.3)
    plan = calibrate_plan(split, 5.0, 1e-6)
    assert sum(split.shares()) == pytest.approx(1.0)
    ledger = PrivacyLedger(delta=1e-6, unit="user")
    for event in plan.events():
        ledger.record(SERVER_SCOPE, event)
    reference = PLDAccountant()
    reference.compose(dpa.ComposedDpEvent(plan.events()))
    ref_eps = reference.get_epsilon(1e-6)
    assert ledger.epsilon() == pytest.approx(ref_eps, rel=2e-3)
    assert ledger.epsilon() <= 5.0 + 1e-9
    # Gaussian releases compose to one Gaussian with 1/z^2 = sum 1/z_r^2
    single = PLDAccountant()
    single.compose(dpa.GaussianDpEvent(plan.noise_multiplier))
    assert single.get_epsilon(1e-6) == pytest.approx(ref_eps, rel=2e-3)
    assert plan.zcdp == pytest.approx(1 / (2 * plan.noise_multiplier ** 2))
    assert NoisePlan(split, plan.noise_multiplier).epsilon(1e-6, "rdp") >= ledger.epsilon()


def test_nonprivate_altmin_recovers_embedding_without_field_noise():
    spec = ProblemSpec(num_users=1000, dim=10, rank=2, field_noise=0.0, seed=4)
    res = run_single_process(spec, all_users(spec), AltMinConfig(epochs=8, target_epsilon=math.inf),
                             np.random.default_rng(0))
    assert res.subspace_distance < 1e-6
    assert res.mse < 1e-10


def test_subspace_distance_shrinks_with_n():
    cfg = AltMinConfig(epochs=3, target_epsilon=2.0, clip_a=60.0, clip_g=3.0)
    means = []
    for n in (1000, 4000, 16000):
        spec = ProblemSpec(num_users=n, dim=10, rank=2, seed=7)
        users = all_users(spec)
        means.append(np.mean([run_single_process(spec, users, cfg, np.random.default_rng(s)).subspace_distance
                              for s in range(3)]))
    assert means[0] > means[1] > means[2]
    assert means[2] < 0.5 * means[0]


def test_config_validation_names_key():
    with pytest.raises(ConfigError, match="clip-decay"):
        parse_altmin_config({"clip-decay": 2.0})
    with pytest.raises(ConfigError, match="u-step"):
        parse_altmin_config({"u-step": "magic"})
    with pytest.raises(ConfigError, match="rank"):
        parse_altmin_config({"rank": 60, "dim": 50})
    with pytest.raises(ConfigError, match="epochs"):
        parse_altmin_config({"epochs": 1.5})
    spec, cfg, extras = parse_altmin_config({"num-users": 1000, "target-epsilon": 2})
    assert spec.num_users == 1000 and cfg.target_epsilon == 2.0 and extras["noise-seed"] == -1


def test_exponential_mechanism_score_sensitivity_and_net_cover():
    rng = np.random.default_rng(0)
    net = sphere_net(3, 0.1)
    probe = rng.standard_normal((500, 3))
    probe /= np.linalg.norm(probe, axis=1, keepdims=True)
    dist = np.minimum(np.linalg.norm(probe[:, None] - net[None], axis=2),
                      np.linalg.norm(probe[:, None] + net[None], axis=2)).min(axis=1)
    assert dist.max() <= 0.1
    users = adversarial_users(n=30, d=3)
    zeta = 2.0
    full = scores(users, net, zeta, clip_feature=3.0, bound_v=3.0)
    for j in (0, 1, 2, 5):
        keep = np.arange(len(users)) != j
        rest = Users(users.ids[keep], users.x[keep], users.y[keep], users.v_true[keep])
        diff = full - scores(rest, net, zeta, clip_feature=3.0, bound_v=3.0)
        assert diff.min() >= -1e-9 and diff.max() <= zeta ** 2 + 1e-9


@pytest.mark.extended  # Ray simulation: `pytest -m extended`
def test_flower_aggregate_equals_single_process(tmp_path):
    """Users spread over 3 SuperNodes (Flower's Ray simulation) give the same
    embedding and MSE as the single-process computation with the same noise."""
    from research.simulation import simulate

    rc = {"num-users": 1500, "dim": 8, "rank": 2, "epochs": 2, "target-epsilon": 4.0,
          "noise-seed": 11, "clip-a": 80.0, "results-dir": str(tmp_path / "run")}
    simulate("priv-altmin", rc, num_supernodes=3)
    got = json.loads((tmp_path / "run" / "results.json").read_text())
    emb = np.load(tmp_path / "run" / "embedding.npz")["embedding"]
    spec, cfg, _ = parse_altmin_config(rc)
    ref = run_single_process(spec, all_users(spec), cfg, np.random.default_rng(11))
    assert np.allclose(emb @ emb.T, ref.embedding @ ref.embedding.T, atol=1e-6)
    assert got["final_mse"] == pytest.approx(ref.mse, rel=1e-6)
    assert got["history"][-1]["users"] == 1500
    assert got["epsilon"] == pytest.approx(ref.epsilon, rel=1e-9) and got["epsilon"] <= 4.0
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert ledger["unit"] == "user"
    assert subspace_distance(emb, true_embedding(spec)) == pytest.approx(ref.subspace_distance, abs=1e-6)


def test_disjoint_groups_partition_users_and_ledger_charges_each_user_once():
    from flwr_jdp.altmin.problem import user_groups
    from flwr_jdp.strategies import PrivAltMin

    n, groups = 1000, 4
    g = user_groups(np.arange(n), n, groups)
    assert sorted(np.bincount(g)) == [250] * 4
    spec = ProblemSpec(num_users=n, dim=6, rank=2, seed=2)
    users = all_users(spec)
    cfg = AltMinConfig(epochs=groups, groups=groups, target_epsilon=3.0, clip_a=40.0)
    counts = [client_statistics(users, true_embedding(spec), cfg, t, n).count for t in range(groups)]
    assert counts == [250] * 4
    strategy = PrivAltMin(spec, cfg)
    events = strategy.plan.events()
    assert len(events) == 3  # init + one epoch's (A, gradient) per user
    for rnd in range(groups + 1):
        strategy._charge(rnd, events)
    assert sorted(strategy.ledger.scopes) == [f"group/{t}" for t in range(groups)]
    assert strategy.ledger.epsilon() == pytest.approx(strategy.plan.epsilon(cfg.delta), rel=1e-6)
    assert strategy.ledger.epsilon() <= 3.0
    res = run_single_process(spec, users, cfg, np.random.default_rng(0))
    assert res.epsilon <= 3.0 and len(res.history) == groups + 1
    with pytest.raises(ValueError, match="groups"):
        AltMinConfig(epochs=3, groups=2)
