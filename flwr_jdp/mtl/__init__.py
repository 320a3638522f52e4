"""DP mean-regularized multi-task learning (Hu, Wu and Smith, Algorithm 1).

Each task (owner) ``k`` keeps its whole model ``w_k``; the only thing any other
task sees is the noisy mean ``w~ = mean(w_k) + N(0, sigma^2 I)`` the trusted
aggregator broadcasts. Privacy guarantee: task-level (epsilon, delta)-joint DP
(unit: one task's whole data set), by the billboard lemma (Hsu et al. 2016):
the sequence of ``w~`` is (epsilon, delta)-DP and each personalized model is a
function of its own task's data and that sequence.

Modules: :mod:`.noise` (the release, paper vs tight calibration, Theorem 1's
RDP), :mod:`.models` (linear task models), :mod:`.tasks` (synthetic and real
tasks), :mod:`.local` (projected gradient descent and fine-tuning),
:mod:`.algorithm` (configuration and the single-process reference loop),
:mod:`.config` (run-config parsing), :mod:`.client` (the client half for a user's
own torch ClientApp: :class:`~flwr_jdp.mtl.client.MTLClient`).
"""
