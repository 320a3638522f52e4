"""Names of the accounting backends and neighbouring relations.

Kept apart from :mod:`.accountants` so that code which only validates a
configuration (the ClientApp, started afresh for every message in a deployment)
does not import dp-accounting and SciPy (about 1.7 s per process here).
"""

#: ``pld``: privacy-loss distributions (tight, the default); ``rdp``: Renyi DP.
ACCOUNTANTS = ("pld", "rdp")
#: ``add-remove``: one unit present or absent; ``replace-one``: one unit's data replaced.
RELATIONS = ("add-remove", "replace-one")
