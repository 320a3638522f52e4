"""The two per-sample gradient paths of DP-SGD give the same releases.

``flwr_jdp.training.per_sample`` (whole-model ``torch.func``, the default) and
Opacus's hooks (the fallback) must give the same clipped per-unit sums, to float
tolerance, for every model family the project trains: the seed CNN (GroupNorm),
the quickstart example's CNN, the character LSTM (Opacus's ``DPLSTM``) and a model
whose personal layer sits between shared ones; record and user units; and the
same parameters after a few noiseless DP-SGD steps. A model ``vmap`` cannot handle
falls back to Opacus with one log line per class.

These are :mod:`flwr_jdp.training.dp_sgd`'s own trainers (``clipped_gradient_sum``,
``train_dp_sgd``); the owners' releases go through the user's loop in
:func:`~flwr_jdp.training.user_loop.private_training`, whose two paths are compared in
``tests/test_user_loop_paths.py``. The last test checks that the release audited by
``tests/test_audit_production.py`` (the project's ClientApp) runs through ``torch.func``.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flwr_jdp.models import SeedCNN
from flwr_jdp.models.char_lstm import CharLSTM
from flwr_jdp.params import split_parameters
from flwr_jdp.training import dp_sgd, per_sample

#: Opacus warns that no *input* needs a gradient (true, and irrelevant).
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart-pytorch" / "quickstart" / "task.py"


@pytest.fixture(autouse=True)
def _group_norm_rule_at_every_size(monkeypatch):
    """The batches here are small: use the fused GroupNorm vmap rule anyway (at the
    default threshold these batches would take vmap's own rule)."""
    monkeypatch.setattr(per_sample, "GROUP_NORM_RULE_FROM", 0)


def _quickstart_net() -> nn.Module:
    """The quickstart example's own ``Net`` (conv-pool-conv-pool-fc-fc-fc, 1x28x28)."""
    spec = importlib.util.spec_from_file_location("quickstart_task", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


class _Sandwich(nn.Module):
    """Shared conv + GroupNorm, a personal linear layer, then a shared linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.mid = nn.Linear(4 * 6 * 6, 12)
        self.out = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv(x))).flatten(1)
        return self.out(torch.tanh(self.mid(x)))


def _case(name: str, n: int = 12):
    """(model, split, x, y) of a named model family, seeded."""
    torch.manual_seed(5)
    rng = np.random.default_rng(5)
    if name == "seed-cnn":
        model, rule = SeedCNN(1, 28, 10), r"^fc1\."
        x, y = rng.normal(size=(n, 1, 28, 28)), rng.integers(0, 10, n)
    elif name == "quickstart":
        model, rule = _quickstart_net(), r"^fc3\."
        x, y = rng.normal(size=(n, 1, 28, 28)), rng.integers(0, 10, n)
    elif name == "char-lstm":
        model, rule = CharLSTM(), r"^fc\."
        x, y = rng.integers(0, 65, (n, 40)), rng.integers(0, 65, (n, 40))
    else:
        model, rule = _Sandwich(), r"^mid\."
        x, y = rng.normal(size=(n, 1, 8, 8)), rng.integers(0, 5, n)
    x = x.astype(np.float32) if x.dtype == np.float64 else x
    return model, split_parameters(model, rule), x, y


MODELS = ["seed-cnn", "quickstart", "char-lstm", "sandwich"]


def _users(unit: str, n: int) -> np.ndarray | None:
    return None if unit == "record" else np.arange(n) % 5  # 5 users, 2-3 records each


def _sums(backend: str, monkeypatch, model, split, x, y, users, clip: float) -> list[np.ndarray]:
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    sums, _ = dp_sgd.clipped_gradient_sum(copy.deepcopy(model), split, x, y, user_ids=users, clipping_norm=clip,
                                          sample_rate=0.8, generator=torch.Generator().manual_seed(3))
    return sums


@pytest.mark.parametrize("unit", ["record", "user"])
@pytest.mark.parametrize("name", MODELS)
def test_both_paths_give_the_same_clipped_sums(name, unit, monkeypatch):
    """Same Poisson sample (same generator), per-unit clipped sums equal to float
    tolerance, with most records clipped (C small) and with none (C large)."""
    model, split, x, y = _case(name)
    users = _users(unit, len(y))
    for clip in (0.05, 1e4):
        fast = _sums("func", monkeypatch, model, split, x, y, users, clip)
        hooks = _sums("opacus", monkeypatch, model, split, x, y, users, clip)
        assert any(np.abs(s).max() > 0 for s in fast)
        for a, b in zip(fast, hooks, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("unit,personal_lr", [("record", 0.0), ("record", 0.05), ("user", 0.0), ("user", 0.05)])
@pytest.mark.parametrize("name", ["seed-cnn", "sandwich"])
def test_noiseless_dp_sgd_gives_the_same_parameters_on_both_paths(name, unit, personal_lr, monkeypatch):
    """z = 0: three DP-SGD steps, with the personal parameters frozen
    (``personal_lr = 0``) or also stepped (``train_dp_sgd``'s personal step), end at
    the same parameters, and the same mean loss, whichever path computed them."""
    model, split, x, y = _case(name)
    users = _users(unit, len(y))
    out = {}
    for backend in ("func", "opacus"):
        monkeypatch.setattr(per_sample, "BACKEND", backend)
        m = copy.deepcopy(model)
        loss = dp_sgd.train_dp_sgd(m, split, x, y, user_ids=users, noise_multiplier=0.0, clipping_norm=0.5,
                                   sample_rate=0.7, steps=3, lr=0.5, personal_lr=personal_lr,
                                   generator=torch.Generator().manual_seed(9))
        out[backend] = loss, dict(m.named_parameters())
        assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in m.parameters())
        assert all(p.grad is None for p in m.parameters())
    assert out["func"][0] == pytest.approx(out["opacus"][0], rel=1e-5)
    for k, p in out["opacus"][1].items():
        torch.testing.assert_close(out["func"][1][k], p, rtol=1e-4, atol=1e-6)
    moved = [k for k, p in out["func"][1].items() if not torch.equal(p, dict(model.named_parameters())[k])]
    assert set(split.shared) <= set(moved)
    assert bool(set(split.personal) & set(moved)) == (personal_lr > 0)


def test_single_row_linear_weights_are_factored_and_sequence_ones_are_not():
    """The seed CNN's shared head ``fc2`` and the quickstart CNN's ``fc1``/``fc2`` get
    factored per-sample gradients (:class:`per_sample.OuterProducts`) equal to the
    materialised ones; the LSTM's recurrent and per-position layers do not."""
    for name, factored in (("seed-cnn", {"fc2.weight"}), ("quickstart", {"fc1.weight", "fc2.weight"}),
                           ("char-lstm", set()), ("sandwich", {"out.weight"}), ("tied", {"head.weight"})):
        if name == "tied":
            model, x, y = _Tied(), np.zeros((5, 6), np.float32), np.zeros(5, np.int64)
            split = split_parameters(model, r"^nothing$", allow_empty=True)
        else:
            model, split, x, y = _case(name, n=5)
        for k in split.personal:
            model.get_parameter(k).requires_grad_(False)
        engine = per_sample.FuncPerSample(model)
        engine.backward(*dp_sgd.to_tensors(x, y))
        got = {k for k, p in model.named_parameters() if isinstance(getattr(p, "grad_sample", None),
                                                                   per_sample.OuterProducts)}
        assert got == factored, name
        for k in got:
            p = model.get_parameter(k)
            assert p.grad_sample.materialize().shape == (5, *p.shape)
        engine.close()
        assert not any(hasattr(p, "grad_sample") for p in model.parameters())


class _Tied(nn.Module):
    """One square layer applied twice (a tied weight): not factorable."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.square(torch.tanh(self.square(x))))


def test_a_tied_weight_is_not_factored_and_chunks_change_nothing(monkeypatch):
    torch.manual_seed(2)
    model = _Tied()
    split = split_parameters(model, r"^head\.")
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(12, 6)).astype(np.float32), rng.integers(0, 3, 12)
    fast = _sums("func", monkeypatch, model, split, x, y, None, 0.5)
    hooks = _sums("opacus", monkeypatch, model, split, x, y, None, 0.5)
    for a, b in zip(fast, hooks, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)
    model2, split2, x2, y2 = _case("quickstart")
    whole = _sums("func", monkeypatch, model2, split2, x2, y2, _users("user", 12), 0.5)
    monkeypatch.setattr(per_sample, "CHUNK", 5)  # 12 records in chunks of 5, 5, 2
    chunked = _sums("func", monkeypatch, model2, split2, x2, y2, _users("user", 12), 0.5)
    for a, b in zip(chunked, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_fused_group_norm_rule_equals_vmaps_own(monkeypatch):
    model, split, x, y = _case("seed-cnn")
    fused = _sums("func", monkeypatch, model, split, x, y, None, 0.1)
    monkeypatch.setattr(per_sample, "GROUP_NORM_RULE_FROM", 10**9)
    stock = _sums("func", monkeypatch, model, split, x, y, None, 0.1)
    for a, b in zip(fused, stock, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_groupnorm_without_affine_and_a_nan_record(monkeypatch):
    """``GroupNorm(affine=False)`` under the fast rule, and a record with a NaN input
    (zeroed before clipping, :func:`dp_sgd.finite_rows`) on both paths."""

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.norm = nn.GroupNorm(2, 4, affine=False)
            self.out = nn.Linear(4 * 6 * 6, 3)
            self.head = nn.Linear(3, 3)

        def forward(self, x):  # noqa: ANN001, ANN202
            return self.head(self.out(self.norm(self.conv(x)).flatten(1)))

    torch.manual_seed(0)
    model = Plain()
    split = split_parameters(model, r"^head\.")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(9, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 9)
    x[4, 0, 2, 2] = np.nan
    fast = _sums("func", monkeypatch, model, split, x, y, None, 0.3)
    hooks = _sums("opacus", monkeypatch, model, split, x, y, None, 0.3)
    for a, b in zip(fast, hooks, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)


class _NeedsItem(nn.Module):
    """Data-dependent control flow (``.item()``): ``vmap`` cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if float(h.detach().abs().max()) > 1e6:
            h = h / 2
        return self.head(h)


def test_a_model_vmap_cannot_run_falls_back_to_opacus_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(dp_sgd, "_FUNC_FAILED", {})
    torch.manual_seed(1)
    model = _NeedsItem()
    split = split_parameters(model, r"^head\.")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(10, 6)).astype(np.float32), rng.integers(0, 3, 10)
    with caplog.at_level(logging.WARNING, logger=dp_sgd.__name__):
        auto = [_sums("auto", monkeypatch, model, split, x, y, None, 0.2) for _ in range(2)]
    lines = [r for r in caplog.records if "torch.func failed" in r.getMessage()]
    assert len(lines) == 1 and "_NeedsItem" in lines[0].getMessage()
    assert _NeedsItem in dp_sgd._FUNC_FAILED
    hooks = _sums("opacus", monkeypatch, model, split, x, y, None, 0.2)
    for run in auto:
        for a, b in zip(run, hooks, strict=True):
            np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(per_sample, "BACKEND", "func")  # no fallback: the failure is raised
    with pytest.raises(RuntimeError):
        _sums("func", monkeypatch, model, split, x, y, None, 0.2)


def test_the_audited_production_path_runs_through_torch_func(monkeypatch):
    """The owner's release as the production audits run it (the project's ClientApp:
    ``client_app.jdp.train`` with the app's ``task.train``, local and central
    release, record unit) on the audit's probe model with micro-batches made unusable: it
    must not need it."""
    from flwr_jdp.training import user_loop
    from tests.test_audit_production import _instruction, _owner, _probe, _records, _run_config, app_round

    def no_micro(*args) -> None:  # noqa: ANN002
        raise AssertionError("micro-batches were used")

    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(user_loop._DPPass, "_micro", no_micro)
    for placement in ("local", "central"):
        model = _probe()
        split = split_parameters(model, r"^head\.")
        public = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if n in split.personal}
        shared = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if n in split.shared}
        reply, _ = app_round(_run_config(**{"noise-placement": placement, "noise-seed": 0}), model,
                             _owner(0, *_records(31, seed=1)), _instruction(0, shared, 1.0, 1, 2.0), public)
        assert reply.has_content(), reply.error.reason
        out = reply.content["arrays"]
        assert set(out.keys()) == set(split.shared) and all(np.isfinite(out[n].numpy()).all() for n in out.keys())
    assert per_sample.model_kind(_probe()) not in per_sample.FUNC_FAILED
