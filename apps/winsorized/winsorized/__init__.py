"""The winsorized user-level mean Flower App: ``server_app`` (ServerApp), ``client_app`` (ClientApp) and ``task`` (users, data, run config).

Federated softmax regression under **user-level** DP with a trusted aggregator:
every round each of ``num-users`` users takes ``local-steps`` full-batch gradient
steps from the global model ``w`` on its own records, and the server releases the
winsorized private mean of the users' updates
(:class:`~flwr_jdp.strategies.winsorized.DifferentialPrivacyWinsorizedMean` around
Flower's ``FedAvg``; Levy et al., "Learning with User-Level Privacy"). Its two
noise multipliers are calibrated before round 1 so that ``rounds`` releases reach
``target-epsilon`` at ``delta`` (replace-one user, ``n = num-users`` public); every
round is charged to a :class:`~flwr_jdp.privacy.ledger.PrivacyLedger` before its
messages leave the server.

Users and nodes. A SuperNode with ``partition-id = p`` of ``num-partitions = P``
hosts users ``p, p + P, ...`` (one user per node when ``num-users = P``) and
builds their records itself: synthetic (the default; no data needed) or a real
data set's balanced partition (``fashion-mnist`` / ``mnist`` from ``data-dir``,
or scikit-learn's ``digits``). The server asks every node once which users it
hosts, then drives the strategy over :class:`UserGrid`, a Grid with one node per
user, which packs the messages of the users of one SuperNode into one message and
splits its reply into one standard Flower reply per user (``arrays = {w: w_k}``,
``metrics = {num-examples: m_k}``): ``FedAvg`` and the DP wrapper see one client
per user, the transport one message per SuperNode. Wire format:
:mod:`flwr_jdp.winsorized.protocol`.

Evaluation: each user measures the global model on its own test records; the
accuracy and loss logged per round are their means over users (FedAvg's
``num-examples``-weighted average). They are computed on held-out records, outside
the training-data guarantee, as in Flower's own examples.

Run it with ``flwr run apps/winsorized --stream``. Run-config keys (every key
has a default; a bad value fails at start-up naming the key and its range):

- users and data: ``num-users``, ``dataset`` (``synthetic`` | ``digits`` |
  ``fashion-mnist`` | ``mnist``), ``data-seed``; synthetic: ``samples-per-user``,
  ``test-samples`` (per user), ``dim``, ``classes``, ``separation``; real:
  ``data-dir``, ``classes-per-user``, ``max-records`` (0 = all), ``pool``
  (average-pool images over ``pool x pool`` blocks);
- training: ``rounds`` (T, also the horizon the noise is calibrated for),
  ``local-steps`` (E), ``lr``;
- privacy: ``target-epsilon``, ``delta``, ``bound`` (B: the histogram's range
  ``[-B, B]`` per coordinate after the rotation, about the largest update norm),
  ``tau`` (the L2 radius the users' updates concentrate in around their mean; B and
  tau only set the noise and the accuracy: values outside are clipped, so the
  guarantee holds whatever the data), ``range-share`` (the
  range step's share of the budget, in ``1/z^2``), ``noise-seed`` (-1: seeded from
  the OS CSPRNG), ``secure-noise`` (noise drawn from the OS CSPRNG itself);
- ``results-dir`` (``""``: a new folder ``results/<date-time>-<run>``): the ledger
  (``ledger.json``, written before every release), ``results.json`` and the final
  model (``model.npy``). The app does not resume: a folder that already holds a
  ledger is refused."""
