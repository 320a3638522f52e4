"""Privacy units and noise placements.

A *unit* says what two neighbouring datasets differ in (add/remove neighbouring):

- ``record``: one training example of one owner.
- ``user``: all records of one user of one owner (an owner holds several users;
  records are clipped one by one and averaged per user, so a user's contribution to
  a sum has L2 norm at most the clipping norm).
- ``owner``: the whole data set of one owner (the owner's shared-parameter update is
  clipped, DP-FedAvg style).

A *placement* says who adds the noise:

- ``local``: each owner noises its own release (the server is not trusted).
- ``central``: owners send clipped quantities to a trusted aggregator that adds
  Gaussian noise once to their sum (the billboard model).
- ``distributed``: each owner adds a share of integer (Skellam) noise to its clipped,
  rounded sum, and secure aggregation (Flower's SecAgg+) reveals only the sum of all
  owners' vectors to the server, which carries the whole noise
  (:mod:`flwr_jdp.privacy.skellam`).
"""

from __future__ import annotations

from enum import StrEnum


class PrivacyUnit(StrEnum):
    """What one neighbouring dataset changes."""

    RECORD = "record"
    USER = "user"
    OWNER = "owner"
    SUBJECT = "subject"


class NoisePlacement(StrEnum):
    """Who adds the Gaussian noise."""

    LOCAL = "local"
    CENTRAL = "central"
    DISTRIBUTED = "distributed"
