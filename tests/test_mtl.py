"""DP mean-regularized MTL: projection, noise, accounting (paper and tight),
configuration, and the Flower app against the single-process reference."""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from flwr.app import Array, ArrayRecord, Message, RecordDict

from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.models.linear import LinearModel
from flwr_jdp.mtl.algorithm import MeanServer, MTLConfig, run_single_process, task_round
from flwr_jdp.mtl.config import parse_mtl_config
from flwr_jdp.mtl.local import local_pgd, project_ball
from flwr_jdp.mtl.noise import (
    MeanRelease,
    paper_alpha,
    paper_sigma,
    plan_release,
    theorem1_rdp,
    theorem2_epsilon,
    tight_sigma,
)
from flwr_jdp.mtl.tasks import SyntheticSpec, TaskData, synthetic_tasks
from flwr_jdp.privacy.accountants import as_add_remove, epsilon
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.rdp import rdp_vector
from research.simulation import simulate


@pytest.mark.parametrize("kind", ["squared", "logistic", "softmax"])
def test_every_sent_model_is_inside_the_ball_for_adversarial_data(kind):
    rng = np.random.default_rng(0)
    outputs = 5 if kind == "softmax" else 1
    model = LinearModel(kind, 7, outputs, bias=True)
    for trial in range(20):
        scale = 10.0 ** rng.integers(-2, 6)
        x = scale * rng.standard_normal((13, 7))
        y = rng.integers(0, outputs if kind == "softmax" else 2, 13).astype(float)
        if kind == "squared":
            y = scale * 1e3 * rng.standard_normal(13)
        task = TaskData(trial, x, y, x, y)
        start = 1e4 * rng.standard_normal(model.num_params)  # state outside the ball
        mean = 1e3 * rng.standard_normal(model.num_params)
        radius = float(rng.uniform(0.1, 5.0))
        w = local_pgd(start, mean, task, model, lam=float(rng.uniform(0, 10)), lr=float(rng.uniform(0.01, 10)),
                      steps=int(rng.integers(1, 6)), radius=radius)
        assert np.all(np.isfinite(w))
        assert np.linalg.norm(w) <= radius * (1 + 1e-12)
    v = np.array([3.0, 4.0])
    assert np.allclose(project_ball(v, 1.0), [0.6, 0.8]) and project_ball(v, 10.0) is v


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    for kind, outputs in (("squared", 1), ("logistic", 1), ("softmax", 4)):
        model = LinearModel(kind, 5, outputs, bias=True)
        x = rng.standard_normal((9, 5))
        y = rng.integers(0, outputs if kind == "softmax" else 2, 9).astype(float)
        w = rng.standard_normal(model.num_params)
        _, g = model.loss_grad(w, x, y)
        num = np.array([(model.loss(w + 1e-6 * e, x, y) - model.loss(w - 1e-6 * e, x, y)) / 2e-6
                        for e in np.eye(model.num_params)])
        assert np.allclose(g, num, atol=1e-6)


def test_server_noise_std_is_the_sigma_the_ledger_accounts():
    for mode, relation, q in (("tight", "replace-one", 1.0), ("tight", "add-remove", 0.5),
                              ("paper", "replace-one", 1.0)):
        release = plan_release(2.0, 1e-5, radius=3.0, rounds=5, num_tasks=400, sample_rate=q,
                               relation=relation, mode=mode)
        server = MeanServer(release, np.random.default_rng(7))
        draws = server.noisy_mean(np.zeros(200_000))
        assert abs(draws.std() / release.sigma - 1) < 0.01
        # what the ledger records: z = sigma D / B (halved in paper mode, Theorem 1's RDP)
        event = release.event()
        inner = event.event if isinstance(event, dpa.PoissonSampledDpEvent) else event
        z = inner.noise_multiplier * (2 if mode == "paper" else 1)
        assert z * release.radius / release.denominator == pytest.approx(release.sigma, rel=1e-12)
        factor = 2.0 if relation == "replace-one" else 1.0
        assert release.sensitivity == pytest.approx(factor * 3.0 / (q * 400))


def test_paper_mode_ledger_reproduces_theorem_1_rdp_and_theorem_2():
    eps, delta, radius, rounds, m = 1.5, 1e-5, 2.0, 12, 300
    release = plan_release(eps, delta, radius, rounds, m, mode="paper")
    assert release.sigma == pytest.approx(8 * radius * math.sqrt(rounds * math.log(1 / delta)) / (eps * m))
    ledger = PrivacyLedger(delta=delta, unit="owner", neighbouring="replace-one")
    for rnd in range(1, rounds + 1):
        ledger.record_round(rnd, {SERVER_SCOPE: release.event()})
    event = as_add_remove(ledger.scope_event(SERVER_SCOPE))
    for order in (2.0, paper_alpha(eps, delta), 40.0):
        got = rdp_vector(event, [order])[0]
        assert got == pytest.approx(theorem1_rdp(order, radius, m, release.sigma, rounds), rel=1e-9)
    assert theorem2_epsilon(eps, delta, radius, rounds, m, release.sigma) <= eps + 1e-12
    # the paper's accounting is conservative: the true noise spends far less
    assert release.epsilon(rounds, delta, exact=True) < ledger.epsilon() < eps


@pytest.mark.parametrize("q,relation", [(1.0, "replace-one"), (1.0, "add-remove"),
                                        (0.2, "replace-one"), (0.2, "add-remove")])
def test_tight_sigma_reaches_target_and_matches_dp_accounting(q, relation):
    eps, delta, radius, rounds, m = 1.0, 1e-5, 2.0, 10, 500
    sigma = tight_sigma(eps, delta, radius, rounds, m, q, relation)
    release = MeanRelease(radius, m, q, sigma, relation)
    reached = release.epsilon(rounds, delta)
    assert 0.99 * eps <= reached <= eps
    # against dp-accounting's own PLD with the neighbouring relation
    rel = (dpa.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
           else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc = PLDAccountant(neighboring_relation=rel, value_discretization_interval=1e-4)
    acc.compose(release.exact_event(), rounds)
    assert reached == pytest.approx(acc.get_epsilon(delta), rel=2e-3)
    if q == 1.0 and relation == "replace-one":  # the paper's own setting: pure calibration slack
        assert paper_sigma(eps, delta, radius, rounds, m) / sigma > 3.0


def test_replace_one_is_twice_the_add_remove_sensitivity():
    g = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(4.0), 7)
    assert epsilon(g, 1e-5, "pld", "replace-one") == pytest.approx(
        epsilon(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 7), 1e-5), rel=1e-9)
    with pytest.raises(ValueError, match="pld"):
        epsilon(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 1e-5, "rdp", "replace-one")


def test_ledger_keeps_its_neighbouring_relation_across_restarts(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, unit="owner", neighbouring="replace-one")
    ledger.record(SERVER_SCOPE, dpa.GaussianDpEvent(3.0))
    ledger.save(tmp_path / "l.json")
    again = PrivacyLedger.load(tmp_path / "l.json")
    assert again.neighbouring == "replace-one" and again.epsilon() == pytest.approx(ledger.epsilon())
    with pytest.raises(ValueError, match="neighbouring"):
        PrivacyLedger(delta=1e-5, unit="owner").load_state_dict(json.loads((tmp_path / "l.json").read_text()))


@pytest.mark.parametrize("key,value,fragment", [
    ("lambda", -0.1, "lambda"), ("radius", 0.0, "radius"), ("target-epsilon", 0.0, "target-epsilon"),
    ("delta", 1.0, "delta"), ("delta", 0.0, "delta"), ("fraction-train", 0.0, "fraction-train"),
    ("calibration", "loose", "calibration"), ("rounds", 0, "rounds"), ("lambda", "x", "lambda"),
    ("num-tasks", 1, "num-tasks"), ("neighbouring", "swap", "neighbouring"), ("dataset", "cifar", "dataset"),
])
def test_bad_configuration_names_the_key(key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_mtl_config({key: value})


def test_paper_calibration_needs_full_participation_and_replace_one():
    with pytest.raises(ConfigError, match="paper"):
        parse_mtl_config({"calibration": "paper", "fraction-train": 0.5})
    with pytest.raises(ConfigError, match="paper"):
        parse_mtl_config({"calibration": "paper", "neighbouring": "add-remove"})


def test_mean_regularization_beats_local_only_and_noise_costs_accuracy():
    spec = SyntheticSpec(num_tasks=300, samples_per_task=30, dim=10, spread=0.2, noise=0.5)
    tasks, model = synthetic_tasks(spec), spec.model()
    base = dict(lam=1.0, radius=2.0, rounds=8, lr=0.2, finetune_steps=30, finetune_lr=0.2)
    from flwr_jdp.mtl.algorithm import local_only
    local = local_only(tasks, model, MTLConfig(**base))["excess"]
    nonpriv = run_single_process(tasks, model, MTLConfig(target_epsilon=math.inf, **base))["final"]["excess"]
    eps_big = np.mean([run_single_process(tasks, model, MTLConfig(target_epsilon=8.0, **base), s)["final"]["excess"]
                       for s in range(3)])
    eps_small = np.mean([run_single_process(tasks, model, MTLConfig(target_epsilon=0.3, **base), s)["final"]["excess"]
                         for s in range(3)])
    assert nonpriv < 0.7 * local
    assert nonpriv < eps_big < eps_small


def _sim_config(tmp_path, **extra):
    return {"num-tasks": 12, "samples-per-task": 15, "dim": 6, "rounds": 3, "target-epsilon": 3.0,
            "noise-seed": 4, "results-dir": str(tmp_path / "res"), "resume": False, "lr": 0.1,
            "finetune-lr": 0.1, **extra}


@pytest.mark.extended  # Ray simulation: `pytest -m extended`
def test_flower_run_equals_single_process_and_sends_only_projected_models(tmp_path):
    rc = _sim_config(tmp_path)
    sent = []

    def spy(kind, handler):
        def inner(msg, context):
            reply = handler(msg, context)
            sent.append((kind, reply.content))
            return reply
        return inner

    simulate("dp-mtl", rc, num_supernodes=3, wrap=spy)
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    assert res["status"] == "completed" and [h["tasks"] for h in res["history"]] == [12, 12, 12]
    source, cfg, _ = parse_mtl_config(rc)
    ref = run_single_process(source.tasks(), source.model(), cfg, noise_seed=4)
    assert res["final"]["excess"] == pytest.approx(ref["final"]["excess"], rel=1e-9)
    assert res["epsilon"] == pytest.approx(ref["epsilon"]) and res["epsilon"] <= 3.0
    # what left the nodes: task ids at set-up, projected w_k in train, metric sums in evaluate
    for kind, content in sent:
        if kind == "train":
            assert set(content.keys()) == {"models", "metrics"}
            for w in content["models"].values():
                assert np.linalg.norm(w.numpy()) <= cfg.radius * (1 + 1e-9)
        elif kind == "evaluate":
            assert set(content.keys()) == {"metrics"} and not content.array_records
    ledger = json.loads((tmp_path / "res" / "ledger.json").read_text())
    assert ledger["neighbouring"] == "replace-one" and ledger["unit"] == "task"
    assert [r["round"] for r in ledger["rounds"]] == [1, 2, 3]


@pytest.mark.extended  # Ray simulation: `pytest -m extended`
def test_out_of_ball_and_malformed_replies_are_dropped_with_a_reason(tmp_path):
    def attack(kind, handler):
        if kind != "train":
            return handler

        def inner(msg, context):
            reply = handler(msg, context)
            if int(context.node_config["partition-id"]) == 1:
                models = reply.content["models"]
                keys = list(models.keys())
                huge = {k: Array(100.0 * models[k].numpy()) for k in keys[:1]}
                bad_shape = {k: Array(np.zeros(3)) for k in keys[1:2]}
                unasked = {"task.999": Array(np.zeros(6))}
                content = RecordDict({"models": ArrayRecord({**huge, **bad_shape, **unasked}),
                                      "metrics": reply.content["metrics"]})
                return Message(content, reply_to=msg)
            return reply
        return inner

    simulate("dp-mtl", _sim_config(tmp_path), num_supernodes=2, wrap=attack)
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    assert res["status"] == "completed"
    assert [h["tasks"] for h in res["history"]] == [6, 6, 6], res["dropped"]  # node 1 hosts 6 tasks: none counted
    reasons = " ".join(res["dropped"])
    assert "norm" in reasons and "shape" in reasons and "not asked" in reasons


def test_task_round_is_the_local_pgd_of_the_config():
    spec = SyntheticSpec(num_tasks=2, samples_per_task=5, dim=3)
    task = synthetic_tasks(spec)[0]
    cfg = MTLConfig(radius=0.5, local_steps=3, lr=0.2, lam=2.0)
    w = task_round(np.zeros(3), np.ones(3), task, spec.model(), cfg)
    assert np.allclose(w, local_pgd(np.zeros(3), np.ones(3), task, spec.model(), 2.0, 0.2, 3, 0.5))


@pytest.mark.parametrize("phase", ["train", "evaluate"])
def test_a_restarted_server_resumes_with_the_epsilon_it_had_spent(tmp_path, phase):
    from apps.dp_mtl.dp_mtl.client_app import client
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.strategies import DPMeanRegularizedMTL

    rc = _sim_config(tmp_path, rounds=4)
    source, cfg, extras = parse_mtl_config(rc)

    def crash_in_round_3(instruction, reply):  # noqa: ANN001, ANN202
        if instruction.metadata.message_type == phase and instruction.content["config"]["round"] == 3:
            raise RuntimeError("server killed")
        return reply

    def strategy():  # noqa: ANN202
        return DPMeanRegularizedMTL(source.num_tasks, source.model().num_params, cfg, extras["results-dir"],
                                    noise_seed=4, run_config=rc, resume=True)

    with pytest.raises(RuntimeError, match="killed"):
        strategy().start(InProcessGrid(client, 2, rc, fault=crash_in_round_3))
    on_disk = json.loads((tmp_path / "res" / "ledger.json").read_text())
    assert [r["round"] for r in on_disk["rounds"]] == [1, 2, 3]  # round 3 was charged before its release
    saved = json.loads((tmp_path / "res" / "results.json").read_text())["history"]
    assert [h["round"] for h in saved] == ([1, 2] if phase == "train" else [1, 2, 3])
    resumed = strategy()
    resumed.start(InProcessGrid(client, 2, rc))
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    assert res["status"] == "completed" and [h["round"] for h in res["history"]] == [1, 2, 3, 4]
    ledger = json.loads((tmp_path / "res" / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 2, 3, 4]  # its mean never existed: charged once
    assert res["epsilon"] == pytest.approx(resumed.release.epsilon(4, cfg.delta)) and res["epsilon"] <= 3.0


def test_boolean_run_config_strings_are_parsed_not_truthy():
    from flwr_jdp.joint_dp.config import coerce_value
    assert coerce_value("resume", "false", True) is False and coerce_value("resume", "True", False) is True
    with pytest.raises(ConfigError, match="resume"):
        coerce_value("resume", "maybe", True)
