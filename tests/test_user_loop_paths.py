"""The user's own training loop (the drop-in client's DP pass) gets the same
per-record gradients from whole-model ``torch.func`` (the default) as from
micro-batches of one record (the path for models ``vmap`` cannot trace).

:func:`~flwr_jdp.training.user_loop.private_training` hands the user's train
function a :class:`~flwr_jdp.training.user_loop.PrivateModule` whose output is lazy:
the torch loss function the user applies to it is computed record by record in one
vectorised pass. It must release what micro-batches of one release on the same
per-record terms (mean or sum reduced, a sequence loss), on the four model families
of ``tests/test_per_sample_paths.py``, record and user units, central (the clipped
sum) and local noise (the parameters after noiseless steps with the user's momentum
optimizer); dropout runs on torch.func; a model it cannot run falls back to
micro-batches of one record with one log line.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.training import per_sample, user_loop
from flwr_jdp.training.user_loop import UserLoopError, private_training
from tests.test_per_sample_paths import MODELS, _case

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _loss(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction=reduction)  # the LSTM's (n, classes, positions) too


def _train_fn(reduction: str, lr: float = 0.3):
    def train(model: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model.train()
        for _ in range(2):  # two passes: the loader yields the planned steps in total
            for xb, yb in loader:
                opt.zero_grad()
                _loss(model(xb), yb, reduction).backward()
                opt.step()
    return train


def _run(backend: str, monkeypatch, name: str, unit: str, *, capture: bool, reduction: str = "mean",
         steps: int = 3) -> tuple[list[torch.Tensor], str, nn.Module]:
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    model, split, x, y = _case(name)
    for n, p in model.named_parameters():
        p.requires_grad_(n in split.shared)  # the release's model: personal parameters frozen
    n = len(y)
    units = torch.arange(n) if unit == "record" else torch.arange(n) % 5
    data = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=4)
    with private_training(model, data, unit_of_record=units, num_units=int(units.max()) + 1, sample_rate=0.8,
                         steps=1 if capture else steps, noise_multiplier=0.0, clipping_norm=0.5,
                         generator=torch.Generator().manual_seed(4),
                         capture=capture) as (private, loader, record):
        _train_fn(reduction)(private, loader)
        path = private.path
    assert not any(getattr(p, "grad_sample", None) is not None for p in model.parameters())
    if capture:
        return record.clipped_sum, path, model
    assert all(torch.equal(record.release[n], p) for n, p in model.named_parameters() if n in record.release)
    return [p.detach().clone() for p in model.parameters()], path, model


@pytest.mark.parametrize("unit", ["record", "user"])
@pytest.mark.parametrize("name", MODELS)
def test_the_users_loop_gives_the_same_clipped_sum_on_both_paths(name, unit, monkeypatch):
    fast, path, _ = _run("auto", monkeypatch, name, unit, capture=True)
    hooks, _, _ = _run("micro", monkeypatch, name, unit, capture=True)
    assert path == "torch.func"
    assert any(float(s.abs().max()) > 0 for s in fast)
    for a, b in zip(fast, hooks, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-6 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", MODELS)
def test_noiseless_steps_of_the_users_optimizer_end_at_the_same_parameters(name, reduction, monkeypatch):
    """Each record's term of the loss is clipped, whatever the batch reduction: the
    user's mean and sum release the same with one label per record (a sequence's
    term is the mean over its positions under "mean", the sum under "sum")."""
    fast, path, model = _run("auto", monkeypatch, name, "record", capture=False, reduction=reduction)
    hooks, path_alone, _ = _run("micro", monkeypatch, name, "record", capture=False, reduction=reduction)
    other, _, _ = _run("auto", monkeypatch, name, "record", capture=False,
                       reduction="sum" if reduction == "mean" else "mean")
    start, _, _, _ = _case(name)
    assert path == "torch.func" and path_alone == "micro-batch"
    moved = [not torch.equal(a, b) for a, b in zip(fast, start.parameters(), strict=True)]
    shared = [p.requires_grad for p in model.parameters()]
    assert moved == shared  # the shared parameters moved, the frozen personal ones did not
    for a, b, c in zip(fast, hooks, other, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        if name != "char-lstm":
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.body(x))))


def _capture_round(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train_fn=None):  # noqa: ANN001
    data = DataLoader(TensorDataset(x, y), batch_size=len(y))
    with private_training(model, data, unit_of_record=torch.arange(len(y)), num_units=len(y), sample_rate=1.0,
                         steps=1, noise_multiplier=0.0, clipping_norm=1.0, generator=torch.Generator().manual_seed(0),
                         capture=True) as (private, loader, record):
        (train_fn or _train_fn("mean"))(private, loader)
        path = private.path
    return record.clipped_sum, path


def _one_step(model: nn.Module, loader: DataLoader) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()


def test_a_model_with_dropout_runs_on_torch_func_record_by_record(monkeypatch):
    """Dropout under vmap draws each record's own mask: the per-record gradients are
    those of each record alone (clipped to C), so the clipped sum of a one-record
    batch has norm <= C and the pass never needs micro-batches."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    torch.manual_seed(2)
    sums, path = _capture_round(_Dropout(), torch.randn(10, 6), torch.randint(0, 3, (10,)), _one_step)
    assert path == "torch.func" and not per_sample.FUNC_FAILED
    assert 0 < float(torch.cat([s.ravel() for s in sums]).norm()) <= 10 * 1.0 + 1e-5
    torch.manual_seed(2)
    one, _ = _capture_round(_Dropout(), torch.randn(1, 6), torch.randint(0, 3, (1,)), _one_step)
    assert float(torch.cat([s.ravel() for s in one]).norm()) <= 1.0 + 1e-6


class _ItemInForward(nn.Module):
    """``.item()`` in forward: vmap cannot run it; micro-batches of one can."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        scale = 1.0 if float(h.abs().max().item()) < 1e9 else 0.5
        return self.head(torch.relu(h) * scale)


def test_a_model_vmap_cannot_run_falls_back_to_micro_batches_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with caplog.at_level(logging.WARNING):
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            runs.append(_capture_round(_ItemInForward(), x, y))
    lines = [r for r in caplog.records if "torch.func cannot handle" in r.getMessage()]
    assert len(lines) == 1 and "_ItemInForward" in lines[0].getMessage()
    assert [path for _, path in runs] == ["micro-batch", "micro-batch"]
    alone = []  # each record in a round of its own: the clipped sum is the sum of theirs
    for i in range(6):
        torch.manual_seed(0)
        alone.append(_capture_round(_ItemInForward(), x[i:i + 1], y[i:i + 1])[0])
    for sums, _ in runs:
        for j, s in enumerate(sums):
            torch.testing.assert_close(s, sum(a[j] for a in alone), rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(per_sample, "BACKEND", "func")  # FLWR_JDP_PER_SAMPLE=func: no fallback
    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    with pytest.raises(UserLoopError, match="torch.func failed"):
        torch.manual_seed(0)
        _capture_round(_ItemInForward(), x, y)


def test_the_drop_in_release_runs_through_torch_func_by_default(monkeypatch):
    """Micro-batches made unusable: the quickstart model's round must not need them."""
    monkeypatch.setattr(user_loop._DPPass, "_micro", lambda *a: (_ for _ in ()).throw(AssertionError("micro")))
    sums, path, _ = _run("auto", monkeypatch, "quickstart", "record", capture=True)
    assert path == "torch.func" and all(np.isfinite(s.numpy()).all() for s in sums)


def test_the_models_training_mode_is_left_as_the_users_loop_set_it(monkeypatch):
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    _capture_round(model, torch.randn(6, 4), torch.randint(0, 3, (6,)), _one_step)
    assert not model.training


class _CentresTheBatch(nn.Module):
    """Subtracts the batch mean: a record's output depends on the other records."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0, keepdim=True))


def test_a_model_that_mixes_records_is_computed_record_by_record_or_refused(monkeypatch):
    """torch.func and micro-batches run each record alone (the batch mean of one record
    is itself): the clipped sum of a batch is the sum of each record's own clipped
    gradient."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    torch.manual_seed(0)
    sums, path = _capture_round(_CentresTheBatch(), x, y, _one_step)
    alone = []
    for i in range(6):
        torch.manual_seed(0)
        alone.append(_capture_round(_CentresTheBatch(), x[i:i + 1], y[i:i + 1], _one_step)[0])
    assert path == "torch.func"
    monkeypatch.setattr(per_sample, "BACKEND", "micro")
    torch.manual_seed(0)
    micro, path = _capture_round(_CentresTheBatch(), x, y, _one_step)
    assert path == "micro-batch"
    for j, (s, m) in enumerate(zip(sums, micro, strict=True)):
        torch.testing.assert_close(s, sum(a[j] for a in alone), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m, sum(a[j] for a in alone), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["func", "micro"])
def test_the_train_function_reaches_the_models_own_attributes(backend, monkeypatch):
    """Inside the DP pass the user's train function gets the model wrapped
    (parameters named ``_module.<name>``, as Opacus names them); the model's own
    attributes and methods (``net.fc``, ``net.head_only()``) are still the model's."""
    monkeypatch.setattr(per_sample, "BACKEND", backend)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.fc = nn.Linear(4, 2)
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.body(x))) * self.scale

        def head_only(self) -> list[nn.Parameter]:
            return list(self.fc.parameters())

    net = Net()
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=4)
    with private_training(net, data, unit_of_record=torch.arange(8), num_units=8, sample_rate=0.5, steps=1,
                          noise_multiplier=0.0, clipping_norm=1.0,
                          generator=torch.Generator().manual_seed(0)) as (private, loader, _):
        assert private.fc is net.fc and private.scale == 2.0
        assert private.head_only() == list(net.fc.parameters())
        assert {n for n, _ in private.named_parameters()} == {f"_module.{n}" for n, _ in net.named_parameters()}
        with pytest.raises(AttributeError):
            _ = private.no_such_attribute
        _one_step(private, loader)


def test_the_output_and_loss_the_user_sees_are_the_real_ones(monkeypatch):
    """The lazy output holds each record's real output once the loss is computed (or
    when read first); the loss value is the user's own reduction of it."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    expected = model(x).detach()
    seen = {}

    def train(m: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            out = m(xb)
            seen["first"] = out.argmax(1)  # read before the loss
            loss = F.cross_entropy(out, yb, label_smoothing=0.1)
            loss.backward()
            seen["loss"] = loss.item()
            seen["out"] = out.detach().clone()
            opt.step()

    _capture_round(model, x, y, train)
    torch.testing.assert_close(seen["out"], expected)
    assert torch.equal(seen["first"], expected.argmax(1))
    assert seen["loss"] == pytest.approx(float(F.cross_entropy(expected, y, label_smoothing=0.1)), rel=1e-5)


def _epochs_loop(epochs: int, per_pass: list[int]):
    def train(model: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(epochs):
            n = 0
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                n += 1
            per_pass.append(n)
    return train


@pytest.mark.parametrize("loop_epochs,local_epochs,expected,outcome", [
    (3, 3, [2, 2, 2], "quiet"),     # the user's epochs = local-epochs: one epoch's steps per pass
    (3, 1, [6, 0, 0], "warned"),    # the user loops 3 epochs, the owners agreed to 1: said once
    (1, 3, [2], "completed"),       # fewer passes than epochs: the pass takes the other steps
])
def test_each_pass_over_the_private_loader_is_one_epoch_of_the_schedule(loop_epochs, local_epochs, expected,
                                                                       outcome, caplog, monkeypatch):
    monkeypatch.setitem(user_loop._WARNED, "epochs", False)
    net = nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,))), batch_size=4)
    per_pass: list[int] = []
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        for _ in range(2):  # two rounds: the too-many-epochs warning is given once per process
            per_pass.clear()
            with private_training(net, data, unit_of_record=torch.arange(16), num_units=16, sample_rate=0.25,
                                  steps=6, noise_multiplier=1.0, clipping_norm=1.0, epochs=local_epochs,
                                  generator=torch.Generator().manual_seed(0)) as (private, loader, record):
                assert len(loader) == (6 if local_epochs == 1 else 2)
                _epochs_loop(loop_epochs, per_pass)(private, loader)
            assert per_pass == expected and record.steps_taken == 6
    finally:
        flwr_logger.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if outcome == "warned":
        assert len(messages) == 1 and "local-epochs = 3" in messages[0]
    elif outcome == "completed":  # said each round
        assert len(messages) == 2 and all("local-epochs = 3" in m for m in messages)
    else:
        assert messages == []


@pytest.mark.parametrize("backend", ["func", "micro"])
def test_unfrozen_parameters_never_move_and_a_skipped_batch_keeps_the_draw_order(backend, monkeypatch):
    """Parameters outside the release (frozen personal layers) that the train function
    unfreezes get no gradient and never move; a batch drawn but not stepped on, then
    two steps on the next: DP step k still uses draw k (the skipped batch is stepped
    on first, the second step of a batch is set aside): the release is the honest
    loop's."""
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net[1].requires_grad_(False)  # the "personal" layer, held at its public values
    before = [p.detach().clone() for p in net[1].parameters()]
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,))), batch_size=4)

    def unfreezing(model, loader):
        model.requires_grad_(True)
        _one_step(model, loader)

    def peeking(model, loader):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        it = iter(loader)
        next(it)  # drawn, never stepped on
        xb, yb = next(it)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    def run(fn):
        with private_training(net, data, unit_of_record=torch.arange(16), num_units=16, sample_rate=0.5,
                              steps=4, noise_multiplier=1.0, clipping_norm=1.0,
                              generator=torch.Generator().manual_seed(0)) as (private, loader, _):
            fn(private, loader)

    run(unfreezing)
    assert all(torch.equal(a, b) for a, b in zip(before, net[1].parameters(), strict=True))
    net.requires_grad_(True)
    net[1].requires_grad_(False)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    run(peeking)
    peeked = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(start)

    def honest(model, loader):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    run(honest)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(peeked[k], v)


def test_a_sequence_loss_on_the_reshaped_output_is_per_record(monkeypatch):
    """``F.cross_entropy(out.reshape(-1, V), y.reshape(-1))``: each record's block of
    rows is its term; the same clipped sum as the loss on the unreshaped output."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 5)
            self.out = nn.Linear(5, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.emb(x)))  # (n, L, V)

    x, y = torch.randint(0, 7, (6, 4)), torch.randint(0, 7, (6, 4))

    def flat(m: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(m(xb).reshape(-1, 7), yb.reshape(-1)).backward()
            opt.step()

    def channels(m: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(m(xb).transpose(1, 2), yb).backward()  # a transpose is not a reshape
            opt.step()

    torch.manual_seed(0)
    a, _ = _capture_round(Seq(), x, y, flat)
    torch.manual_seed(0)
    model = Seq()
    per_record = []
    for i in range(6):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]).reshape(-1, 7), y[i].reshape(-1)).backward()  # its positions' mean
        g = torch.cat([p.grad.ravel() for p in model.parameters()])
        per_record.append(g * min(1.0, 1.0 / float(g.norm())))
    torch.testing.assert_close(torch.cat([s.ravel() for s in a]), sum(per_record), rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    with pytest.raises(UserLoopError, match="outside a torch loss function"):
        _capture_round(Seq(), x, y, channels)


def test_a_binary_loss_on_the_squeezed_output_is_per_record(monkeypatch):
    """``BCEWithLogitsLoss()(out.squeeze(1), y.float())``, as binary classifiers write
    it: the squeeze keeps one row per record; the loss is computed record by record."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))

    def binary(m: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            nn.BCEWithLogitsLoss(pos_weight=torch.tensor(2.0))(m(xb).squeeze(1).float(), yb.float()).backward()
            opt.step()

    torch.manual_seed(0)
    sums, path = _capture_round(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)), x, y, binary)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    want = 0
    for i in range(6):
        model.zero_grad()
        F.binary_cross_entropy_with_logits(model(x[i:i + 1]).squeeze(1), y[i:i + 1].float(),
                                           pos_weight=torch.tensor(2.0)).backward()
        g = torch.cat([p.grad.ravel() for p in model.parameters()])
        want = want + g * min(1.0, 1.0 / float(g.norm()))
    assert path == "torch.func"
    torch.testing.assert_close(torch.cat([s.ravel() for s in sums]), want, rtol=1e-4, atol=1e-6)
