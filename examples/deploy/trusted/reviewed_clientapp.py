"""Flower's ``flwr-clientapp``, run only on a FAB its node's owner reviewed.

Under local noise an owner's guarantee rests on the ClientApp code its SuperNode
runs, and in a Flower deployment that code arrives with each run, as a FAB (a zip
of the app's files) that whoever starts the run built. This launcher is Flower's
own ``flwr-clientapp`` (:func:`flwr.supernode.cli.flwr_clientapp.flwr_clientapp`)
with one check in front of it: before the FAB is installed, its SHA-256 must be
one of those listed in the file named by ``FLWR_JDP_REVIEWED_FABS`` (``sha256sum``
output or bare hashes, ``#`` comments), the hash Flower gives the FAB and the
run's must be that same hash, and the app is installed into a fresh, private
``FLWR_HOME`` (so what is loaded is exactly the checked bytes, never an app dir
left by an earlier run). Otherwise the ClientApp raises before any of the FAB's
code is imported or run: the SuperNode sends the server an error reply, as for
any failing ClientApp, and the refusal is logged to the SuperNode's log. Without
``FLWR_JDP_REVIEWED_FABS`` (or with an unreadable or empty file) every FAB is
refused.

The SuperNode starts ClientApps by name (``flwr-clientapp``, through a
``flower-superexec`` it also starts by name), so an owner puts ``bin/`` of this
folder first on its SuperNode's ``PATH`` (docs/deploy.md, *Run only the app you
reviewed*). Written for Flower 1.41's
``flwr.supernode.runtime.run_clientapp``; if that module no longer has the
functions the check wraps, the launcher refuses to start.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "FLWR_JDP_REVIEWED_FABS"


class UnreviewedFab(RuntimeError):
    """The FAB this ClientApp was asked to run is not one its owner reviewed."""


def reviewed_hashes(path: str | None) -> set[str]:
    """The SHA-256 hashes (lower-case hex) listed in ``path``; empty if unreadable."""
    if not path:
        return set()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        words = line.split("#", 1)[0].split()
        if words and len(words[0]) == 64 and all(c in "0123456789abcdef" for c in words[0].lower()):
            out.add(words[0].lower())
    return out


def check_fab(content: bytes, fab_hash: str, run_fab_hash: str, reviewed: set[str]) -> str:
    """The FAB's SHA-256 if it is reviewed and named by that hash; else raise UnreviewedFab."""
    digest = hashlib.sha256(content).hexdigest()
    if digest not in reviewed:
        raise UnreviewedFab(f"refused FAB sha256={digest}: not one this node's owner reviewed "
                            f"({len(reviewed)} hash(es) in ${ENV})")
    if fab_hash != digest or run_fab_hash != digest:
        raise UnreviewedFab(f"refused FAB sha256={digest}: Flower names it {fab_hash!r} "
                            f"(run: {run_fab_hash!r})")
    return digest


def main() -> None:
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp
    from flwr.supernode.runtime import run_clientapp as rc

    if not (callable(getattr(rc, "pull_task_input", None)) and callable(getattr(rc, "install_from_fab", None))):
        sys.exit("reviewed_clientapp: this Flower's flwr-clientapp cannot be checked; refusing to run")
    pull, install = rc.pull_task_input, rc.install_from_fab
    seen: dict[str, str] = {}

    def pull_task_input(client):  # Flower's, noting the hashes the FAB arrived with
        message, context, run, fab = pull(client)
        seen.update(fab=fab.hash_str, run=run.fab_hash)
        return message, context, run, fab

    def install_from_fab(content, *args, **kwargs):  # the check, then Flower's install
        try:
            digest = check_fab(content, seen.get("fab", ""), seen.get("run", ""),
                               reviewed_hashes(os.environ.get(ENV)))
        except UnreviewedFab as err:
            print(f"reviewed_clientapp: {err}", file=sys.stderr, flush=True)
            raise
        print(f"reviewed_clientapp: running reviewed FAB sha256={digest}", file=sys.stderr, flush=True)
        return install(content, *args, **kwargs)

    rc.pull_task_input, rc.install_from_fab = pull_task_input, install_from_fab
    home = tempfile.mkdtemp(prefix="flwr-jdp-reviewed-")
    os.environ["FLWR_HOME"] = home  # installed and loaded from here only
    try:
        flwr_clientapp()
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
