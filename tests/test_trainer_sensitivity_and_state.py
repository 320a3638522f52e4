"""Privacy-critical numbers checked end to end, each through the code that produces it:

- the sensitivity of one DP-SGD release, through the owner's trainer
  (:func:`train_owner_round`, what the ClientApp calls), not through the clipping
  helper alone;
- the standard deviation of the central noise the server adds, against the noise
  multiplier the ledger recorded for the same release;
- the personal state an owner starts each round with, through the real ClientApp
  handlers, in ``context.state`` and after a restart from the node's ``state-dir``.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array
from flwr_jdp.strategies import load_results

import flwr_jdp.joint_dp.client_app as client_app
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_round import OwnerPlan, release_model, train_owner_round
from flwr_jdp.joint_dp.owner_state import new_model, owner_data, public_personal
from flwr_jdp.params import get_arrays
from flwr_jdp.privacy.ledger import SERVER_SCOPE

from .helpers import Killed, kill_after_trains, run_inprocess

# ------------------------------------------------------------------ 1. sensitivity

C = 0.1  # far below the digits' per-record shared-gradient norms (~13-17)
LR = 1.0
N_RECORDS = 24  # 12 users of 2 records under the user unit


def _owner(unit: str, coupling: str):
    """Config and a small slice of owner 0's data (users 0..11, two records each)."""
    cfg = parse_config({"num-owners": 4, "privacy-unit": unit, "noise-placement": "local",
                        "personal-coupling": coupling, "clipping-norm": C, "learning-rate": LR,
                        "records-per-user": 2})
    full = owner_data(cfg)[0]
    data = dataclasses.replace(full, x_train=full.x_train[:N_RECORDS], y_train=full.y_train[:N_RECORDS],
                               user_ids=np.arange(N_RECORDS) // 2)
    return cfg, data


def _without(data, keep: np.ndarray):
    return dataclasses.replace(data, x_train=data.x_train[keep], y_train=data.y_train[keep],
                               user_ids=data.user_ids[keep])


def _one_step_release(cfg, data) -> tuple[np.ndarray, np.ndarray]:
    """(shared parameters before, released shared parameters) of one noiseless
    full-batch DP-SGD step (z = 0, q = 1, 1 step) through the owner's trainer."""
    model, split = new_model(cfg, data)
    before = get_arrays(model, split.shared)
    public = public_personal(cfg, data) if cfg.decoupled else None
    release, _ = train_owner_round(model, split, data, cfg, OwnerPlan(1.0, 1, 0.0),
                                   torch.Generator().manual_seed(0), public)
    return _flat(before, split.shared), _flat(release, split.shared)


def _flat(arrays: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray:
    return np.concatenate([arrays[n].ravel() for n in names]).astype(np.float64)


def _per_record_gradient_norms(cfg, data) -> np.ndarray:
    """Unclipped L2 norms of each record's gradient of the shared parameters (on the
    model the release is computed on)."""
    model, split = new_model(cfg, data)
    model = release_model(model, split, public_personal(cfg, data))
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    norms = []
    for i in range(len(data.y_train)):
        x = torch.from_numpy(data.x_train[i : i + 1])
        y = torch.from_numpy(data.y_train[i : i + 1]).long()
        grads = torch.autograd.grad(F.cross_entropy(model(x), y, reduction="sum"), shared)
        norms.append(float(torch.sqrt(sum((g * g).sum() for g in grads))))
    return np.array(norms)


@pytest.mark.parametrize("coupling", ["decoupled", "interleaved"])
def test_one_dp_sgd_step_moves_the_release_by_at_most_lr_c_over_the_batch_per_record(coupling):
    """Record unit, z = 0, q = 1, one step: the release is ``theta - lr * S / n`` with
    ``S`` the sum of per-record gradients clipped to C. Removing one record changes
    ``S`` by at most C, i.e. the released step scaled back by its own expected batch
    (``n`` with the record, ``n - 1`` without) moves by at most ``lr * C``. Every
    record's unclipped gradient is > 10 C, so the removal moves the sum by exactly
    its clipped gradient (norm C): a trainer that clipped at 10 C while the noise is
    calibrated to C would move it by 10 C."""
    cfg, data = _owner("record", coupling)
    assert _per_record_gradient_norms(cfg, data).min() > 20 * C  # clipping is active, also at 10 C
    n = len(data.y_train)
    theta0, with_all = _one_step_release(cfg, data)
    for removed in (0, 5, n - 1):
        theta0_, without = _one_step_release(cfg, _without(data, np.arange(n) != removed))
        np.testing.assert_array_equal(theta0, theta0_)
        sum_with = (theta0 - with_all) * (1.0 * n) / LR  # q * n = expected batch
        sum_without = (theta0 - without) * (1.0 * (n - 1)) / LR
        moved = float(np.linalg.norm(sum_with - sum_without))
        assert moved <= C * (1 + 1e-3), (
            f"removing record {removed} moved lr*sum by {LR * moved:.4g} > lr*C = {LR * C:.4g}")
        assert moved >= 0.99 * C  # the bound is attained: the record's gradient was clipped to C


@pytest.mark.parametrize("coupling", ["decoupled", "interleaved"])
def test_one_dp_sgd_step_moves_the_release_by_at_most_lr_c_over_the_batch_per_user(coupling):
    """User unit, z = 0, q = 1, one step: removing one user (not the highest id, so
    the expected batch ``q * users`` is the same on both sides) moves the released
    shared parameters by at most ``lr * C / (q * users)``."""
    cfg, data = _owner("user", coupling)
    assert _per_record_gradient_norms(cfg, data).min() > 20 * C
    users = data.num_users
    bound = LR * C / (1.0 * users)
    _, with_all = _one_step_release(cfg, data)
    for removed in (0, 3, users - 2):
        without_data = _without(data, data.user_ids != removed)
        assert without_data.num_users == users  # same public denominator
        _, without = _one_step_release(cfg, without_data)
        moved = float(np.linalg.norm(with_all - without))
        assert moved <= bound * (1 + 1e-3), (
            f"removing user {removed} moved the release by {moved:.4g} > lr*C/(q*users) = {bound:.4g}")
        assert moved > 0.1 * bound  # the user did contribute


# ------------------------------------------------------------- 2. central noise std


def _gaussian_in(event: dict) -> tuple[float, float]:
    """(noise multiplier, sampling rate) of a recorded ``Gaussian`` or
    ``PoissonSampled(q, Gaussian)`` event (q = 1 when not sampled)."""
    q = 1.0
    if event["class_name"] == "PoissonSampledDpEvent":
        q, event = float(event["sampling_probability"]), event["event"]
    assert event["class_name"] == "GaussianDpEvent", event
    return float(event["noise_multiplier"]), q


@pytest.mark.parametrize("unit", ["record", "owner"])
def test_central_noise_std_is_the_ledgers_z_times_c_over_the_expected_count(run_config, unit):
    """Central placement, every owner's reply replaced by zeros (an all-zero clipped
    sum / clipped update): each round's change of the shared parameters is the
    server's noise alone, so its std must be ``step * z * C / (q * units)`` with z and q
    from the event the ledger recorded for that release (record unit: clipped
    gradient sums, step = learning-rate, units = records; owner unit: clipped
    updates, step = server-learning-rate, units = owners)."""
    run_config.update({"privacy-unit": unit, "noise-placement": "central", "num-rounds": 2,
                       "clipping-norm": 0.7, "learning-rate": 0.3})
    cfg = parse_config(run_config)
    broadcast: dict[tuple[str, int], dict[str, np.ndarray]] = {}

    def zero_releases(instruction, reply):
        kind = instruction.metadata.message_type
        if kind not in ("train", "evaluate"):  # the set-up query
            return reply
        rnd = int(instruction.content[protocol.CONFIG][protocol.ROUND])
        shared = instruction.content[protocol.SHARED]
        broadcast.setdefault((kind, rnd), {k: shared[k].numpy().copy() for k in shared.keys()})
        if kind == "train" and not reply.has_error():
            for key in list(reply.content.keys()):
                if protocol.parse_owner_key(key) is not None:
                    rec = reply.content[key]
                    for name in list(rec.keys()):
                        rec[name] = Array(np.zeros_like(rec[name].numpy()))
        return reply

    strategy, _, _ = run_inprocess(run_config, fault=zero_releases)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "completed"
    assert all(r["valid_owners"] == 4 and not r["skipped"] for r in res["history"])

    ledger = json.loads((Path(run_config["results-dir"]) / "ledger.json").read_text())
    assert set(ledger["scopes"]) == {SERVER_SCOPE}
    ((event, count),) = ledger["scopes"][SERVER_SCOPE]
    assert count == cfg.num_rounds  # one release per round, all alike
    z, q = _gaussian_in(event)
    assert z > 0
    sizes = [len(d.y_train) for d in owner_data(cfg)]
    units = sum(sizes) if unit == "record" else len(sizes)
    step = cfg.learning_rate if unit == "record" else cfg.server_learning_rate
    expected = step * z * cfg.clipping_norm / (q * units)

    noise = np.concatenate([
        (broadcast[("evaluate", r)][k].astype(np.float64) - broadcast[("train", r)][k]).ravel()
        for r in range(1, cfg.num_rounds + 1) for k in broadcast[("train", r)]])
    n = noise.size
    tol = 8 / np.sqrt(2 * n)  # the sample std's relative standard error is 1/sqrt(2n)
    assert tol < 0.1  # so noise at z/2 or 2z cannot pass
    measured = float(noise.std())
    assert measured == pytest.approx(expected, rel=tol), (
        f"server noise std {measured:.4g} != z*C*step/(q*units) = {expected:.4g} "
        f"(ledger z={z}, q={q:.4g}, units={units}; ratio {measured / expected:.3f})")
    assert abs(float(noise.mean())) <= 8 * expected / np.sqrt(n)
    assert strategy.noise_multiplier == z  # the multiplier sent and the one accounted agree


# ------------------------------------------------------------ 3. personal state


class _PersonalTrace:
    """Wraps the ClientApp's ``load_owner_model`` and ``save_personal`` and records,
    per (node, owner), the personal arrays each load hands out and each save keeps."""

    def __init__(self, monkeypatch):
        self.events: dict[tuple[int, int], list[tuple[str, dict[str, np.ndarray]]]] = {}
        load, save = client_app.load_owner_model, client_app.save_personal

        def traced_load(cfg, context, data, shared, session=""):
            model, split = load(cfg, context, data, shared, session)
            self._add(context, data.owner_id, "load", get_arrays(model, split.personal))
            return model, split

        def traced_save(context, owner_id, model, split, session="", **kwargs):
            save(context, owner_id, model, split, session, **kwargs)
            self._add(context, owner_id, "save", get_arrays(model, split.personal))

        monkeypatch.setattr(client_app, "load_owner_model", traced_load)
        monkeypatch.setattr(client_app, "save_personal", traced_save)

    def _add(self, context, owner_id, what, arrays):
        key = (int(context.node_id), int(owner_id))
        self.events.setdefault(key, []).append((what, {k: v.copy() for k, v in arrays.items()}))

    def restart(self) -> dict:
        """The events so far; start recording afresh (a restarted run's new contexts)."""
        events, self.events = self.events, {}
        return events


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")


def _assert_loads_continue_saves(events: dict, first: dict[int, dict], phase: str) -> None:
    """Per owner: the first load hands out ``first[owner]``; every later load hands
    out exactly what the owner's last save kept."""
    for (_node, owner), seq in events.items():
        assert seq[0][0] == "load"
        _assert_same(seq[0][1], first[owner], f"{phase}: owner {owner}'s first load")
        last_saved = None
        for i, (what, arrays) in enumerate(seq):
            if what == "save":
                last_saved = arrays
            elif last_saved is not None:
                _assert_same(arrays, last_saved,
                             f"{phase}: owner {owner}'s load #{i} (personal arrays it starts with) "
                             "vs its previous save")
        assert sum(w == "load" for w, _ in seq) >= 2, f"{phase}: owner {owner} was loaded once only"


def test_owner_starts_every_round_with_the_personal_state_it_saved_also_after_a_restart(
        run_config, tmp_path, monkeypatch):
    """Through the real ClientApp handlers: within a run every round (train and
    evaluate) starts from the personal arrays the owner saved last, not from the
    seeded initialisation; after the server is killed and the run resumed with fresh
    contexts, each owner starts from what it wrote to its node's ``state-dir``."""
    run_config.update({"num-rounds": 2})
    cfg = parse_config(run_config)
    nodes = {"state-dir": str(tmp_path / "node-state")}
    data = owner_data(cfg)
    initial = {o: dict(get_arrays(*_model_and_personal(cfg, data[o]))) for o in range(cfg.num_owners)}
    trace = _PersonalTrace(monkeypatch)

    # Round 1 and its evaluation complete; killed at round 2 after node 0 trained.
    with pytest.raises(Killed):
        run_inprocess(run_config, fault=kill_after_trains(2), node_config=nodes)
    before_restart = trace.restart()
    assert {o for _, o in before_restart} == set(range(cfg.num_owners))
    _assert_loads_continue_saves(before_restart, initial, "first run")
    last_saved = {o: [a for w, a in seq if w == "save"][-1] for (_, o), seq in before_restart.items()}
    for o in range(cfg.num_owners):
        assert any(not np.array_equal(last_saved[o][k], initial[o][k]) for k in initial[o]), (
            f"owner {o}'s personal arrays never changed: the check would be vacuous")

    session = load_results(run_config["results-dir"])["session"]
    on_disk = {}
    for o in range(cfg.num_owners):
        with np.load(Path(nodes["state-dir"]) / session / f"personal-{o}.npz") as npz:
            on_disk[o] = {k: np.asarray(npz[k]) for k in initial[o]}
        _assert_same(on_disk[o], last_saved[o], f"owner {o}'s file vs its last save")

    # Restart: fresh contexts (empty context.state), same node disks.
    run_inprocess(run_config, node_config=nodes)
    assert load_results(run_config["results-dir"])["status"] == "completed"
    after_restart = trace.restart()
    assert {o for _, o in after_restart} == set(range(cfg.num_owners))
    _assert_loads_continue_saves(after_restart, on_disk, "restarted run")


def _model_and_personal(cfg, data):
    model, split = new_model(cfg, data)
    return model, split.personal
