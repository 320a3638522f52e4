"""Privacy-critical numbers checked end to end, each through the code that produces it:

- the sensitivity of one release, through the owner's side of the project's own
  ClientApp (:meth:`JointDPClient.train` with the app's ``task.train``, as
  ``client_app.train_owner`` calls it; local DP-SGD step and central clipped sum),
  not through the clipping helper alone;
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
from flwr.app import Array, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

import apps.joint_dp.joint_dp.client_app as client_app
import flwr_jdp.joint_dp.client as client
from apps.joint_dp.joint_dp import task
from apps.joint_dp.joint_dp.server_app import initial_arrays
from apps.joint_dp.joint_dp.task import node_job_config, owner_data
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient, owner_id
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.release import public_personal_swapped
from flwr_jdp.joint_dp.schedule import units_of
from flwr_jdp.params import get_arrays, split_parameters
from flwr_jdp.privacy.ledger import SERVER_SCOPE
from flwr_jdp.strategies import JointDP, load_results

from .helpers import Killed, kill_after_trains, run_inprocess

# ------------------------------------------------------------------ 1. sensitivity

C = 0.1  # far below the digits' per-record shared-gradient norms (~13-17)
LR = 1.0
N_RECORDS = 24  # 12 users of 2 records under the user unit
#: The owner's guard refuses z = 0 under local noise: the run agrees on a noise
#: multiplier so small (and a budget so large) that its noise, ~1e-10 C per
#: coordinate, is far below the 1e-3 C tolerance of the checks.
TINY_Z = 1e-9


def _run_config(unit: str, placement: str) -> dict:
    return {"num-owners": 1, "classes-per-owner": 10, "privacy-unit": unit, "noise-placement": placement, "clipping-norm": C,
            "learning-rate": LR, "records-per-user": 2, "batch-size": 64, "local-epochs": 1, "num-rounds": 1,
            "noise-multiplier": TINY_Z, "target-epsilon": 1e30, "accountant": "rdp", "noise-seed": 5}


def _owner(run_config: dict):
    """Config and a small slice of the owner's data (users 0..11, two records each)."""
    cfg = parse_config(run_config)
    full = owner_data(cfg)[0]
    data = dataclasses.replace(full, x_train=full.x_train[:N_RECORDS], y_train=full.y_train[:N_RECORDS],
                               user_ids=np.arange(N_RECORDS) // 2)
    return cfg, data


def _without(data, keep: np.ndarray):
    return dataclasses.replace(data, x_train=data.x_train[keep], y_train=data.y_train[keep],
                               user_ids=data.user_ids[keep])


def _app(data) -> ClientApp:
    """The project's ClientApp's train handler on ``data`` (one owner, this node):
    :class:`JointDPClient` around the app's seed CNN (``task.initial_model``), its
    ``task.loader`` and its train function (``client_app._train_fn`` -> ``task.train``)."""
    app = ClientApp()

    def own(context: Context):
        return task.loader(node_job_config(context), data, torch.Generator().manual_seed(0))

    jdp = JointDPClient(app, model_fn=lambda context: task.initial_model(node_job_config(context)),
                        train_data=own, user_ids=lambda context: data.user_ids, config_fn=node_job_config)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = node_job_config(context)
        loader = own(context)
        fn = client_app._train_fn(cfg, loader, torch.Generator().manual_seed(1))
        return jdp.train(msg, context, task.initial_model(cfg), loader, fn)

    return app


def _one_round_sum(run_config: dict, data) -> tuple[np.ndarray, np.ndarray]:
    """(broadcast shared parameters, the owner's sum of clipped per-unit gradients)
    of one release at rate 1, one step, as the real :class:`JointDP` asks for it
    (set-up, schedule, ``configure_train``) and the owner computes it: under central
    noise the reply *is* that sum; under local noise the reply is the shared
    parameters after the DP-SGD step, ``theta - lr (sum + noise) / (q units)``, and
    the sum is read back from it."""
    cfg = parse_config(run_config)
    grid = InProcessGrid(_app(data), 1, run_config)
    strategy = JointDP(cfg, node_settle_s=0.0)
    initial = strategy.setup(grid, timeout=30.0, initial_arrays=initial_arrays(cfg))
    central = cfg.placement.value == "central"
    rate = strategy.schedule.server_rate if central else strategy.schedule.owner_rates[0]
    steps = 1 if central else strategy.schedule.owner_steps[0]
    assert (rate, steps) == (1.0, 1)
    (reply,) = grid.send_and_receive(strategy.configure_train(1, initial, ConfigRecord(), grid))
    assert reply.has_content(), reply.error.reason
    names = list(strategy.spec)
    theta0 = _flat({n: initial[n].numpy() for n in names}, names)
    released = _flat({n: reply.content[protocol.ARRAYS][n].numpy() for n in names}, names)
    if central:
        return theta0, released
    units = units_of(cfg, strategy.sizes[0])  # the owner's reported size: its public denominator
    return theta0, (theta0 - released) * (rate * units) / LR


def _flat(arrays: dict[str, np.ndarray], names) -> np.ndarray:
    return np.concatenate([arrays[n].ravel() for n in names]).astype(np.float64)


def _per_record_gradient_norms(cfg, data) -> np.ndarray:
    """Unclipped L2 norms of each record's gradient of the shared parameters, on the
    model the release is computed on (personal parameters at the public values the
    server's ``initial_arrays`` sent)."""
    model = task.initial_model(cfg)
    split = split_parameters(model, cfg.effective_personal_rule)
    initial = initial_arrays(cfg)
    norms = []
    with public_personal_swapped(model, split, {n: initial[n].numpy() for n in split.personal}) as m:
        params = dict(m.named_parameters())
        shared = [params[n] for n in split.shared]
        for i in range(len(data.y_train)):
            x = torch.from_numpy(data.x_train[i : i + 1])
            y = torch.from_numpy(data.y_train[i : i + 1]).long()
            grads = torch.autograd.grad(F.cross_entropy(m(x), y, reduction="sum"), shared)
            norms.append(float(torch.sqrt(sum((g * g).sum() for g in grads))))
    return np.array(norms)


@pytest.mark.parametrize("placement", ["local", "central"])
def test_one_release_moves_the_clipped_sum_by_at_most_c_per_record(placement):
    """Record unit, q = 1, one step: the release is ``S`` (central) or
    ``theta - lr (S + noise) / n`` (local), ``S`` the sum of per-record gradients
    clipped to C inside the app's ``task.train``. Removing one record changes ``S``
    by at most C, i.e. the released step scaled back by its own expected batch (``n``
    with the record, ``n - 1`` without) moves by at most ``lr * C``. Every record's
    unclipped gradient is > 20 C, so the removal moves the sum by exactly its clipped
    gradient (norm C): a trainer that clipped at 10 C while the noise is calibrated to
    C would move it by 10 C."""
    run_config = _run_config("record", placement)
    cfg, data = _owner(run_config)
    assert _per_record_gradient_norms(cfg, data).min() > 20 * C  # clipping is active, also at 10 C
    n = len(data.y_train)
    theta0, sum_with = _one_round_sum(run_config, data)
    for removed in (0, 5, n - 1):
        theta0_, sum_without = _one_round_sum(run_config, _without(data, np.arange(n) != removed))
        np.testing.assert_array_equal(theta0, theta0_)
        moved = float(np.linalg.norm(sum_with - sum_without))
        assert moved <= C * (1 + 1e-3), (
            f"removing record {removed} moved lr*sum by {LR * moved:.4g} > lr*C = {LR * C:.4g}")
        assert moved >= 0.99 * C  # the bound is attained: the record's gradient was clipped to C


@pytest.mark.parametrize("placement", ["local", "central"])
def test_one_release_moves_the_clipped_sum_by_at_most_c_per_user(placement):
    """User unit, q = 1, one step: removing one user (both its records) moves the
    sum of per-user clipped gradients ``S`` (read back from the release scaled by its
    own expected batch ``q * users``: 12 users with it, 11 without) by at most C."""
    run_config = _run_config("user", placement)
    cfg, data = _owner(run_config)
    assert _per_record_gradient_norms(cfg, data).min() > 20 * C
    users = len(np.unique(data.user_ids))
    _, sum_with = _one_round_sum(run_config, data)
    for removed in (0, 3, users - 1):
        without_data = _without(data, data.user_ids != removed)
        assert len(np.unique(without_data.user_ids)) == users - 1
        _, sum_without = _one_round_sum(run_config, without_data)
        moved = float(np.linalg.norm(sum_with - sum_without))
        assert moved <= C * (1 + 1e-3), (
            f"removing user {removed} moved the clipped sum by {moved:.4g} > C = {C:.4g}")
        assert moved > 0.1 * C  # the user did contribute


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
    """Wraps the client half's model loading (:meth:`JointDPClient._load`, which every
    train and evaluate handler of the ClientApp goes through) and its
    ``save_personal_arrays``, and records, per (node, owner), the personal arrays the
    owner's model starts with after each load and those each save keeps."""

    def __init__(self, monkeypatch):
        self.events: dict[tuple[int, int], list[tuple[str, dict[str, np.ndarray]]]] = {}
        load, save = JointDPClient._load, client.save_personal_arrays

        def traced_load(jdp, cfg, model, msg, context, session):
            split, shared = load(jdp, cfg, model, msg, context, session)
            self._add(context, owner_id(context), "load", get_arrays(model, split.personal))
            return split, shared

        def traced_save(context, owner, arrays, session="", **kwargs):
            save(context, owner, arrays, session, **kwargs)
            self._add(context, owner, "save", arrays)

        monkeypatch.setattr(JointDPClient, "_load", traced_load)
        monkeypatch.setattr(client, "save_personal_arrays", traced_save)

    def _add(self, context, owner, what, arrays):
        key = (int(context.node_id), int(owner))
        self.events.setdefault(key, []).append((what, {k: np.array(v, copy=True) for k, v in arrays.items()}))

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
    public = _public_personal(cfg)  # what the set-up sends every owner
    initial = {o: public for o in range(cfg.num_owners)}
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


def _public_personal(cfg) -> dict[str, np.ndarray]:
    """The public initial personal values of the server's ``initial_arrays``."""
    rec = initial_arrays(cfg)
    split = split_parameters(task.initial_model(cfg), cfg.effective_personal_rule)
    return {n: rec[n].numpy() for n in split.personal}
