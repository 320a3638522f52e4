"""The client halves a user's ClientApp calls from its own handlers.

- :class:`JointDPClient`: joint DP on the shared parameters of the user's model
  (:mod:`flwr_jdp.joint_dp.client`).
- :func:`numpy_client_app`: the joint-DP ClientApp of a legacy app whose
  ``client_fn`` returns a ``NumPyClient`` (:mod:`flwr_jdp.joint_dp.legacy`).
- :func:`lightning_loss`, :func:`huggingface_loss`: ``loss_fn`` of a PyTorch Lightning
  module and of a Hugging Face transformers model (:mod:`flwr_jdp.joint_dp.frameworks`).
- :class:`MTLClient`: DP mean-regularized multi-task learning on the user's model
  (:mod:`flwr_jdp.mtl.client`).
- :func:`owners_mod`: a Flower mod with which one SuperNode hosts several owners.
"""

from flwr_jdp.joint_dp.client import JointDPClient, owners_mod
from flwr_jdp.joint_dp.frameworks import huggingface_loss, lightning_loss
from flwr_jdp.joint_dp.legacy import numpy_client_app
from flwr_jdp.mtl.client import MTLClient

__all__ = ["JointDPClient", "MTLClient", "huggingface_loss", "lightning_loss", "numpy_client_app", "owners_mod"]
