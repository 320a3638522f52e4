"""DP-MTL on a user's model: what the run tells the user when the numbers cannot work.

Checks (a tiny torch model under MTLClient and DPMeanRegularizedMTL.from_run_config,
in process, no data files): one start-up warning, before round 1, when the planned
noise on the released mean is larger than the radius (with the numbers and what to
change), none when it is not; a round in which no task trains is skipped, a run
ending on such a round (or after ``max-skipped-rounds`` of them) fails with the
epsilon spent saved, and the tasks' error names the noisy mean and ``lambda``, not
the learning rate; DP-MTL keys written outside the ``jdp`` table are refused naming
the key and the table."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.mtl import protocol
from flwr_jdp.mtl.algorithm import MTLConfig
from flwr_jdp.mtl.client import MTLClient, num_parameters
from flwr_jdp.mtl.config import namespaced_mtl_config
from flwr_jdp.mtl.health import divergence_hint, noise_warning
from flwr_jdp.mtl.noise import MeanRelease
from flwr_jdp.strategies import DPMeanRegularizedMTL
from flwr_jdp.strategies.accounted import RunFailed


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)),
                      batch_size=8)


def _train_fn(lr):
    def fn(net, loader):
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return fn


def _app(bad_rounds=()):
    """A user's ClientApp: its train function diverges (non-finite) in ``bad_rounds``."""
    app = ClientApp()
    mtl = MTLClient(app, model_fn=Tiny, train_data=lambda ctx: _loader())

    @app.train()
    def train(msg, context):
        rnd = int(msg.content["config"][protocol.ROUND])
        return mtl.train(msg, context, Tiny(), _loader(), _train_fn(float("nan") if rnd in bad_rounds else 0.1))

    @app.evaluate()
    def evaluate(msg, context):
        mtl.load(Tiny(), msg, context)
        return Message(RecordDict({"metrics": MetricRecord({"acc": 0.5, "num-examples": 4})}), reply_to=msg)

    return app


def _run_config(tmp_path, **jdp):
    cfg = {"num-server-rounds": 3, "jdp.rounds": 3, "jdp.radius": 5.0, "jdp.lambda": 0.1,
           "jdp.target-epsilon": 8.0, "jdp.results-dir": str(tmp_path / "run")}
    cfg.update({f"jdp.{k.replace('_', '-')}": v for k, v in jdp.items()})
    return cfg


def _start(run_config, nodes=3, bad_rounds=()):
    torch.manual_seed(0)
    grid = InProcessGrid(_app(bad_rounds), nodes, run_config)
    strategy = DPMeanRegularizedMTL.from_run_config(run_config)
    return strategy, strategy.start(grid=grid, initial_arrays=ArrayRecord(Tiny().state_dict()),
                                    num_rounds=run_config["jdp.rounds"], timeout=30.0)


def _results(run_config):
    return json.loads((Path(run_config["jdp.results-dir"]) / "results.json").read_text())


# ------------------------------------------------------------------ (b) the start-up warning
def test_the_noise_warning_gives_the_numbers_and_what_to_change():
    cfg = MTLConfig(lam=0.1, radius=10.0, rounds=3, target_epsilon=8.0)
    release = cfg.release(2)
    text = noise_warning(release, 44426, cfg, "jdp.")
    noise = release.sigma * math.sqrt(44426)
    assert noise > 2000  # the case a user hit: 2 tasks, a 44k-parameter CNN, radius 10
    assert f"~{noise:.4g}" in text and "sqrt(44426 parameters)" in text and "radius 10" in text
    for advice in ("more tasks", "jdp.target-epsilon", "jdp.rounds", "smaller model", "jdp.lambda"):
        assert advice in text
    assert "\n" not in text
    # Noise smaller than the radius, or no noise at all: nothing to say.
    assert noise_warning(MeanRelease(10.0, 100, 1.0, 0.01), 44426, cfg) is None
    assert noise_warning(MTLConfig(target_epsilon=math.inf).release(2), 44426,
                         MTLConfig(target_epsilon=math.inf)) is None


def test_the_warning_is_logged_once_before_round_1(tmp_path, caplog):
    run_config = _run_config(tmp_path, radius=5.0)
    with caplog.at_level(logging.INFO):
        strategy, _ = _start(run_config, nodes=2)
    lines = [r.getMessage() for r in caplog.records]
    warned = [i for i, line in enumerate(lines) if "will carry no signal" in line]
    first_round = next(i for i, line in enumerate(lines) if "[round 1/3]" in line)
    assert len(warned) == 1 and warned[0] < first_round
    assert f"sqrt({num_parameters(Tiny())} parameters)" in lines[warned[0]]
    assert strategy.release.sigma * math.sqrt(strategy.num_params) > strategy.cfg.radius


def test_no_warning_when_the_noise_is_below_the_radius(tmp_path, caplog):
    run_config = _run_config(tmp_path, rounds=1)  # 8 tasks, 23 parameters: noise norm ~3.6 < radius 5
    run_config["num-server-rounds"] = 1
    with caplog.at_level(logging.INFO):
        strategy, _ = _start(run_config, nodes=8)
    assert strategy.release.sigma * math.sqrt(strategy.num_params) < strategy.cfg.radius
    assert not [r for r in caplog.records if "carry no signal" in r.getMessage()]


# ------------------------------------------------------------------ (c) rounds where no task trains
def test_a_run_whose_final_rounds_had_no_task_train_fails_with_epsilon_saved(tmp_path, caplog):
    run_config = _run_config(tmp_path)  # max-skipped-rounds = 3 > the 2 bad rounds
    with caplog.at_level(logging.INFO), pytest.raises(
            RunFailed, match=r"final rounds \(2 up to round 3\) had no task train") as err:
        _start(run_config, bad_rounds=(2, 3))
    lines = [r.getMessage() for r in caplog.records if "[round " in r.getMessage()]
    assert ["0 tasks sent (skipped: no task trained)" in line for line in lines] == [False, True, True]
    res = _results(run_config)
    assert res["status"] == "failed"
    assert [h["tasks"] for h in res["history"]] == [3, 0, 0]
    assert [h["skipped"] for h in res["history"]] == [False, True, True]
    assert 0 < res["epsilon"] <= 8.0 and f"epsilon {res['epsilon']:.4f} spent and saved" in str(err.value)
    assert "learning rate?" not in str(err.value)


def test_a_skipped_round_in_the_middle_is_marked_and_the_run_completes(tmp_path):
    run_config = _run_config(tmp_path)
    strategy, _ = _start(run_config, bad_rounds=(2,))
    res = _results(run_config)
    assert res["status"] == "completed" and strategy.status == "completed"
    assert [h["skipped"] for h in res["history"]] == [False, True, False]


def test_max_skipped_rounds_in_a_row_fail_the_run_early(tmp_path):
    run_config = _run_config(tmp_path, max_skipped_rounds=1)
    with pytest.raises(RunFailed, match=r"1 rounds in a row \(max-skipped-rounds=1\)"):
        _start(run_config, bad_rounds=(1,))
    res = _results(run_config)
    assert res["status"] == "failed" and [h["round"] for h in res["history"]] == [1]
    assert res["epsilon"] > 0  # round 1 was charged before it was sent, and stays charged


def test_a_diverged_task_names_the_noisy_mean_and_lambda_not_the_learning_rate():
    cfg = MTLConfig(lam=0.1, radius=10.0)
    noisy = divergence_hint(np.full(100, 200.0), cfg)  # ||w~|| = 2000 > radius 10
    assert "norm 2000" in noisy and "jdp.radius=10" in noisy and "jdp.lambda=0.1" in noisy
    assert "lower jdp.lambda" in noisy
    plain = divergence_hint(np.zeros(100), cfg)
    assert "learning rate" in plain and "jdp.lambda=0.1" in plain
    # Through MTLClient: the error reply carries the hint.
    app = ClientApp()
    mtl = MTLClient(app, model_fn=Tiny)
    rc = {"jdp.lambda": 0.1, "jdp.radius": 1.0}
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                  state=RecordDict(), run_config=rc)
    InProcessGrid(app, 1, rc)
    mean = np.full(num_parameters(Tiny()), 50.0)
    msg = Message(RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND: 1, protocol.TASKS: [0]}),
                              protocol.MEAN: ArrayRecord({protocol.MEAN: Array(mean)})}),
                  dst_node_id=7, message_type=MessageType.TRAIN)
    reply = mtl.train(msg, ctx, Tiny(), _loader(), _train_fn(float("nan")))
    assert reply.has_error() and "mostly DP noise" in reply.error.reason and "jdp.lambda=0.1" in reply.error.reason


# ------------------------------------------------------------------ (d) misplaced DP-MTL keys
@pytest.mark.parametrize("key,value", [("lambda", 0.1), ("radius", 3.0), ("calibration", "paper")])
def test_a_dp_mtl_key_outside_the_jdp_table_is_refused_naming_key_and_table(key, value):
    pattern = (rf"run-config key '{key}' is set outside the \[tool.flwr.app.config.jdp\] table.*"
               rf"reads 'jdp.{key}'")
    with pytest.raises(ConfigError, match=pattern):
        namespaced_mtl_config({key: value, "num-server-rounds": 3})
    with pytest.raises(ConfigError, match=pattern):  # at start-up, before the strategy exists
        DPMeanRegularizedMTL.from_run_config({key: value})
    # The same value in both places is no ambiguity; the app's own keys stay its own.
    namespaced_mtl_config({key: value, f"jdp.{key}": value})
    namespaced_mtl_config({"fraction-train": 0.5, "rounds": 3, "lr": 0.01})


def test_rounds_may_name_the_apps_own_key():
    _, cfg, _ = namespaced_mtl_config({"jdp.rounds": "num-server-rounds", "num-server-rounds": 4})
    assert cfg.rounds == 4
    with pytest.raises(ConfigError, match="'jdp.rounds' = 'num-rounds' names no key of your app"):
        namespaced_mtl_config({"jdp.rounds": "num-rounds"})
