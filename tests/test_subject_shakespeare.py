"""Tiny Shakespeare as a subject-level task (issue 4): characters as subjects,
sequence records, the character LSTM's per-sample gradients and the apps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus import GradSampleModule

from flwr_jdp.config_check import ConfigError
from flwr_jdp.data.shakespeare import chunk, load_shakespeare, parse_speeches
from flwr_jdp.models.char_lstm import build_char_lstm
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.training.dp_sgd import clipped_unit_sum
from flwr_jdp.training.plain import evaluate, record_losses
from flwr_jdp.training.subject_level import SiloData, SiloPlan, subject_batch, train_silo_round

TEXT = """ALICE:
Hello there, good friend.
How fare you?

BOB:
Well.

Just a stage direction without a header
on two lines

ALICE:
Again I speak, and speak at length to fill a record or two.

CAROL:
Hi.
"""


def test_speeches_are_attributed_to_their_speaker() -> None:
    speeches = parse_speeches(TEXT)
    assert [s for s, _ in speeches] == ["ALICE", "BOB", "ALICE", "CAROL"]
    assert speeches[0][1] == "Hello there, good friend.\nHow fare you?"
    assert all(":" not in s.split("\n")[0][-1:] for _, s in speeches)  # header lines removed


def test_chunk_targets_are_inputs_shifted_by_one() -> None:
    ids = np.arange(23)
    x, y = chunk(ids, 5)
    assert x.shape == y.shape == (4, 5)  # (23 - 1) // 5 records, stride 5
    np.testing.assert_array_equal(x[1], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(y[1], [6, 7, 8, 9, 10])
    assert chunk(ids[:3], 5)[0].shape == (0, 5)


def test_loader_keeps_subjects_with_enough_text(tmp_path) -> None:
    (tmp_path / "input.txt").write_text(TEXT)
    ds = load_shakespeare(str(tmp_path), seq_len=4, min_chars=20, test_fraction=0.0)
    assert ds.num_subjects == 1  # only ALICE has >= 20 characters
    assert set(ds.subject_train.tolist()) == {0}
    assert ds.x_train.dtype == np.int64 and ds.x_train.shape[1] == 4
    ds_all = load_shakespeare(str(tmp_path), seq_len=2, min_chars=1, test_fraction=0.0)
    assert ds_all.num_subjects == 3 and ds_all.num_classes == len(set("".join(s for _, s in parse_speeches(TEXT))))
    with pytest.raises(FileNotFoundError, match="data-dir"):
        load_shakespeare(str(tmp_path / "missing"))


def test_real_corpus_subjects_and_split(shakespeare_dir) -> None:
    ds = load_shakespeare(str(shakespeare_dir))
    assert ds.num_classes == 65
    assert ds.num_subjects == len(np.unique(ds.subject_train)) > 100
    assert ds.x_train.shape[1] == 40 and len(ds.x_test) > 0.05 * len(ds.x_train)
    np.testing.assert_array_equal(ds.x_train[:, 1:], ds.y_train[:, :-1])
    top = load_shakespeare(str(shakespeare_dir), max_subjects=5)
    assert top.num_subjects == 5


def test_char_lstm_per_sample_gradients_are_each_records_gradient() -> None:
    """Opacus's per-sample gradients of the DPLSTM model under the per-record
    sequence loss equal the gradient of each record's loss on its own."""
    torch.manual_seed(0)
    model = build_char_lstm(vocab_size=11, seed=0, embedding=4, hidden=6)
    x, y = torch.randint(0, 11, (5, 7)), torch.randint(0, 11, (5, 7))
    gsm = GradSampleModule(model, loss_reduction="sum")
    record_losses(gsm(x), y).sum().backward()
    per_sample = {n: p.grad_sample.clone() for n, p in gsm.named_parameters()}
    gsm._close()  # noqa: SLF001
    for i in range(5):
        model.zero_grad()
        record_losses(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[f"_module.{name}"][i], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_higradavg_subject_contribution_is_at_most_c_for_sequences(seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = build_char_lstm(vocab_size=9, seed=seed, embedding=4, hidden=5)
    n = int(rng.integers(4, 20))
    x, y = torch.from_numpy(rng.integers(0, 9, (n, 6))), torch.from_numpy(rng.integers(0, 9, (n, 6)))
    subjects = torch.from_numpy(rng.integers(0, 4, n))
    c = float(rng.uniform(0.01, 1.0))

    def batch_sum(records: torch.Tensor) -> torch.Tensor:
        gsm = GradSampleModule(model, loss_reduction="sum")
        params = list(gsm.parameters())
        for p in params:
            p.grad, p.grad_sample = None, None
        record_losses(gsm(x[records]), y[records]).sum().backward()
        sums = clipped_unit_sum(params, subject_batch(records, subjects), c)
        gsm._close()  # noqa: SLF001
        return torch.cat([s.flatten() for s in sums])

    full = batch_sum(torch.arange(n))
    for a in torch.unique(subjects):
        rest = torch.nonzero(subjects != a).flatten()
        without = batch_sum(rest) if len(rest) else torch.zeros_like(full)
        assert float(torch.linalg.vector_norm(full - without)) <= c * (1 + 1e-5)


def test_sequence_evaluation_counts_every_position() -> None:
    model = build_char_lstm(vocab_size=7, seed=0, embedding=3, hidden=4)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 7, (9, 5)), rng.integers(0, 7, (9, 5))
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    loss, acc = evaluate(model, x, y)
    assert acc == pytest.approx(float((pred == y).mean()))
    assert np.isfinite(loss) and 0 <= acc <= 1


@pytest.mark.parametrize("method", ["fedavg", "higradavg-dp", "local-group-dp", "user-ldp"])
def test_every_method_trains_a_sequence_silo(method: str) -> None:
    rng = np.random.default_rng(1)
    data = SiloData.from_numpy(rng.integers(0, 9, (30, 6)), rng.integers(0, 9, (30, 6)), rng.integers(0, 5, 30))
    assert data.x.dtype == torch.int64
    model = build_char_lstm(vocab_size=9, seed=0, embedding=4, hidden=5)
    before = [p.detach().clone() for p in model.parameters()]
    plan = SiloPlan(method, 0.5, 2, 0.5, 1.0, 1.0, (lambda z: 2.0 * z) if method == "local-group-dp" else None)
    loss = train_silo_round(model, data, plan, torch.Generator().manual_seed(0))
    assert np.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_dataset_key_is_validated() -> None:
    with pytest.raises(ConfigError, match="dataset"):
        parse_subject_config({"dataset": "mnist"})
    with pytest.raises(ConfigError, match="seq-len"):
        parse_subject_config({"dataset": "shakespeare", "seq-len": 0})


def test_shakespeare_apps_run_and_account_exactly(tmp_path, shakespeare_dir) -> None:
    """The real ServerApp strategy and ClientApp on an in-process grid: 12
    characters over 3 silos, HiGradAvgDP under exact horizontal accounting."""
    from apps.subject_dp.subject_dp.client_app import client
    from apps.subject_dp.subject_dp.server_app import test_evaluator
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
    from flwr_jdp.subject.task import build_subject_model

    rc = {"dataset": "shakespeare", "data-dir": str(shakespeare_dir), "max-writers": 12, "num-silos": 3,
          "budget-rounds": 2, "method": "higradavg-dp", "accounting": "exact", "noise-seed": 0,
          "results-dir": str(tmp_path / "run"), "batch-size": 32, "learning-rate": 2.0}
    cfg = parse_subject_config(rc)
    strategy = SubjectLevelFedAvg(cfg, build_subject_model(cfg), test_evaluator(cfg), rc)
    strategy.start(InProcessGrid(client, 2, rc))
    out = strategy.results()
    assert out["status"] == "completed" and not out["dropped"]
    assert out["ledger_epsilon"] <= 4.0 * (1 + 1e-6)
    assert out["ledger_epsilon"] == pytest.approx(out["plan"]["epsilon"], rel=1e-6)
    assert 0.0 <= out["acc_final"] <= 1.0
    assert len(strategy.history) == 2
