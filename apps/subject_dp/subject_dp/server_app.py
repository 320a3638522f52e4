"""The subject-level DP ServerApp: :class:`flwr_jdp.strategies.SubjectLevelFedAvg` as
configured by the run config, evaluating the released global model on the task's test
(or validation) split. Run the app with ``flwr run apps/subject_dp``.
"""

from __future__ import annotations

from logging import ERROR

import torch
from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.config_check import ConfigError
from flwr_jdp.strategies import SubjectLevelFedAvg
from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.task import build_subject_model
from flwr_jdp.training.plain import evaluate

server = ServerApp()


def test_evaluator(cfg):  # noqa: ANN001, ANN201
    """Accuracy of the global model on the task's test set (``evaluate-on =
    test``) or on the validation split carved from the training records
    (``validation``, for tuning: nothing is chosen by looking at the test set).
    Server-side evaluation of the released model is post-processing."""
    ds, val, _ = sd.dataset(cfg)
    x, y = (ds.x_test, ds.y_test) if cfg.evaluate_on == "test" else val

    def fn(model: torch.nn.Module) -> dict:
        loss, acc = evaluate(model, x, y)
        return {"accuracy": float(acc), "loss": float(loss)}
    return fn


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Run subject-level DP training as configured by the run config."""
    try:
        cfg = parse_subject_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
    torch.set_num_threads(1)
    strategy = SubjectLevelFedAvg(cfg, build_subject_model(cfg), test_evaluator(cfg),
                                  dict(context.run_config))
    try:
        strategy.start(grid)
    except ConfigError as err:  # e.g. a plan over target-epsilon, refused before any release
        log(ERROR, "Invalid configuration: %s", err)
        raise
