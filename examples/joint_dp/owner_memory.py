"""Memory the simulation keeps per owner: the personal state of joint DP.

In a joint-DP run every owner's personal parameters stay on its node, in the
ClientApp's ``context.state`` (and, on a SuperNode started with ``state-dir``, in one
``.npz`` file per owner). This script measures that state with the project's own
code path (:func:`flwr_jdp.joint_dp.owner_store.load_personal_arrays` and
:func:`~flwr_jdp.joint_dp.owner_store.save_personal_arrays`, exactly what the client half calls),
for the Table 1 configuration (Fashion-MNIST, N = 10,000, FC1 personal) at each n:

- ``state_bytes_per_owner``: bytes of the arrays that ``context.state`` holds per owner;
- ``npz_bytes_per_owner``: size of the owner's file in a node's ``state-dir``;
- ``rss_growth_bytes``: growth of this process's resident memory while one node
  holds all n owners' state (a coarse check that nothing else is kept per owner).

    python examples/joint_dp/owner_memory.py --owners 256 512 \\
        --data-dir ../shared/data/fashion-mnist

Writes ``results/joint_dp/owner_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict

from apps.joint_dp.joint_dp.task import initial_model, owner_data
from flwr_jdp.joint_dp import owner_store
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.params import get_arrays, split_parameters

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.reproduce_joint_dp import Cell, run_config  # noqa: E402


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def measure(owners: int, data_dir: str, personal: str) -> dict:
    """Hold every owner's personal state on one node and measure it."""
    cell = Cell("fashion-mnist", owners, "joint-dp", "local", 1.0, 1, personal)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config(run_config(cell, 0, data_dir, tmp))
        data = owner_data(cfg)
        model = initial_model(cfg)
        split = split_parameters(model, cfg.effective_personal_rule)
        counts = {name: p.numel() for name, p in model.named_parameters()}
        ctx = Context(run_id=1, node_id=1, node_config={"state-dir": tmp}, state=RecordDict(),
                      run_config={})
        before = rss_bytes()
        for d in data:
            m = initial_model(cfg)
            owner_store.load_personal_arrays(ctx, d.owner_id, "memory")
            owner_store.save_personal_arrays(ctx, d.owner_id, dict(get_arrays(m, split.personal)), "memory",
                                             fit_on="x")
        growth = rss_bytes() - before
        state = [sum(a.nbytes for a in ctx.state[owner_store.personal_key(d.owner_id)]
                     .to_numpy_ndarrays()) for d in data]
        files = sorted((Path(tmp) / "memory").glob("personal-*.npz"))
        npz = [f.stat().st_size for f in files]
    return {
        "owners": owners,
        "personal_layers": personal,
        "personal_parameters": int(sum(counts[n] for n in split.personal)),
        "shared_parameters": int(sum(counts[n] for n in split.shared)),
        "state_bytes_per_owner": int(np.mean(state)),
        "state_bytes_all_owners": int(np.sum(state)),
        "npz_files": len(npz),
        "npz_bytes_per_owner": int(np.mean(npz)),
        "rss_growth_bytes": int(growth),
        "rss_growth_per_owner_bytes": int(growth / owners),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--personal", default="fc1")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--out", default=str(ROOT / "results" / "joint_dp" / "owner_memory.json"))
    args = parser.parse_args()
    rows = [measure(n, args.data_dir, args.personal) for n in args.owners]
    for r in rows:
        print(f"n={r['owners']}: {r['personal_parameters']} personal parameters, "
              f"{r['state_bytes_per_owner']} B/owner in context.state, "
              f"{r['npz_bytes_per_owner']} B/owner on disk, RSS +{r['rss_growth_bytes'] / 2**20:.1f} MiB",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
