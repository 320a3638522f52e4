"""The drop-in guarantee holds whatever the user's train function does.

Each case is ordinary training code run through ``JointDPClient.train`` (one owner,
the in-process harness of ``tests/test_dropin.py``) under local and central noise:
either the round is refused before anything is sent (an error reply, no arrays), or
the release, on a data set and on its neighbour (one record replaced) with the same
noise seed, moves by at most the DP-SGD sensitivity: ``lr 2C / (qN)`` for the local
release after one SGD step, ``2C`` for the central clipped sum. The honest loop
releases, with noise of the planned size (``tests/test_dropin.py``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient
from flwr_jdp.training.user_loop import PoissonLoader
from tests.test_dropin import RC, Tiny, _client_node, _loader, _setup_and_instruction

PLACEMENTS = ["local", "central"]
N, Q, LR, CLIP, Z = 40, 0.2, 0.5, 0.01, 2.0


def _config(placement: str) -> dict:
    return dict(RC, **{"jdp.noise-placement": placement, "jdp.clipping-norm": CLIP, "jdp.noise-seed": 3})


def _round(placement: str, train_fn, loader=None, model_fn=Tiny, loss_fn=None, personal="head."):  # noqa: ANN001
    config = dict(_config(placement), **{"jdp.personal-layers": f"^{personal.rstrip('.')}\\."})
    app, jdp, ctx, loader = _client_node(config, loader, model_fn)
    torch.manual_seed(0)  # the same broadcast for neighbouring runs
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1, model_fn=model_fn, personal=personal)
    torch.manual_seed(0)
    return jdp.train(train, ctx, model_fn(), loader, train_fn, loss_fn=loss_fn)


def _refused(reply, match: str) -> None:  # noqa: ANN001
    assert reply.has_error(), "the round was released"
    assert not reply.has_content()
    assert match in reply.error.reason, reply.error.reason


def _release(reply) -> np.ndarray:  # noqa: ANN001
    assert reply.has_content(), reply.error.reason
    return np.concatenate([a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()])


def _sgd_loop(loss_fn=None, after=None, lr=LR):  # noqa: ANN001
    """A textbook loop; ``loss_fn(out, y)`` the loss, ``after(net, opt)`` code after it."""
    def fn(net: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        for x, y in loader:
            opt.zero_grad()
            out = net(x)
            loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out, y)
            loss.backward()
            opt.step()
        if after is not None:
            after(net, opt)
    return fn


def _neighbours(i: int, seed: int = 1) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 2, (N,), generator=g)
    x2, y2 = x.clone(), y.clone()
    x2[i], y2[i] = -3 * x[i] + 1, 1 - y[i]  # one record replaced
    return (DataLoader(TensorDataset(x, y), batch_size=8), DataLoader(TensorDataset(x2, y2), batch_size=8))


def _max_move(placement: str, train_fn, model_fn=Tiny, outlier: bool = False, stride: int = 3,  # noqa: ANN001
              as_loader=None, **round_kw) -> float:  # noqa: ANN001
    """The largest release difference over neighbouring data sets (record i replaced,
    every ``stride``-th; ``outlier``: by x = 100 with its label flipped), same noise seed.
    ``as_loader(x, y)``: the loader the model takes (default: a TensorDataset's)."""
    as_loader = as_loader or (lambda x, y: DataLoader(TensorDataset(x, y), batch_size=8))
    moves = []
    for i in range(0, N, stride):
        a, b = _neighbours(i)
        if outlier:
            x, y = (t.clone() for t in a.dataset.tensors)
            x[i], y[i] = 100.0, 1 - y[i]
            b = DataLoader(TensorDataset(x, y), batch_size=8)
        a, b = as_loader(*a.dataset.tensors), as_loader(*b.dataset.tensors)
        moves.append(float(np.linalg.norm(_release(_round(placement, train_fn, a, model_fn, **round_kw))
                                          - _release(_round(placement, train_fn, b, model_fn, **round_kw)))))
    return max(moves)


def _bound(placement: str) -> float:
    return 2 * CLIP if placement == "central" else LR * 2 * CLIP / (Q * N)


# ------------------------------------- set aside: the release is the honest one
def _multi_step_round(placement: str, train_fn, steps: int = 5, model_fn=Tiny, loss_fn=None):  # noqa: ANN001
    app, jdp, ctx, loader = _client_node(_config(placement), model_fn=model_fn)
    torch.manual_seed(0)
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, steps)
    torch.manual_seed(0)
    return jdp.train(train, ctx, model_fn(), loader, train_fn, loss_fn=loss_fn)


def _as_honest(placement: str, train_fn, caplog, says: str | None, steps: int = 5) -> None:  # noqa: ANN001
    """The round releases exactly what the honest loop releases (same seeds), and the
    node logs what the DP pass set aside (``says``)."""
    honest = _release(_multi_step_round(placement, _sgd_loop(), steps))
    caplog.clear()
    with caplog.at_level("WARNING", logger="flwr"):
        got = _release(_multi_step_round(placement, train_fn, steps))
    np.testing.assert_array_equal(got, honest)
    if says is not None:
        assert any(says in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def _personal_fit_then(dp_fn):  # noqa: ANN001, ANN202
    """``dp_fn`` in the DP pass only (the personal fit, on the user's own loader, is honest)."""
    def fn(net, loader):  # noqa: ANN001
        if isinstance(loader, PoissonLoader):
            return dp_fn(net, loader)
        return _sgd_loop()(net, loader)
    return fn


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_no_grad_edit_after_the_loop_does_not_reach_the_release(placement, caplog):
    def edit(net, opt):  # noqa: ANN001
        with torch.no_grad():
            net.body.bias.add_(1e3 * next(iter(DataLoader(_loader().dataset, batch_size=40)))[0].mean())

    _as_honest(placement, _personal_fit_then(_sgd_loop(after=edit)), caplog, "outside the DP steps")


class _WithDropout(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.body(x))))


def test_a_hand_written_sgd_step_takes_no_dp_step_and_is_refused():
    """A textbook loop without an optimizer: its updates never reach the release and
    no DP step is taken (local noise: refused, whatever the data; central noise: the
    clipped sum of the batch is the release)."""
    def textbook(net, loader):  # noqa: ANN001
        for x, y in loader:
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad

    _refused(_multi_step_round("local", _personal_fit_then(textbook), model_fn=_WithDropout),
             "took no optimizer.step()")
    assert _multi_step_round("central", _personal_fit_then(textbook), model_fn=_WithDropout).has_content()


def _best_iterate(net, loader):  # noqa: ANN001
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    best, best_loss = None, float("inf")
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if loss.item() + i < best_loss:  # the first iterate is the best here
            best_loss, best = loss.item() + i, {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(best)


def test_restoring_the_best_iterate_does_not_reach_the_release(caplog):
    _as_honest("local", _personal_fit_then(_best_iterate), caplog, "outside the DP steps")


def _early_stop(net, loader):  # noqa: ANN001
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if loss.item() < 10:  # always true here: stops after the first step
            break


def test_an_early_stop_on_the_training_loss_gets_every_step_taken(caplog):
    _as_honest("local", _personal_fit_then(_early_stop), caplog, "left DP steps untaken")


def _plateau(net, loader):  # noqa: ANN001
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        sched.step(-loss.item() if len(y) % 2 else loss.item())  # the data decides


def test_reduce_lr_on_plateau_on_the_training_loss_does_not_reach_the_release(caplog):
    _as_honest("local", _personal_fit_then(_plateau), caplog, "settings changed during the DP pass")


def test_a_second_optimizer_or_edited_optimizer_state_does_not_reach_the_release(caplog):
    def two_optimizers(net, loader):  # noqa: ANN001
        first = torch.optim.SGD(net.parameters(), lr=LR)
        for i, (x, y) in enumerate(loader):
            opt = first if i == 0 else torch.optim.SGD(net.parameters(), lr=10 * LR)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    def state_edit(net, loader):  # noqa: ANN001
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            opt.param_groups[0]["lr"] = float(x.abs().mean())  # settings from the data

    _as_honest("local", _personal_fit_then(two_optimizers), caplog, None)
    _as_honest("local", _personal_fit_then(state_edit), caplog, None)


def test_a_closure_is_refused():
    def closure(net, loader):  # noqa: ANN001
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            def again():
                opt.zero_grad()
                loss = F.cross_entropy(net(x), y)  # noqa: B023 - called at once, inside step
                loss.backward()
                return loss
            opt.step(again)

    _refused(_multi_step_round("local", _personal_fit_then(closure)), "closure")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_batchnorm_without_running_statistics_is_refused_at_set_up(placement):
    class BN(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(3, track_running_stats=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.norm(self.body(x))))

    app = ClientApp()
    JointDPClient(app, model_fn=BN, train_data=lambda ctx: _loader())
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1},
                  state=RecordDict(), run_config=_config(placement))
    InProcessGrid(app, 1, ctx.run_config)
    reply = app(Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7,
                        message_type=MessageType.QUERY), ctx)
    _refused(reply, "BatchNorm1d, which mixes the records of a batch")
    _refused(reply, "model = ModuleValidator.fix(model)")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_mixup_inside_the_loop_and_a_transformed_input_are_refused(placement):
    def mixup(net, loader):  # noqa: ANN001
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            perm = torch.arange(len(y)).flip(0)
            opt.zero_grad()
            out = net(0.7 * x + 0.3 * x[perm])
            (0.7 * F.cross_entropy(out, y) + 0.3 * F.cross_entropy(out, y[perm])).backward()
            opt.step()

    _refused(_round(placement, mixup), "mixing the records of a batch")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_weight_penalty_is_set_aside_and_a_hand_written_loss_refused(placement, caplog):
    def penalty(out, y):  # noqa: ANN001, ANN202
        return F.cross_entropy(out, y) + 1e3 * sum((p ** 2).sum() for p in penalty.net.parameters())

    def with_penalty(net, loader):  # noqa: ANN001
        penalty.net = net
        _sgd_loop(penalty)(net, loader)

    _as_honest(placement, _personal_fit_then(with_penalty), caplog, None)  # the plan's loss: the output's term only
    hand = _sgd_loop(lambda out, y: -(out.log_softmax(1)[torch.arange(len(y)), y]).mean())
    _refused(_round(placement, _personal_fit_then(hand)), "outside a torch loss function")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_users_exception_and_batch_sizes_stay_on_the_node(placement, caplog):
    """An exception on the owner's data (the personal fit, the DP pass) stays on the node:
    the round releases (whether the owner replies cannot depend on its data) and the
    exception's message is in the node's log only."""
    def leaky(net, loader):  # noqa: ANN001
        for x, _ in loader:
            raise ValueError(f"secret {float(x.sum()):.6f} in a batch of {len(x)}")

    calls = []

    def fit_then_leak(net, loader):  # noqa: ANN001
        calls.append(1)
        if len(calls) == 1:  # the dry run, on synthetic records
            return _sgd_loop()(net, loader)
        return leaky(net, loader)

    with caplog.at_level("WARNING", logger="flwr"):
        reply = _round(placement, fit_then_leak)
    assert len(calls) == 3 and np.isfinite(_release(reply)).all()
    assert set(reply.content.keys()) == {"arrays", "metrics"} and "secret" not in str(reply.content)
    logged = [r.getMessage() for r in caplog.records]
    assert any("personal fit raised ValueError: secret" in m for m in logged), logged
    assert any("DP pass: ValueError: secret" in m for m in logged), logged


# ------------------------------------------------- releases within the bound
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_honest_loop_is_within_the_sensitivity_bound(placement):
    move = _max_move(placement, _sgd_loop())
    assert 0.2 * _bound(placement) < move <= _bound(placement) * (1 + 1e-4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_class_weighted_and_ignore_index_losses_are_per_record(placement):
    weights = torch.tensor([0.2, 5.0])
    weighted = _sgd_loop(lambda out, y: F.cross_entropy(out, y, weight=weights))
    assert _max_move(placement, weighted) <= _bound(placement) * (1 + 1e-4)
    ignoring = _sgd_loop(lambda out, y: nn.CrossEntropyLoss(ignore_index=0)(out, y))
    assert _max_move(placement, ignoring) <= _bound(placement) * (1 + 1e-4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_nan_record_neither_poisons_the_release_nor_fails_the_round(placement):
    x, y = _loader().dataset.tensors
    x = x.clone()
    x[::4] = float("nan")  # every fourth record corrupt: some are in the Poisson sample
    bad = DataLoader(TensorDataset(x, y), batch_size=8)

    def fn(net, loader):  # noqa: ANN001
        if not isinstance(loader, PoissonLoader):  # the personal fit on clean data (its own business)
            return _sgd_loop()(net, DataLoader(TensorDataset(x[1::4], y[1::4]), batch_size=8))
        return _sgd_loop()(net, loader)

    release = _release(_round(placement, fn, bad))
    assert np.isfinite(release).all()


def test_a_broken_rule_is_not_charged_again_in_later_rounds(monkeypatch):
    """A train function refused for a rule of the DP pass (here a hand-written loss) is
    refused on the dry run, before the owner is charged, and would break it again: the
    owner refuses the later rounds too, charging none; its ledger stays empty."""
    from flwr_jdp.joint_dp import client as client_module

    charged = []
    real = client_module.charge_owners
    monkeypatch.setattr(client_module, "charge_owners", lambda *a, **k: charged.append(1) or real(*a, **k))
    hand = _personal_fit_then(_sgd_loop(lambda out, y: -(out.log_softmax(1)[torch.arange(len(y)), y]).mean()))
    app, jdp, ctx, loader = _client_node(_config("local"))
    replies = []
    for rnd in (1, 2):
        _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1, rnd=rnd)
        replies.append(jdp.train(train, ctx, Tiny(), loader, hand))
    _refused(replies[0], "outside a torch loss function")
    _refused(replies[1], "in an earlier round of this run")
    assert charged == [] and "ledger.0" not in ctx.state


# ------------------------------------------ attacks from the privacy review
class _TanhTiny(Tiny):
    """Every record's gradient is non-zero (the ReLU Tiny's units die on this data)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_settings_and_loss_arguments_chosen_from_the_data_do_not_reach_the_release(placement):
    """The learning rate, class weights or label smoothing a loop computes from a batch:
    the DP steps use what the train function chose on synthetic records."""
    def from_data(net, loader):  # noqa: ANN001
        opt = None
        for x, y in loader:
            big = bool(x.abs().max() > 50)  # an outlier record in this batch (never in synthetic ones)
            opt = opt or torch.optim.SGD(net.parameters(), lr=50 * LR if big else LR)
            opt.zero_grad()
            weight = torch.tensor([1.0, 1e-7]) if big else None
            F.cross_entropy(net(x), y, weight=weight, label_smoothing=0.5 if big else 0.0).backward()
            opt.step()

    assert _max_move(placement, _personal_fit_then(from_data), _TanhTiny, outlier=True) \
        <= _bound(placement) * (1 + 1e-4)


def test_edits_of_the_batch_hooks_and_modes_do_not_reach_the_release(caplog):
    """In-place edits of the batch's tensors, a forward hook that mixes the batch in, the
    model's mode switched from the data: the DP steps run on the pass's own copy of
    each batch and its own model; the release is the honest one."""
    def meddling(net, loader):  # noqa: ANN001
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            y.copy_(y.roll(1, 0))
            net.body.register_forward_pre_hook(lambda m, a, x=x: (a[0] + x.mean(0),))
            net.train(bool(x.mean() > 0))
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    _as_honest("local", _personal_fit_then(meddling), caplog, None)


def test_state_the_personal_fit_leaves_on_the_model_does_not_reach_the_release(caplog):
    """A plain attribute set from the whole data set in the personal fit (not a parameter
    or buffer): the DP steps run on a fresh model from model_fn."""
    class Centred(_TanhTiny):
        def __init__(self) -> None:
            super().__init__()
            self.mu = torch.zeros(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x - self.mu)

    def fit_sets_mu(net, loader):  # noqa: ANN001
        if not isinstance(loader, PoissonLoader):
            net.mu = loader.dataset.tensors[0].mean(0) * 100
        return _sgd_loop()(net, loader)

    honest = _release(_multi_step_round("local", _sgd_loop(), model_fn=Centred))
    np.testing.assert_array_equal(_release(_multi_step_round("local", fit_sets_mu, model_fn=Centred)), honest)


def test_no_more_steps_than_charged_and_exceptions_are_set_aside(caplog):
    """Drawing batches past the round's steps is refused (on the dry run, whatever the
    data); an exception in the DP pass on the owner's data is logged on the node and the
    pass takes the remaining steps (the release is the honest one)."""
    def greedy(net, loader):  # noqa: ANN001
        _sgd_loop()(net, loader)
        for _ in range(4):
            loader._next_batch()  # noqa: SLF001 - past the round's steps: raises

    def raising(net, loader):  # noqa: ANN001
        for i, (x, y) in enumerate(loader):
            if i == 2:
                raise ValueError(f"secret {float(x.sum())}")
            opt = torch.optim.SGD(net.parameters(), lr=LR)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    _refused(_multi_step_round("local", _personal_fit_then(greedy)), "yielded every batch of this round")
    _as_honest("local", _personal_fit_then(raising), caplog, "raised ValueError")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_nan_record_in_the_personal_fit_neither_refuses_nor_moves_the_release(placement):
    """A non-finite personal fit (one NaN record anywhere) keeps the previous personal
    values; the release does not depend on whether the NaN record is there."""
    x, y = _loader().dataset.tensors
    bad_x = x.clone()
    bad_x[0] = float("nan")
    clean = _release(_round(placement, _sgd_loop(), DataLoader(TensorDataset(x, y), batch_size=8)))
    dirty = _round(placement, _sgd_loop(), DataLoader(TensorDataset(bad_x, y), batch_size=8))
    assert dirty.has_content(), dirty.error.reason
    assert np.isfinite(_release(dirty)).all() and clean.shape == _release(dirty).shape


def test_a_run_whose_owners_all_break_a_rule_fails_after_one_round(tmp_path):
    """Every owner's train function breaks a rule of the DP pass (a hand-written loss):
    the run ends as failed after the first round, not after max-skipped-rounds, with
    one round's epsilon spent and saved."""
    from flwr_jdp.privacy.ledger import PrivacyLedger
    from flwr_jdp.strategies import JointDP, load_results

    hand = _sgd_loop(lambda out, y: -(out.log_softmax(1)[torch.arange(len(y)), y]).mean())
    app = ClientApp()
    jdp = JointDPClient(app, model_fn=Tiny, train_data=lambda ctx: _loader())

    @app.train()
    def train(msg, context):  # noqa: ANN001, ANN202
        return jdp.train(msg, context, Tiny(), _loader(), hand)

    @app.evaluate()
    def evaluate(msg, context):  # noqa: ANN001, ANN202
        jdp.load(Tiny(), msg, context)
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5, "num-examples": 40})}), reply_to=msg)

    rc = dict(_config("local"), **{"jdp.num-rounds": 3, "jdp.max-skipped-rounds": 3, "jdp.target-epsilon": 8.0,
                                   "jdp.results-dir": str(tmp_path / "run")})
    grid = InProcessGrid(app, 2, rc)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    with pytest.raises(RuntimeError, match="breaks a rule of the DP pass") as err:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=3)
    message = str(err.value)  # what ended the run: one round, not max-skipped-rounds in a row
    assert message.startswith("run failed: round 1 had too few valid replies and so would every later round "
                              "(every owner's train function breaks a rule of the DP pass"), message
    assert "rounds in a row" not in message and "instead of after max-skipped-rounds=3 skipped rounds" in message
    res = load_results(str(tmp_path / "run"))
    assert res["status"] == "failed" and res["rounds_completed"] == 1
    assert [r["round"] for r in PrivacyLedger.load(tmp_path / "run" / "ledger.json").rounds] == [1]


# ------------------------- per record by construction: models that mix records
class _MixedBackward(torch.autograd.Function):
    """Identity forward; backward hands every row the batch's summed gradient. No
    setup_context: vmap cannot trace it (the pass runs each record alone)."""

    @staticmethod
    def forward(ctx, h):  # noqa: ANN001, ANN205
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.sum(0, keepdim=True).expand_as(g).contiguous()


class _ExtremeBackward(torch.autograd.Function):
    """Backward hands every row the gradient of the most extreme record (the largest
    hidden row: an outlier's)."""

    @staticmethod
    def forward(ctx, h):  # noqa: ANN001, ANN205
        ctx.save_for_backward(h)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        (h,) = ctx.saved_tensors
        return g[h.norm(dim=1).argmax()].expand_as(g).contiguous()


class _MixedVmapRule(torch.autograd.Function):
    """Identity on a batch; under vmap its own rule hands every record the most extreme
    record's row (vmap can trace it, but the rule mixes the records it is handed)."""

    @staticmethod
    def forward(h):  # noqa: ANN001, ANN205
        return h.view_as(h)

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        pass

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g

    @staticmethod
    def vmap(info, in_dims, h):  # noqa: ANN001, ANN205
        h = h.movedim(in_dims[0], 0)
        extreme = h[h.flatten(1).norm(dim=1).argmax()].expand_as(h)
        return extreme.detach() + h - h.detach(), 0  # the extreme record's values, each record's own gradient


def _through(fn):  # noqa: ANN001, ANN202
    class Net(_TanhTiny):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(fn.apply(self.body(x))))
    Net.__name__ = f"Through{fn.__name__}"
    return Net


class _MixesWhenTraining(_TanhTiny):
    """Adds the batch's mean hidden row to every record, in training mode only (``.item()``:
    vmap cannot trace it); in eval mode each output row is its record's alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.training and float(h.abs().max().item()) < 1e9:
            h = h + 5 * h.mean(0, keepdim=True)
        return self.head(torch.tanh(h))


_MIXERS = [_through(_MixedBackward), _through(_ExtremeBackward), _through(_MixedVmapRule),
           _MixesWhenTraining]
_MIXER_IDS = ["backward-mixes", "extreme-gradient", "vmap-rule-mixes", "mixes-in-training"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("model_fn", _MIXERS, ids=_MIXER_IDS)
def test_a_model_that_mixes_records_is_within_the_bound(placement, model_fn, monkeypatch):
    """Each record's gradient comes from its own forward, loss term and backward, with
    nothing else in the batch (vmap where it keeps the records apart, else micro-batches
    of one): a custom autograd.Function whose backward or vmap rule mixes the batch, or
    a model that mixes records only in training mode, moves the release by at most the
    DP-SGD sensitivity on neighbouring data sets (an outlier record included)."""
    from flwr_jdp.training import per_sample

    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    move = _max_move(placement, _personal_fit_then(_sgd_loop()), model_fn, outlier=True)
    assert 0 < move <= _bound(placement) * (1 + 1e-4)


@pytest.mark.parametrize("model_fn", _MIXERS, ids=_MIXER_IDS)
def test_a_model_that_mixes_records_is_within_the_bound_with_every_record_in_the_batch(model_fn, monkeypatch):
    """The same models in the DP pass itself (dry run, then the release pass) with every
    record in the one batch (rate 1): the clipped sum, on neighbouring data sets with an
    outlier record, moves by at most 2C."""
    from flwr_jdp.training import per_sample
    from flwr_jdp.training.user_loop import private_training

    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    train_fn = _sgd_loop()

    def clipped_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        net = model_fn()
        net.head.requires_grad_(False)
        data = DataLoader(TensorDataset(x, y), batch_size=8)
        with private_training(net, data, unit_of_record=torch.arange(N), num_units=N, sample_rate=1.0, steps=1,
                              noise_multiplier=0.0, clipping_norm=CLIP, generator=torch.Generator().manual_seed(0),
                              capture=True, train_fn=train_fn) as (private, loader, record):
            train_fn(private, loader)
        return torch.cat([t.ravel() for t in record.clipped_sum])

    moves = []
    for i in range(0, N, 5):
        a, _ = _neighbours(i)
        x, y = (t.clone() for t in a.dataset.tensors)
        base = clipped_sum(x, y)
        x[i], y[i] = 100.0, 1 - y[i]
        moves.append(float((clipped_sum(x, y) - base).norm()))
    assert 0 < max(moves) <= 2 * CLIP * (1 + 1e-4)


# --------------------------------------- any loss built from the outputs: loss_fn
class _VAE(Tiny):
    """A tuple output (reconstruction, mean, log-variance) and a random latent draw."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(x)
        mu, logvar = torch.tanh(h), h - 1.0
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.head(z), mu, logvar


def _vae_loss(recon: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reconstruction of the first two features plus the KL term."""
    return F.mse_loss(recon, x[:, :2], reduction="sum") - 0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())


class _Output(dict):
    """A dict whose keys read as attributes (as Hugging Face's ModelOutput)."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _KwargsNet(_TanhTiny):
    """Keyword inputs, a dict-like output carrying the model's own loss (as Hugging Face's)."""

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> _Output:
        logits = super().forward(features)
        return _Output(logits=logits, loss=None if labels is None else F.cross_entropy(logits, labels))


class _DictSet(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "labels": self.y[i]}


def _loop_of(loss_of, kind: type, seen: list):  # noqa: ANN001, ANN202
    """The user's loop with ``loss_of(net, batch)`` written out in it; it records the
    model's class it gets (the model itself with loss_fn, its class unchanged)."""
    def fn(net: nn.Module, loader: DataLoader) -> None:
        seen.append(isinstance(net, kind) and type(net) is kind)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for batch in loader:
            opt.zero_grad()
            loss_of(net, batch).backward()
            opt.step()
    return fn


def _composite(net: nn.Module, b: tuple) -> torch.Tensor:
    out = net(b[0])
    return F.cross_entropy(out, b[1]) + 0.1 * out.pow(2).mean()


_LOSS_FN_CASES = {
    "vae-with-kl": (_VAE, lambda net, b: _vae_loss(*net(b[0]), b[0]), None),
    "kwargs-dict-output-own-loss": (_KwargsNet, lambda net, b: net(**b).loss,
                                    lambda x, y: DataLoader(_DictSet(x, y), batch_size=8)),
    "composite-two-terms": (_TanhTiny, _composite, None),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("case", list(_LOSS_FN_CASES))
def test_any_loss_given_as_loss_fn_is_within_the_bound(placement, case):
    """A tuple output with a KL term, keyword inputs with a dict-like output and the
    model's own loss, a loss of two terms: refused without ``loss_fn`` (the refusal says
    how to pass it), and with it the train function gets the model itself and the
    release moves by at most the DP-SGD sensitivity on neighbouring data sets (an
    outlier record included)."""
    model_fn, loss_fn, as_loader = _LOSS_FN_CASES[case]
    seen: list[bool] = []
    loop = _loop_of(loss_fn, model_fn, seen)
    loader = (as_loader or (lambda x, y: DataLoader(TensorDataset(x, y), batch_size=8)))(*_loader().dataset.tensors)
    _refused(_round(placement, loop, loader, model_fn), "pass loss_fn=")
    seen.clear()  # (without loss_fn its DP pass got the model wrapped)
    move = _max_move(placement, loop, model_fn, outlier=True, as_loader=as_loader, loss_fn=loss_fn)
    assert 0 < move <= _bound(placement) * (1 + 1e-4)
    assert seen and all(seen)


def test_with_loss_fn_a_closure_is_accepted_and_the_release_is_the_honest_one(caplog):
    """``optimizer.step(closure)`` (PyTorch Lightning always calls it) with loss_fn: the
    closure runs, its gradients are discarded, the DP step is taken: the release is the
    one of the loop without a closure, and the model the loop holds shows it."""
    shown = {}

    def closure_loop(net, loader):  # noqa: ANN001
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            def again():
                opt.zero_grad()
                loss = _composite(net, (x, y))  # noqa: B023 - called at once, inside step
                loss.backward()
                return loss
            opt.step(again)
        if isinstance(loader, PoissonLoader):
            shown.update({n: p.detach().clone() for n, p in net.named_parameters() if n.startswith("body.")})

    plain = _release(_multi_step_round("local", _loop_of(_composite, Tiny, []), loss_fn=_composite))
    with caplog.at_level("WARNING", logger="flwr"):
        got = _release(_multi_step_round("local", closure_loop, loss_fn=_composite))
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_array_equal(torch.cat([shown["body.weight"].ravel(), shown["body.bias"]]).numpy(), got)
    assert not any("changed" in r.getMessage() for r in caplog.records)


# ------------------------------------------------- buffers, loss domains, refusals
class _WithBuffers(_TanhTiny):
    """Constant buffers (as position ids), and one the forward pass updates when asked."""

    def __init__(self, updates: bool = False) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(4).expand(1, -1), persistent=False)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("running_mean", torch.zeros(4))
        self.updates = updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.updates and self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return super().forward(x[:, self.position_ids[0]] * self.scale - self.running_mean)


class _BN(_TanhTiny):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.body(x))))


def test_constant_buffers_are_accepted_and_a_buffer_the_forward_pass_changes_refused():
    """Buffers the forward pass leaves as they are (position ids, a constant scale) are
    accepted; one it updates (running statistics) is refused on the dry run, before the
    owner is charged; BatchNorm replaced by Opacus's ModuleValidator.fix (GroupNorm)
    trains."""
    from opacus.validators import ModuleValidator

    move = _max_move("local", _personal_fit_then(_sgd_loop()), _WithBuffers, outlier=True, stride=6)
    assert 0 < move <= _bound("local") * (1 + 1e-4)
    refused = _round("local", _personal_fit_then(_sgd_loop()), model_fn=lambda: _WithBuffers(updates=True))
    _refused(refused, "changes its buffers ['running_mean']")
    fixed = _round("local", _personal_fit_then(_sgd_loop()), model_fn=lambda: ModuleValidator.fix(_BN()))
    assert np.isfinite(_release(fixed)).all()


class _Probabilities(_TanhTiny):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(super().forward(x))


class _LogProbabilities(_TanhTiny):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(super().forward(x), dim=1)


@pytest.mark.parametrize("loss,model_fn,one_hot", [(nn.BCELoss(), _Probabilities, True),
                                                   (nn.CrossEntropyLoss(), _TanhTiny, False),
                                                   (nn.NLLLoss(), _LogProbabilities, False)],
                         ids=["bce-on-sigmoid", "cross-entropy-class-indices", "nll"])
def test_the_dry_run_respects_the_losss_domain(loss, model_fn, one_hot):
    """The synthetic records hold values every loss accepts (floats in [0, 1], class 0):
    BCELoss on a sigmoid output, CrossEntropyLoss with class indices and NLLLoss pass the
    dry run and release within the bound."""
    def as_loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
        return DataLoader(TensorDataset(x, F.one_hot(y, 2).float() if one_hot else y), batch_size=8)

    move = _max_move("local", _personal_fit_then(_sgd_loop(loss)), model_fn, outlier=True, stride=6,
                     as_loader=as_loader)
    assert 0 < move <= _bound("local") * (1 + 1e-4)


def test_a_refusal_on_the_dry_run_costs_the_owner_nothing():
    """A rule broken on the dry run (a loss_fn returning no scalar; a hand-written loss:
    ``test_a_broken_rule_is_not_charged_again_in_later_rounds``) is refused before the
    owner's ledger is charged; an honest round then charges it."""
    app, jdp, ctx, loader = _client_node(_config("local"))
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1)
    not_scalar = jdp.train(train, ctx, Tiny(), loader, _loop_of(lambda net, b: F.cross_entropy(net(b[0]), b[1]),
                                                                Tiny, []),
                           loss_fn=lambda net, b: (F.cross_entropy(net(b[0]), b[1]), net(b[0])))
    _refused(not_scalar, "must return the batch's loss as a scalar tensor (it returned a tuple)")
    assert "ledger.0" not in ctx.state
    app, jdp, ctx, loader = _client_node(_config("local"))
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1)
    assert jdp.train(train, ctx, Tiny(), loader, _sgd_loop()).has_content()
    assert "ledger.0" in ctx.state


def test_a_tiny_bert_through_the_drop_in_client_is_within_the_bound():
    """A randomly initialised BertForSequenceClassification (a small BertConfig, no
    download: keyword inputs, a ModelOutput, the model's own loss, constant position and
    token-type id buffers) through JointDPClient.train with loss_fn: the release moves by
    at most the DP-SGD sensitivity on neighbouring data sets."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=8, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def bert() -> nn.Module:
        return transformers.BertForSequenceClassification(config)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.ids = (x.abs() * 7).long().clamp(max=31)
            self.y = y

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(4, dtype=torch.long), "labels": self.y[i]}

    seen: list[bool] = []
    loop = _loop_of(lambda net, b: net(**b).loss, type(bert()), seen)
    move = _max_move("local", loop, bert, outlier=True, stride=8, loss_fn=lambda net, b: net(**b).loss,
                     personal="classifier.", as_loader=lambda x, y: DataLoader(Tokens(x, y), batch_size=8))
    assert 0 < move <= _bound("local") * (1 + 1e-4)
    assert seen and all(seen)


def test_a_lightning_module_through_the_drop_in_client_releases_what_the_plain_loop_does(caplog):
    """PyTorch Lightning's Trainer (``step(closure)``, a batch fetched ahead, the module's
    own optimizer) with loss_fn: the train function gets the LightningModule itself, and
    the release is bit for bit the one of a plain loop with the same loss and optimizer."""
    pl = pytest.importorskip("pytorch_lightning")

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

        def training_step(self, batch: tuple, _: int) -> torch.Tensor:
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    seen: list[bool] = []

    def fit(net: nn.Module, loader: DataLoader) -> None:
        seen.append(isinstance(net, pl.LightningModule))
        pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0).fit(net, loader)

    def loss_fn(net: nn.Module, b: tuple) -> torch.Tensor:
        return F.cross_entropy(net(b[0]), b[1])

    plain = _release(_multi_step_round("local", _loop_of(loss_fn, Lit, []), steps=3, model_fn=Lit, loss_fn=loss_fn))
    with caplog.at_level("WARNING", logger="flwr"):
        lit = _release(_multi_step_round("local", fit, steps=3, model_fn=Lit, loss_fn=loss_fn))
    np.testing.assert_array_equal(lit, plain)
    assert seen and all(seen)
    assert not any("DP pass:" in r.getMessage() for r in caplog.records)  # each step took its own draw


# ----------------------- the privacy review's second pass: layouts and refusals
T = 5  # sequence length of the sequence cases


class _SeqNet(nn.Module):
    """A per-time-step classifier: any layout (time first or records first) of (.., .., 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _seq_loss(net: nn.Module, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(net(batch[0]).reshape(-1, 2), batch[1].reshape(-1))


def _stack(time_first):  # noqa: ANN001, ANN202
    """A collate stacking records along dim 1 (pad_sequence's default) where ``time_first(xs)``, else dim 0."""
    def collate(items):  # noqa: ANN001, ANN202
        xs, ys = zip(*items, strict=True)
        dim = 1 if time_first(torch.stack(xs)) else 0
        return torch.stack(xs, dim=dim), torch.stack(ys, dim=dim)
    return collate


def _seq_loader(collate):  # noqa: ANN001, ANN202
    def as_loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
        xs = torch.stack([x * (1 + t / T) for t in range(T)], dim=1)  # (N, T, 4)
        return DataLoader(TensorDataset(xs, y[:, None].expand(-1, T).contiguous()), batch_size=8,
                          collate_fn=collate)
    return as_loader


def _seq_loop(net: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for batch in loader:
        opt.zero_grad()
        _seq_loss(net, batch).backward()
        opt.step()


def _with_constant(items):  # noqa: ANN001, ANN202
    xs, ys = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys), torch.ones(T, T)  # a (T, T) mask in the batch


def _with_names(items):  # noqa: ANN001, ANN202
    xs, ys = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys), [f"record {float(x.sum()):.3f}" for x in xs]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("collate,says", [(_stack(lambda xs: True), "a tensor of shape (5, 2, 4)"),
                                          (_with_constant, "a tensor of shape (5, 5)"),
                                          (_with_names, "a str")],
                         ids=["time-first", "a-constant-in-the-batch", "strings-in-the-batch"])
def test_with_loss_fn_a_batch_without_the_records_along_dim_0_is_refused_on_the_dry_run(placement, collate, says):
    """A collate that stacks records along dim 1 (pad_sequence's default, nn.LSTM's layout),
    or puts a constant or strings in the batch: with loss_fn each record's loss would see
    the whole batch (the review measured 3x the DP-SGD bound). Refused on the dry run,
    whatever the data, before the owner is charged, saying how to fix it; the same data and
    loss with the records along dim 0 release within the DP-SGD bound."""
    app, jdp, ctx, _ = _client_node(_config(placement), model_fn=_SeqNet)
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1, model_fn=_SeqNet)
    loader = _seq_loader(collate)(*_loader().dataset.tensors)
    reply = jdp.train(train, ctx, _SeqNet(), loader, _seq_loop, loss_fn=_seq_loss)
    _refused(reply, f"the batch holds {says} for a batch of 2 records")
    _refused(reply, "records along dim 0 (pad_sequence(..., batch_first=True)")
    _refused(reply, "move constants")
    assert "ledger.0" not in ctx.state
    move = _max_move(placement, _seq_loop, _SeqNet, outlier=True, stride=4, loss_fn=_seq_loss,
                     as_loader=_seq_loader(_stack(lambda xs: False)))
    assert 0 < move <= _bound(placement) * (1 + 1e-4)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_without_loss_fn_a_time_first_input_is_refused_even_when_its_length_is_the_dry_runs_batch(placement):
    """Without loss_fn the pass splits the model's input and the loss's target by rows: a
    time-first batch whose sequence length (2) was the old dry run's batch size passed it
    and was split along time on the owner's batches. The dry run's batch sizes are now no
    dimension of a record: refused whatever the data."""
    def two_steps(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
        xs = torch.stack([x, 2 * x], dim=1)  # (N, 2, 4)
        return DataLoader(TensorDataset(xs, torch.stack([y, y], dim=1)), batch_size=8,
                          collate_fn=_stack(lambda xs: True))

    def loop(net: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x).reshape(-1, 2), y.reshape(-1)).backward()
            opt.step()

    reply = _round(placement, _personal_fit_then(loop), two_steps(*_loader().dataset.tensors), _SeqNet)
    _refused(reply, "records along dim 0")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_layout_chosen_from_the_data_is_computed_record_by_record_within_the_bound(placement, caplog):
    """A collate that goes time first only when an outlier record is in the batch (never on
    synthetic records, so the dry run accepts it): that batch cannot be split by rows, and
    each of its records' gradients comes from a batch of that record alone (collated
    alone), also where the batch happens to hold as many records as time steps (its dim 0
    then has the batch's size: a check of the shapes alone would split it along time).
    Neither refused nor zeroed (zeroing the batch would let one record remove the whole
    batch's sum): the release moves by at most the DP-SGD sensitivity."""
    chooser = _stack(lambda xs: bool(xs.abs().max() > 50))
    with caplog.at_level("WARNING", logger="flwr"):
        move = _max_move(placement, _seq_loop, _SeqNet, outlier=True, stride=2, loss_fn=_seq_loss,
                         as_loader=_seq_loader(chooser))
    assert 0 < move <= _bound(placement) * (1 + 1e-4)
    assert any("rows were not each record's own batch" in r.getMessage() for r in caplog.records)


def _corrupt_label(i: int | slice | None) -> DataLoader:
    """The neighbours' data with record ``i``'s label (or those of a slice) outside the head's two classes."""
    x, y = (t.clone() for t in _neighbours(0)[0].dataset.tensors)
    if i is not None:
        y[i] = 2
    return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("with_loss_fn", [False, True], ids=["torch-loss", "loss_fn"])
def test_a_record_whose_loss_raises_changes_neither_whether_the_owner_replies_nor_the_bound(placement,
                                                                                          with_loss_fn, caplog):
    """One record with a label the 2-class head does not have: the dry run (class 0) passes;
    on the owner's data its loss raises (IndexError) when it is sampled, in the personal fit
    (a textbook loop with no guard), in the vectorised pass and in its micro-batch. The
    owner replies on both neighbours (the record valid or corrupt) in every round, is never
    marked as breaking a rule, and the corrupt record's gradient is zero: the release moves
    by at most the DP-SGD sensitivity. The exception's message stays in the node's log."""
    kw = {"loss_fn": lambda net, b: F.cross_entropy(net(b[0]), b[1])} if with_loss_fn else {}
    loop = _loop_of(lambda net, b: F.cross_entropy(net(b[0]), b[1]), _TanhTiny, [])
    moves = []
    with caplog.at_level("WARNING", logger="flwr"):
        for i in range(0, N, 3):
            honest, corrupt = (_round(placement, loop, _corrupt_label(j), _TanhTiny, **kw) for j in (None, i))
            assert not honest.has_error() and not corrupt.has_error(), (honest.error or corrupt.error).reason
            moves.append(float(np.linalg.norm(_release(honest) - _release(corrupt))))
    assert 0 < max(moves) <= _bound(placement) * (1 + 1e-4)
    logged = [r.getMessage() for r in caplog.records]
    assert any("personal fit raised IndexError" in m for m in logged)
    assert any("a record's gradient was set to zero" in m and "IndexError" in m for m in logged)
    app, jdp, ctx, loader = _client_node(_config(placement), _corrupt_label(slice(None, None, 4)), _TanhTiny)
    caplog.clear()
    with caplog.at_level("WARNING", logger="flwr"):
        for rnd in (1, 2):  # a quarter of the records corrupt: sampled in every round
            _, _, train = _setup_and_instruction(app, ctx, Z, Q, 5, rnd=rnd, model_fn=_TanhTiny)
            assert np.isfinite(_release(jdp.train(train, ctx, _TanhTiny(), loader, loop, **kw))).all()
    assert any("a record's gradient was set to zero" in r.getMessage() for r in caplog.records)
    assert "jdp.refused.0" not in ctx.state


# ----------------------------- state a model keeps outside its buffers (review 2, A5)
class _RunningCentre(_TanhTiny):
    """Shifts its inputs by a running sum of the training inputs, kept in a plain float."""

    def __init__(self) -> None:
        super().__init__()
        self.center = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.center = self.center + float(x.detach().mean())
        return super().forward(x - self.center)


class _Seen(_TanhTiny):
    """Keeps each training batch's mean in a list, and shifts its inputs by their mean."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(x.detach().mean())
        return super().forward(x - torch.stack(self.seen).mean() if self.seen else x)


class _CountsInPlace(_TanhTiny):
    """A submodule's plain tensor attribute (not a buffer) updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.body.total = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.body.total.add_(x.detach().sum(0))
        return super().forward(x - 1e-3 * self.body.total)


@pytest.mark.parametrize("model_fn,name", [(_RunningCentre, "center"), (_Seen, "seen"),
                                           (_CountsInPlace, "body.total")], ids=["float", "list", "tensor"])
def test_state_the_forward_pass_keeps_in_attributes_is_refused_on_the_dry_run(model_fn, name):
    """A forward pass that changes an attribute holding state (a number, a list of tensors,
    a plain tensor in place) would carry one record into the others' gradients: refused on
    the dry run (synthetic records, whatever the data), naming the attribute, before the
    owner is charged."""
    app, jdp, ctx, loader = _client_node(_config("local"), model_fn=model_fn)
    _, _, train = _setup_and_instruction(app, ctx, Z, Q, 1, model_fn=model_fn)
    reply = jdp.train(train, ctx, model_fn(), loader, _personal_fit_then(_sgd_loop()))
    _refused(reply, f"changes its attribute(s) ['{name}']")
    assert "ledger.0" not in ctx.state


class _TriggeredCentre(_RunningCentre):
    """The running sum, updated only by a batch holding a value beyond 10: the synthetic
    records (in [0, 1]) never trigger it, an outlier record does (micro-batches of one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and float(x.detach().abs().max()) > 10:
            self.center = self.center + float(x.detach().mean())
        return _TanhTiny.forward(self, x - self.center)


class _TriggeredTensor(_TanhTiny):
    """The same as a tensor, vmap-traceable (the vectorised pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.center = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x.detach() + 0 * x
            self.center = self.center + torch.where(x.abs().amax() > 10, x.mean(), 0.0)
        return super().forward(x - self.center)


@pytest.mark.parametrize("placement,model_fn", [("local", _TriggeredCentre), ("central", _TriggeredCentre),
                                                ("local", _TriggeredTensor)],
                         ids=["local-micro", "central-micro", "local-vmap"])
def test_state_only_the_owners_data_changes_is_put_back_within_the_bound(placement, model_fn, monkeypatch):
    """A state change the synthetic records do not trigger passes the dry run; the release
    pass puts the model's state back after each record's (micro-batches) or batch's
    (vmap) computation, so an outlier record moves the release by at most the DP-SGD
    sensitivity on neighbouring data sets (without it: 1.4x the bound)."""
    from flwr_jdp.training import per_sample

    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    move = _max_move(placement, _personal_fit_then(_sgd_loop()), model_fn, outlier=True, stride=4)
    assert 0 < move <= _bound(placement) * (1 + 1e-4)


def test_the_vectorised_pass_puts_state_back_for_each_chunk(monkeypatch):
    """In chunks of two records, each record's gradient by the vectorised pass equals its
    gradient computed alone on the model as it came, though an outlier in the first chunk
    changes the model's state; the state is as it came after the pass."""
    from flwr_jdp.training import per_sample

    monkeypatch.setattr(per_sample, "CHUNK", 2)
    torch.manual_seed(0)
    net = _TriggeredTensor()
    x, y = torch.rand(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    x[0] = 100.0

    def loss_one(out: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, yi.unsqueeze(0))

    def per_record(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        engine = per_sample.FuncPerSample(model, set_train=True)
        engine._per_record((xs,), ys, loss_one, len(ys), randomness="different")  # noqa: SLF001
        rows = [p.grad_sample.materialize() if isinstance(p.grad_sample, per_sample.OuterProducts)
                else p.grad_sample for p in model.parameters()]
        return torch.cat([g.reshape(len(ys), -1) for g in rows], 1)

    together = per_record(net, x, y)
    assert net.center.item() == 0.0
    alone = torch.cat([per_record(copy.deepcopy(net), x[i:i + 1], y[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(together, alone)


# ------------------------------------ records as NumPy arrays: the dry run (review 2, A1)
class _NumpyTable(torch.utils.data.Dataset):
    """The usual tabular Dataset: rows of NumPy arrays (float32 features, an int64 label),
    and optionally a value of another type."""

    def __init__(self, x: np.ndarray, y: np.ndarray, extra: object = None) -> None:
        self.x, self.y, self.extra = x, y, extra

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):  # noqa: ANN204
        return (self.x[i], self.y[i]) if self.extra is None else (self.x[i], self.y[i], self.extra)


def _numpy_loader(nan_first: bool, extra: object = None) -> DataLoader:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(N, 4)) + 7).astype(np.float32)  # every value outside [0, 1]
    y = rng.integers(0, 2, size=N).astype(np.int64)
    if nan_first:
        x[0, 2] = np.nan  # one missing value in record 0
    return DataLoader(_NumpyTable(x, y, extra), batch_size=8)


def test_the_dry_run_reads_none_of_the_records_when_they_are_numpy_arrays():
    """Records as NumPy arrays are replaced by synthetic ones on the dry run (floats in
    [0, 1], labels 0): a loop that stops on a non-finite loss replies on both neighbours
    (record 0 clean, or holding a NaN), and the first batch the train function sees (the
    dry run's) holds none of the owner's values; a record holding a type the pass cannot
    synthesize is refused whatever its value, naming the fix."""
    seen: list[torch.Tensor] = []

    def careful(net: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for x, y in loader:
            seen.append(x.clone())
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            if not torch.isfinite(loss):  # ordinary code: stop on a non-finite loss
                raise FloatingPointError("non-finite loss")
            loss.backward()
            opt.step()

    for nan_first in (False, True):
        seen.clear()
        reply = _round("local", careful, _numpy_loader(nan_first))
        assert np.isfinite(_release(reply)).all()
        assert seen and bool(((seen[0] >= 0) & (seen[0] <= 1)).all())  # the dry run's batch: synthetic
    for extra in (object(), object()):
        _refused(_round("local", careful, _numpy_loader(False, extra)),
                 "holds a value of type object, which the DP pass cannot replace by a synthetic value")


# --------------------------------- the owner unit: whether it replies (review 2, A2)
def _owner_round(placement: str, train_fn, loader: DataLoader) -> Message:  # noqa: ANN001
    config = dict(_config(placement), **{"jdp.privacy-unit": "owner"})
    app, jdp, ctx, loader = _client_node(config, loader)
    torch.manual_seed(0)
    _, _, train = _setup_and_instruction(app, ctx, Z, 1.0, 1)
    torch.manual_seed(0)
    return jdp.train(train, ctx, Tiny(), loader, train_fn)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_owner_unit_replies_whatever_its_data(placement, caplog):
    """Owner unit: a NaN in one record (plain SGD spreads it to every weight) or an
    exception of the train function on the owner's data makes the update zero, logged on
    the node: the owner replies on both neighbours, the release is the noise alone (under
    local noise; zero under central), and it moves by at most C, the owner unit's
    sensitivity."""
    def nan_loader(nan: bool) -> DataLoader:
        x, y = (t.clone() for t in _neighbours(0)[0].dataset.tensors)
        if nan:
            x[5, 1] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=8)

    def raises_on_outliers(net: nn.Module, loader: DataLoader) -> None:
        for x, _ in loader:
            if float(x.abs().max()) > 10:
                raise ValueError("an outlier")
        _sgd_loop()(net, loader)

    clean = _release(_owner_round(placement, _sgd_loop(), nan_loader(False)))
    noise_only = _release(_owner_round(placement, lambda net, loader: None, nan_loader(False)))
    with caplog.at_level("WARNING", logger="flwr"):
        nan = _release(_owner_round(placement, _sgd_loop(), nan_loader(True)))
        x, y = (t.clone() for t in nan_loader(False).dataset.tensors)
        x[3] = 100.0
        raised = _release(_owner_round(placement, raises_on_outliers, DataLoader(TensorDataset(x, y), batch_size=8)))
    np.testing.assert_array_equal(nan, noise_only)
    np.testing.assert_array_equal(raised, noise_only)
    assert 0 < np.linalg.norm(clean - nan) <= CLIP * (1 + 1e-4)
    logged = [r.getMessage() for r in caplog.records]
    assert any("Owner-unit update set to zero" in m and "non-finite" in m for m in logged)
    assert any("Owner-unit update set to zero" in m and "ValueError" in m for m in logged)
