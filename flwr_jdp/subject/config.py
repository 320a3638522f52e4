"""Run configuration of a subject-level DP run (Flower run-config keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config_check import need, parse_dataclass
from ..privacy.horizontal import ACCOUNTING
from ..training.subject_level import METHODS, SAMPLING

INCLUSION = ("subject", "record")
DATASETS = ("femnist", "shakespeare")


@dataclass(frozen=True)
class SubjectDPConfig:
    """Validated configuration (field ``x_y`` is run-config key ``x-y``)."""

    method: str = "higradavg-dp"
    accounting: str = "exact"
    inclusion: str = "subject"
    sampling: str = "records"  # records (the paper's) | subjects (higradavg-dp: Poisson over subjects)
    records_per_subject: int = 1  # sampling = subjects: records each sampled subject brings (0 = all)
    group_size: int = 0  # local-group-dp: 0 = the paper's data-dependent Z; G > 0 = fixed, accounted
    #: K > 0 (default): public-cap mode. Each silo keeps at most K records of each subject
    #: and samples at the public ``sample-rate``; the server plans and accounts for the
    #: worst-case subject (K records at every silo), and no subject ids or counts are sent.
    #: 0: reported-counts mode (silos report per-subject counts; NOT DP; the paper's reproduction).
    max_records_per_subject: int = 8
    sample_rate: float = 0.1  # public-cap mode: every silo's Poisson rate (of records; of subjects)
    target_epsilon: float = 4.0
    delta: float = 1e-5
    budget_rounds: int = 100
    #: expected records (sampling = subjects: subjects) per batch, the public divisor of a
    #: silo's noisy sum; reported counts: each silo's rate is batch-size / its size
    batch_size: int = 256
    local_steps: int = 2
    learning_rate: float = 0.2
    clipping_norm: float = 1.0
    noise_multiplier: float = 0.0
    dataset: str = "femnist"  # femnist (writers, LEAF CNN) | shakespeare (characters, char LSTM)
    seq_len: int = 40  # shakespeare: characters per record
    num_silos: int = 16
    alpha: float = 1.0
    assignment_seed: int = 0
    data_dir: str = ""
    max_writers: int = 0
    validation_fraction: float = 0.1
    model_seed: int = 0
    noise_seed: int = -1
    eval_every: int = 1
    evaluate_on: str = "test"  # test | validation (tuning)
    results_dir: str = "results/subject_dp/run"
    resume: bool = True  # continue an unfinished run with the same configuration in results-dir
    #: Reproduction only (reported counts, ``max-records-per-subject = 0``; refused under
    #: the public cap): each silo also sends its per-batch group sizes and numbers of
    #: distinct subjects every round. They are data-dependent and NOT DP, so the default
    #: is off (the server then receives only the DP model releases).
    report_batch_stats: bool = False

    def __post_init__(self) -> None:
        need(self.method in METHODS, "method", f"one of {METHODS}", self.method)
        need(self.accounting in ACCOUNTING, "accounting", f"one of {ACCOUNTING}", self.accounting)
        need(self.inclusion in INCLUSION, "inclusion", f"one of {INCLUSION}", self.inclusion)
        need(self.sampling in SAMPLING, "sampling", f"one of {SAMPLING}", self.sampling)
        need(self.sampling == "records" or self.method == "higradavg-dp", "sampling",
             f"'records' for method {self.method!r} ('subjects' is for higradavg-dp)", self.sampling)
        need(self.sampling == "records" or self.inclusion == "subject", "inclusion",
             "'subject' with sampling = subjects", self.inclusion)
        need(0 <= self.records_per_subject <= 100_000, "records-per-subject", "in [0, 100000] (0 = all)",
             self.records_per_subject)
        need(math.isfinite(self.target_epsilon) and self.target_epsilon > 0, "target-epsilon", "> 0 and finite",
             self.target_epsilon)
        need(0 < self.delta < 1, "delta", "in (0, 1)", self.delta)
        need(self.budget_rounds >= 1, "budget-rounds", ">= 1", self.budget_rounds)
        need(self.batch_size >= 1, "batch-size", ">= 1", self.batch_size)
        need(self.local_steps >= 1, "local-steps", ">= 1", self.local_steps)
        need(math.isfinite(self.learning_rate) and self.learning_rate > 0, "learning-rate", "> 0 and finite",
             self.learning_rate)
        need(math.isfinite(self.clipping_norm) and self.clipping_norm > 0, "clipping-norm", "> 0 and finite",
             self.clipping_norm)
        need(math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0, "noise-multiplier",
             ">= 0 (0 = calibrate to target-epsilon)", self.noise_multiplier)
        need(self.dataset in DATASETS, "dataset", f"one of {DATASETS}", self.dataset)
        need(1 <= self.seq_len <= 1000, "seq-len", "in [1, 1000]", self.seq_len)
        need(1 <= self.num_silos <= 1024, "num-silos", "in [1, 1024]", self.num_silos)
        need(math.isfinite(self.alpha) and self.alpha >= 1, "alpha", ">= 1 (1: uniform)", self.alpha)
        need(0 <= self.validation_fraction < 1, "validation-fraction", "in [0, 1)", self.validation_fraction)
        need(self.eval_every >= 1, "eval-every", ">= 1", self.eval_every)
        need(self.evaluate_on in ("test", "validation"), "evaluate-on", "'test' or 'validation'",
             self.evaluate_on)
        need(self.evaluate_on == "test" or self.validation_fraction > 0, "validation-fraction",
             "> 0 with evaluate-on = validation", self.validation_fraction)
        need(0 <= self.group_size <= 100_000, "group-size", "in [0, 100000] (0 = the paper's per-batch Z)",
             self.group_size)
        need(self.group_size == 0 or self.method == "local-group-dp", "group-size",
             f"0 for method {self.method!r} (a fixed group size is for local-group-dp)", self.group_size)
        need(not (self.method == "local-group-dp" and not self.group_size and self.accounting == "exact"),
             "accounting", "sqrt-rounds or scaled-steps for local-group-dp with group-size = 0 (its "
             "data-dependent noise has no exact account; set group-size > 0 to account it)", self.accounting)
        need(not (self.inclusion == "record" and self.accounting == "exact"), "inclusion",
             "'subject' with accounting = exact", self.inclusion)
        need(0 <= self.max_records_per_subject <= 100_000, "max-records-per-subject",
             "in [0, 100000] (0 = reported counts, not DP)", self.max_records_per_subject)
        need(math.isfinite(self.sample_rate) and 0 < self.sample_rate <= 1, "sample-rate", "in (0, 1]",
             self.sample_rate)
        if self.public_cap:
            need(self.inclusion == "subject", "max-records-per-subject",
                 "0 (reported counts, not DP) with inclusion = record (the paper's accounting)",
                 self.max_records_per_subject)
            need(not self.report_batch_stats, "report-batch-stats",
                 "false with max-records-per-subject > 0 (per-batch group sizes and distinct-subject counts "
                 "are data-dependent, not DP; they are for the reported-counts reproduction, "
                 "max-records-per-subject = 0)", self.report_batch_stats)
            need(self.method != "local-group-dp" or self.group_size > 0, "max-records-per-subject",
                 "0 (reported counts, not DP) for local-group-dp with group-size = 0 (the paper's "
                 "data-dependent Z; set group-size > 0 to run it under the public cap)",
                 self.max_records_per_subject)

    @property
    def private(self) -> bool:
        return self.method != "fedavg"

    @property
    def public_cap(self) -> bool:
        """Public-cap mode (``max-records-per-subject`` > 0): nothing data-dependent is
        sent at set-up; 0 is the reported-counts mode."""
        return self.max_records_per_subject > 0


KEYMAP = {f.replace("_", "-"): f for f in SubjectDPConfig.__dataclass_fields__}


def parse_subject_config(run_config: dict) -> SubjectDPConfig:
    """Build the config from a run config; unknown keys are ignored (they belong
    to other apps), bad values raise :class:`ConfigError` naming the key. Joint DP's
    ``neighbouring`` and ``secure-noise`` are refused unless at their defaults:
    subject-level DP is add/remove (one subject present or absent) with float32 noise
    from a CSPRNG-seeded generator, and would otherwise ignore them silently."""
    neighbouring = run_config.get("neighbouring", "add-remove")
    need(neighbouring == "add-remove", "neighbouring",
         "'add-remove' for subject-level DP (one subject's records present or absent; replace-one is joint DP's)",
         neighbouring)
    secure = run_config.get("secure-noise", False)
    need(secure in (False, "false", 0), "secure-noise",
         "false for subject-level DP (its noise is float32 from a CSPRNG-seeded generator; secure noise is "
         "joint DP's)", secure)
    return parse_dataclass(SubjectDPConfig, run_config, KEYMAP)
