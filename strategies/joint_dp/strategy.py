"""JointDP: a Flower Message-API strategy for joint differential privacy.

Owner ``j``'s personal parameters never leave ``j``; the shared parameters are
learned together, and everything the other owners see (the shared parameters the
server broadcasts) is (epsilon, delta)-DP with respect to ``j``'s data, for the
configured unit (record, user or owner). This is joint DP in the billboard model.

Noise placement
    ``local``: owners add the noise themselves (DP-SGD on the shared parameters, or
    a noised clipped update for the owner unit); the server only averages. The
    ledger keeps one scope per owner and reports the maximum over owners. An owner
    whose node caps its budget below ``target-epsilon`` (node config ``max-epsilon``,
    reported at set-up) adds a noise multiplier calibrated for its cap, recorded in
    its scope (:mod:`flwr_jdp.joint_dp.budgets`).
    ``central``: owners send clipped quantities; the server (trusted aggregator)
    adds Gaussian noise once to their sum and divides by the expected count. The
    ledger has one ``server`` scope.
    ``distributed``: the central protocol's step without trusting the server: owners
    round their clipped sums to integers and add Skellam noise shares; the round is
    one SecAgg+ exchange (:mod:`~flwr_jdp.strategies.joint_dp.secagg`), and the server
    decodes only the sum. One ``server`` scope with the Skellam event
    (:mod:`flwr_jdp.privacy.skellam`).

Accounting is conservative: charge, save, release. A round's events are recorded
and the ledger written to disk *before* any message of the round leaves the server,
so a round whose replies are dropped or skipped is still charged, and so is a round
interrupted by a crash (its re-run after a restart is charged again). If the next
round would exceed the budget, training stops cleanly, keeping the last model and
the ledger on disk. Under local noise the owners also check each instruction and
keep their own ledgers (:mod:`flwr_jdp.joint_dp.owner_guard`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from flwr_jdp.checkpoint import Checkpoint
from flwr_jdp.joint_dp.budgets import BudgetGroup
from flwr_jdp.joint_dp.config import (
    NAMESPACE,
    ConfigError,
    JobConfig,
    dropin_record,
    namespaced_config,
    run_folder,
    with_settings,
)
from flwr_jdp.joint_dp.iterate_average import SharedParameterEMA
from flwr_jdp.joint_dp.release import release_kind
from flwr_jdp.joint_dp.schedule import OwnerSize, Schedule
from flwr_jdp.joint_dp.validation import ArraySpec
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.privacy.mechanisms import numpy_rng
from flwr_jdp.privacy.units import NoisePlacement
from flwr_jdp.strategies.accounted import AccountedStrategy
from flwr_jdp.strategies.joint_dp.aggregation import Aggregation, _checked_inner
from flwr_jdp.strategies.joint_dp.budgets import OwnerBudgets
from flwr_jdp.strategies.joint_dp.nodes import NodeSetup
from flwr_jdp.strategies.joint_dp.plan import ReleasePlan
from flwr_jdp.strategies.joint_dp.results import Results

#: Arguments of Flower's FedAvg that JointDP does not take, and why (each refused with its reason).
NOT_CARRIED_OVER = {
    "fraction_fit": "JointDP samples owners itself: every owner takes part in every round at the record and "
                    "user units, where each owner's sampling rate and the server's noise are planned together; "
                    "the owner unit samples owners at run-config key 'fraction-train' (accounted)",
    "min_train_nodes": "JointDP waits at set-up for 'num-owners' owners (0: every node that answers) and skips "
                       "a round with fewer than 'min-valid-fraction' of them valid (still charged)",
    "min_evaluate_nodes": "every owner is asked to evaluate (fraction_evaluate sets how many)",
    "min_available_nodes": "JointDP waits at set-up for 'num-owners' owners (0: every node that answers)",
    "min_fit_clients": "see min_train_nodes", "min_evaluate_clients": "see min_evaluate_nodes",
    "min_available_clients": "see min_available_nodes",
    "train_metrics_aggr_fn": "a train reply carries only 'num-examples': an owner's training loss or other "
                             "metrics are not covered by the DP guarantee, so they are not sent",
    "fit_metrics_aggregation_fn": "see train_metrics_aggr_fn",
    "evaluate_metrics_aggregation_fn": "Flower's legacy signature (list of (num_examples, metrics)); pass "
                                       "evaluate_metrics_aggr_fn with the Message API's "
                                       "(list[RecordDict], str) -> MetricRecord",
    "weighted_by_key": "the owners' weights are their data sizes, reported at set-up (public metadata)",
    "arrayrecord_key": "flwr-jdp's messages use 'arrays'", "configrecord_key": "flwr-jdp's messages use 'config'",
    "initial_parameters": "pass the initial model to start(initial_arrays=ArrayRecord(...))",
    "on_fit_config_fn": "pass a fixed train_config to start(); evaluate_config likewise",
    "on_evaluate_config_fn": "pass a fixed evaluate_config to start()",
}


class JointDP(NodeSetup, ReleasePlan, OwnerBudgets, Aggregation, Results, AccountedStrategy):
    r"""Joint-DP training of shared parameters with personal layers kept local.

    Parameters
    ----------
    cfg : JobConfig
        The validated run configuration (:func:`flwr_jdp.joint_dp.config.parse_config`).
    ledger : PrivacyLedger, optional
        Where releases are recorded; a new one at ``cfg.delta`` by default.
    node_settle_s : float
        At start-up, how long the count of connected nodes must stay unchanged
        before the set-up query goes out (skipped once there are as many nodes as
        owners; 0: query at once).
    inner : Strategy, optional
        A Flower strategy applied to each round's DP aggregate as post-processing
        (FedAvg by default; FedAvgM, FedAdam, FedYogi or FedAdagrad for a server
        optimizer). It changes the model, never the ledger. Flower's DP wrappers and
        robust aggregators are refused with the reason.
    fraction_evaluate : float
        As in Flower's FedAvg: the fraction of owners asked to evaluate each round
        (at least one; 0 evaluates none). Evaluation spends no privacy.
    evaluate_metrics_aggr_fn : callable, optional
        As in Flower's FedAvg: ``(list[RecordDict], weighting key) -> MetricRecord``,
        called with each evaluated owner's reply content (``{"metrics": ...}``) and
        ``"num-examples"``; what it returns is added to (and overrides keys of)
        flwr-jdp's own aggregate (the weighted mean of every metric, ``accuracy``
        the plain mean over owners, ``owners``). FedAvg's other arguments are refused
        with the reason and what takes their place (:data:`NOT_CARRIED_OVER`).
    **settings
        Any configuration key by its Python name (``target_epsilon=2.0``,
        ``personal_layers=r"^fc3\."``, ``noise_placement="central"``, ...), validated
        as the run config is; without ``cfg`` they configure the strategy alone
        (see :meth:`from_run_config` for apps configured by ``jdp.*`` keys).
    """

    def __init__(
        self,
        cfg: JobConfig | None = None,
        ledger: PrivacyLedger | None = None,
        node_settle_s: float = 1.0,
        inner: Strategy | None = None,
        fraction_evaluate: float = 1.0,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        **settings: object,
    ) -> None:
        self.inner = _checked_inner(inner)
        for name in settings.keys() & NOT_CARRIED_OVER.keys():
            raise ConfigError(f"JointDP does not take FedAvg's {name}: {NOT_CARRIED_OVER[name]}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ConfigError(f"JointDP(fraction_evaluate={fraction_evaluate}): must be in [0, 1]")
        self.fraction_evaluate = float(fraction_evaluate)
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        #: How the user spells flwr-jdp's run-config keys (in error messages): ``jdp.``
        #: in a drop-in app (:meth:`from_run_config`, or settings without ``cfg``),
        #: none in flwr-jdp's own app, whose whole run config is flwr-jdp's.
        self.key_prefix = "" if cfg is not None else f"{NAMESPACE}."
        if cfg is None:
            cfg = namespaced_config({}, **settings)
        elif settings:
            cfg = with_settings(cfg, **settings)
        if cfg.dp and cfg.placement is NoisePlacement.DISTRIBUTED and cfg.accountant != "rdp":
            cfg = dataclasses.replace(cfg, accountant="rdp")  # the Skellam mechanism's bound is an RDP bound
        self.cfg = cfg
        self.node_settle_s = node_settle_s
        self.ledger = ledger or PrivacyLedger(
            delta=cfg.delta, accountant=cfg.accountant, unit=cfg.privacy_unit,
            budget=cfg.target_epsilon, neighbouring=cfg.neighbouring,
        )
        self.noise_multiplier = cfg.noise_multiplier
        self.kind = release_kind(cfg)
        self.rng = numpy_rng(cfg.noise_seed_or_none)
        #: which owners evaluate (``fraction_evaluate``): its own stream, never the noise's
        self.evaluate_rng = np.random.default_rng(None if cfg.noise_seed_or_none is None
                                                  else [cfg.noise_seed_or_none, 1])
        self.owner_node: dict[int, int] = {}
        self.sizes: dict[int, OwnerSize] = {}
        self.owner_caps: dict[int, float | None] = {}  # node config max-epsilon (set-up)
        self.budget_groups: list[BudgetGroup] = []  # local noise: owners by budget
        self.owner_noise: dict[int, float] = {}  # capped owners' noise multipliers
        self.schedule: Schedule | None = None
        self.spec: dict[str, ArraySpec] = {}
        self.num_personal = 0
        self._requested: dict[int, list[int]] = {}
        self._current: ArrayRecord = ArrayRecord()
        self.last_round_info: dict[str, object] = {}
        self.last_drop_reasons: list[str] = []
        self.model_spec: dict[str, ArraySpec] = {}  # every parameter of the model (set-up)
        self.public_initial: dict[str, np.ndarray] = {}  # personal values the release uses
        self.session = secrets.token_hex(8)  # kept across restarts (results.json)
        self._answered: set[int] = set()
        self._warned_accuracy = False
        #: Moving average of the shared parameters that owners are evaluated with
        #: (``ema-decay`` > 0; post-processing, no privacy cost).
        self.ema = SharedParameterEMA(cfg.ema_decay) if cfg.ema_decay > 0 else None

    @classmethod
    def from_run_config(cls, run_config: dict, **kwargs: object) -> JointDP:
        """A strategy configured by the ``jdp.*`` keys of a user's run config
        (``[tool.flwr.app.config.jdp]`` in pyproject.toml; every owner checks its
        instructions against the same keys); ``kwargs`` as for the constructor."""
        strategy = cls(namespaced_config(run_config), **kwargs)
        strategy.key_prefix = f"{NAMESPACE}."
        return strategy

    def _key(self, key: str) -> str:
        """Run-config key ``key`` as the user's app spells it (``jdp.num-rounds``)."""
        return f"{self.key_prefix}{key}"


    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Set-up, calibration and resume, before any release. The arguments of
        ``start()`` mean what they mean in Flower's ``Strategy.start``:

        - ``initial_arrays``: the initial model. Its shared parameters are broadcast;
          its personal parameters are sent to the owners once, at set-up, as their
          public initial values (drop-in ClientApps), or must equal the public
          initial values the project's ClientApp model has. A mismatch with the
          ClientApps' model fails before any privacy is spent, naming the array.
        - ``num_rounds``: the horizon the noise is calibrated for. Under local noise
          it must equal run-config ``num-rounds``, which every owner uses to check the
          noise it is asked to add; a different value fails before any spending.
        - ``timeout`` (default: run-config ``round-timeout``) bounds every exchange;
          an owner whose reply is later (crashed, hung or disconnected node) is
          dropped for that round, which is still charged in full.
        - ``train_config`` / ``evaluate_config``: sent to the ClientApps with every
          train / evaluate instruction.
        - ``evaluate_fn(server_round, arrays)``: called on the global shared model
          before round 1 (round 0) and after every round; its metrics go to
          ``Result.evaluate_metrics_serverapp`` and ``results.json``.

        A run in which ``max-skipped-rounds`` rounds in a row have too few valid
        replies ends as failed (``status: failed`` with the epsilon spent saved, and
        an exception, so Flower marks the run ``finished:failed``)."""
        cfg = self.cfg
        if num_rounds is not None and num_rounds != cfg.num_rounds:
            if cfg.dp and cfg.placement is not NoisePlacement.CENTRAL:
                raise ConfigError(
                    f"start(num_rounds={num_rounds}) differs from run-config key '{self._key('num-rounds')}'="
                    f"{cfg.num_rounds}, which every owner uses to check the noise it adds under "
                    f"{cfg.noise_placement} noise: set {self._key('num-rounds')} = {num_rounds} in the run config, or pass "
                    f"num_rounds=context.run_config[\"{self._key('num-rounds')}\"]")
            if num_rounds < 1:
                raise ConfigError(f"start(num_rounds={num_rounds}): must be >= 1")
            cfg = self.cfg = dataclasses.replace(cfg, num_rounds=int(num_rounds))
        if not cfg.results_dir:
            cfg = self.cfg = dataclasses.replace(cfg, results_dir=run_folder("", self.session))
        self._t0 = time.time()
        self.max_skipped_rounds = cfg.max_skipped_rounds
        # Flower prints through its own handler; a root handler that another library
        # installed would print every line a second time.
        logging.getLogger("flwr").propagate = False
        arrays = self.setup(grid, timeout=120.0, initial_arrays=initial_arrays)
        recorded = dropin_record(cfg) if self.key_prefix else cfg.to_dict()
        self._ckpt = ckpt = Checkpoint(Path(cfg.results_dir), recorded)
        self.history = []
        start_round = 1
        if cfg.resume and ckpt.resumable():
            arrays, self.ledger, self.history, z = ckpt.load(self.spec)
            self.noise_multiplier = z if cfg.dp else self.noise_multiplier
            start_round = len(self.history) + 1
            self.session = ckpt.session() or self.session
            saved = ckpt.load_ema(self.spec) if self.ema is not None else None
            if saved is not None:
                self.ema.restore(*saved)
            log(INFO, "Resuming from %s after round %d (epsilon %.4f spent)",
                cfg.results_dir, start_round - 1, self.ledger.epsilon())
            interrupted = [r["round"] for r in self.ledger.rounds if r["round"] >= start_round]
            if interrupted:
                log(WARNING, "Round %d was charged before the restart and its owners may have "
                    "released; its charge stands and its re-run is charged again", interrupted[-1])
        self.summary()
        log(INFO, "Writing model, ledger and results to %s", Path(cfg.results_dir).resolve())
        return arrays, range(start_round, cfg.num_rounds + 1)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """The accounted round loop (:class:`AccountedStrategy`); see :meth:`prepare`
        for what each argument means here. ``timeout`` defaults to run-config
        ``round-timeout``."""
        return super().start(grid, initial_arrays, num_rounds, timeout or self.cfg.round_timeout,
                             train_config, evaluate_config, evaluate_fn)
