"""The client halves a user's ClientApp calls from its own handlers.

- :class:`JointDPClient`: joint DP on the shared parameters of the user's model
  (:mod:`flwr_jdp.joint_dp.client`).
- :class:`MTLClient`: DP mean-regularized multi-task learning on the user's model
  (:mod:`flwr_jdp.mtl.client`).
"""

from flwr_jdp.joint_dp.client import JointDPClient
from flwr_jdp.mtl.client import MTLClient

__all__ = ["JointDPClient", "MTLClient"]
