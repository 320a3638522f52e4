"""flwr-jdp's joint-DP Flower App (``flwr run apps/joint_dp``, and ``flwr run .`` at the
repository's root): ``task`` (model, data, train, test), ``client_app`` (the client half
:class:`~flwr_jdp.client.JointDPClient` around the task) and ``server_app``
(:class:`~flwr_jdp.strategies.JointDP`).
"""
