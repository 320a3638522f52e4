"""Joint DP on shared parameters (record, user or owner unit; local or central noise).

``strategy`` (the ServerApp's :class:`JointDP`), ``client`` (the drop-in client half
:class:`JointDPClient`), ``protocol`` (message keys), ``config`` (run config),
``validation`` (reply checks), ``release`` (what a release is and the model it is
computed on), ``owner_store`` (an owner's personal state) and the project's own
Flower App, written as a user's app on the same client half (``task``: model, data,
train and test; ``server_app``, ``client_app``, and ``fedavg_app``, the same app on
plain FedAvg).
"""
