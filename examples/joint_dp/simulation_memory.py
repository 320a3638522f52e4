"""Memory of a running Flower simulation, sampled from ``/proc`` (Linux only).

Every ``--interval`` seconds it sums the proportional set size (PSS, from
``/proc/PID/smaps_rollup``; shared pages such as Ray's object store are split among
the processes that map them, so the sum does not double count) of every process
whose command line contains one of ``--match`` (default: Ray's actors and services
and the reproduction's and ``flwr`` processes), and appends
``time,processes,pss_mib,owners,method,trust,epsilon,records_per_user,personal`` to
``--out``; the last six are read from the command line of the reproduction
(``python -m research.reproduce_joint_dp``, or the former ``flwr-jdp reproduce``)
process running at that moment (empty when none is, or when the command leaves that
option at its default), so every sample names the cell it belongs to. As for argparse,
an option given twice counts with its last value. It stops after ``--duration`` seconds or when killed; every sample is on
disk as soon as it is taken.

Used beside the Table 1 cells at n = 512 (issue 3: "the 512-owner simulation must
finish; memory per owner reported")::

    python examples/joint_dp/simulation_memory.py --out results/joint_dp/memory_cells.csv &
    python -m research.reproduce_joint_dp --owners 512 ...

``examples/joint_dp/report.py`` reads every ``memory_*.csv`` beside the tables and
reports the peak per cell.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_MATCH = ("ray::", "/ray/", "research.reproduce_joint_dp", "flwr-jdp", "flwr-", "flower-")
FIELDS = ("time", "processes", "pss_mib", "owners", "method", "trust", "epsilon", "records_per_user",
          "personal")
#: Reproduction options that name a cell, in the CSV's order.
CELL_OPTIONS = ("--owners", "--method", "--trust", "--epsilon", "--records-per-user", "--personal")


def _pss_kib(pid: str) -> int:
    for line in (Path("/proc") / pid / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def cell_of_command(argv: list[str]) -> list[str]:
    """The values of ``CELL_OPTIONS`` in a reproduction's command line ("" for an
    option it leaves out; the last value of an option it repeats, as argparse reads it)."""
    values = dict.fromkeys(CELL_OPTIONS, "")
    for opt, value in zip(argv, argv[1:], strict=False):
        if opt in values:
            values[opt] = value
    return list(values.values())


def is_reproduction(argv: list[str]) -> bool:
    """Whether ``argv`` runs a joint-DP cell: ``python -m research.reproduce_joint_dp ...``
    (or the ``flwr-jdp reproduce joint-dp ...`` of the runs before it moved to ``research/``)."""
    return "research.reproduce_joint_dp" in argv or ("reproduce" in argv and any(a.endswith("flwr-jdp") for a in argv))


def sample(match: tuple[str, ...]) -> tuple[int, float, list[str]]:
    """(number of matching processes, their summed PSS in MiB, the running cell)."""
    count, kib, cell = 0, 0, [""] * len(CELL_OPTIONS)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cmd = " ".join(argv)
            if not any(m in cmd for m in match):
                continue
            kib += _pss_kib(entry.name)
            count += 1
            if is_reproduction(argv):
                cell = cell_of_command(argv)
        except (OSError, ValueError):
            continue  # the process ended while we read it
    return count, kib / 1024.0, cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="CSV to append time,processes,pss_mib to")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (> 0)")
    parser.add_argument("--duration", type=float, default=float("inf"), help="stop after this many seconds")
    parser.add_argument("--match", nargs="+", default=list(DEFAULT_MATCH),
                        help="substrings of the command lines to count")
    args = parser.parse_args()
    if args.interval <= 0:
        parser.error("--interval must be > 0 seconds")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = ",".join(FIELDS)
    if not out.exists():
        out.write_text(header + "\n")
    elif (first := out.read_text().split("\n", 1)[0]) != header:
        parser.error(f"--out {out} has the columns {first!r}, not {header!r}: "
                     "name a new file (report.py reads every memory_*.csv)")
    start = time.time()
    while time.time() - start < args.duration:
        count, mib, cell = sample(tuple(args.match))
        with out.open("a") as f:
            f.write(",".join([f"{time.time():.0f}", str(count), f"{mib:.1f}", *cell]) + "\n")
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
