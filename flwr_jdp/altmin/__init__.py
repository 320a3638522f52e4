"""Private alternating minimization (Priv-AltMin) of a shared low-rank embedding.

Jain, Rush, Smith, Song, Thakurta: "Differentially private model personalization"
(``../shared/papers/dp-model-personalization-altmin.txt``), Algorithms 1-4.

Users ``j`` hold ``(x_ij, y_ij)`` with ``y = <U*^T x, v_j*> + noise``. The shared
embedding ``U`` (``d x k``, orthonormal columns) is released under user-level DP
(a user's whole data set is the unit); each user's ``v_j`` is computed locally from
the released ``U`` and never sent (billboard model, hence joint DP).

Modules: :mod:`.problem` (synthetic users), :mod:`.statistics` (per-user clipped
sufficient statistics and their sensitivities), :mod:`.release` (the Gaussian and
Wigner releases and their ledger events), :mod:`.solver` (``U`` from released
statistics, local ``v_j``, errors), :mod:`.plan` (budget split and calibration),
:mod:`.algorithm` (the whole algorithm in one process), :mod:`.baselines`,
:mod:`.exponential` (Algorithm 4, the exponential-mechanism reference).
"""
