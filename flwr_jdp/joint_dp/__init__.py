"""Joint DP on shared parameters (record, user or owner unit; local or central noise).

``strategy`` (the ServerApp's :class:`JointDP`), ``client`` (the drop-in client half
:class:`JointDPClient`), ``protocol`` (message keys), ``config`` (run config),
``validation`` (reply checks), ``owner_store`` / ``owner_round`` (an owner's state
and round) and the project's own Flower App (``server_app``, ``client_app``,
``fedavg_app``).
"""
