"""The client halves a user's ClientApp calls from its own handlers.

- :class:`JointDPClient`: joint DP on the shared parameters of the user's model
  (:mod:`flwr_jdp.joint_dp.client`).
- :class:`MTLClient`: DP mean-regularized multi-task learning on the user's model
  (:mod:`flwr_jdp.mtl.client`).
- :func:`owners_mod`: a Flower mod with which one SuperNode hosts several owners.
"""

from flwr_jdp.joint_dp.client import JointDPClient, owners_mod
from flwr_jdp.mtl.client import MTLClient

__all__ = ["JointDPClient", "MTLClient", "owners_mod"]
