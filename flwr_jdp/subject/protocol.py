"""Message keys of subject-level DP (server: :class:`flwr_jdp.strategies.SubjectLevelFedAvg`,
ClientApp: the subject-level app, ``apps/subject_dp``), and the model <-> arrays helpers both use."""

import numpy as np
import torch

CONFIG, SETUP, MODEL, STATS = "config", "setup", "model", "stats"
SILOS = "silos"
#: the train instruction's keys: the round, each addressed silo's sampling rate, the
#: noise multiplier, and the batches per silo the noise was calibrated for
ROUND, SAMPLE_RATES, NOISE_MULTIPLIER, CALIBRATION_STEPS = (
    "round", "sample-rates", "noise-multiplier", "calibration-steps")


def silo_key(i: int) -> str:
    return f"silo.{int(i)}"


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
