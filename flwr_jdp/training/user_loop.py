"""The drop-in client's DP pass, under its former name: everything is in
:mod:`flwr_jdp.training.dp_pass` (this module re-exports it for code that imports it
from here)."""

from .dp_pass import (
    LOSSES,
    PendingOutput,
    PoissonBatches,
    PoissonLoader,
    PrivateModule,
    PrivateRound,
    UserLoopError,
    private_training,
)
from .dp_pass.batches import _empty_like
from .dp_pass.capture import _DPPass
from .dp_pass.common import _WARNED
from .dp_pass.plan import _SyntheticSet

__all__ = ["LOSSES", "PendingOutput", "PoissonBatches", "PoissonLoader", "PrivateModule", "PrivateRound",
           "UserLoopError", "_DPPass", "_SyntheticSet", "_WARNED", "_empty_like", "private_training"]
