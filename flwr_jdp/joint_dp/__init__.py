"""Joint DP on shared parameters (record, user or owner unit; local or central noise).

``client`` (the drop-in client half :class:`JointDPClient`), ``protocol`` (message
keys), ``config`` (run config), ``validation`` (reply checks), ``release`` (what a
release is and the model it is computed on), ``owner_store`` (an owner's personal
state), ``budgets`` (owners whose node caps their budget, node config ``max-epsilon``). The strategy is :class:`flwr_jdp.strategies.JointDP` (``strategies/joint_dp/``);
the project's own Flower App on this client half is ``apps/joint_dp`` (its FedAvg
twin, without DP: ``apps/fedavg``).
"""
