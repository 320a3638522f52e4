"""Write results/mutation/summary.json from mutmut's per-file results.

Run from the repository root after ``mutmut run`` (docs/mutation.md)::

    python results/mutation/summarize.py --patterns | xargs -d '\n' mutmut run --max-children 1
    rm mutants/mutmut-stats.json
    export FLWR_JDP_MUTATION_TESTS=$(python results/mutation/summarize.py --scoped-tests)
    python results/mutation/summarize.py --patterns --scoped | xargs -d '\n' mutmut run --max-children 2
    unset FLWR_JDP_MUTATION_TESTS; rm mutants/mutmut-stats.json
    python results/mutation/summarize.py [--triaged docs/mutation.md]

``--patterns`` prints mutmut's name patterns for :data:`SELECTED` (the mutated
code: whole modules, and the aggregation and noise functions of JointDP in
``strategies/joint_dp/plan.py`` and ``aggregation.py``, named by file path
(``strategies.joint_dp.plan.…``; the set-up, logging, results and
evaluation code is not privacy-critical); a plain ``mutmut run`` would check every
function of every ``only_mutate`` file. The summary counts exactly the mutants of
:data:`SELECTED`. ``--patterns`` leaves out :data:`SCOPED_MODULES` (the accounting
that nearly every test calls); ``--patterns --scoped`` prints only those, to be run
against :data:`SCOPED_TESTS` alone (``--scoped-tests``, for the mutation plugin's
``FLWR_JDP_MUTATION_TESTS``), with mutmut's coverage pass collected afresh for that
test set (hence the ``rm`` before and after).

It reads ``mutants/<file>.meta`` (the exit code mutmut recorded for each mutant of
each mutated file) and maps the codes with mutmut's own ``status_by_exit_code``,
so the counts are those ``mutmut results --all true`` lists. No date or timing
goes into the file. ``--triaged``: mutants named in that file (in backquotes,
``<module>.<mutant>``) are counted as triaged survivors (equivalent or not worth a
test, with the reason there); the kill rate is killed / (all - not checked), a
timeout not counted as killed.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

#: What is mutation-tested: a module name (every function of it) or one function's
#: mutmut name (``<module>.x_<function>`` or ``<module>.xǁ<Class>ǁ<method>``).
SELECTED = (
    "flwr_jdp.privacy.mechanisms",
    "flwr_jdp.joint_dp.owner_guard",
    # The parties' own guard (owners and silos: the check, the ledger, its file) and
    # the silos' agreement derived from the run config.
    "flwr_jdp.privacy.guard",
    "flwr_jdp.subject.silo_guard",
    "flwr_jdp.training.user_loop",  # before the split into dp_pass/
    "flwr_jdp.training.dp_pass.step",
    "flwr_jdp.training.dp_pass.batches",
    "flwr_jdp.training.dp_pass.entry",
    "flwr_jdp.training.dp_sgd",
    "flwr_jdp.joint_dp.validation",
    # JointDP's aggregation and noise: selection (fraction-train), calibration of z,
    # the charge before the instruction leaves, validation -> re-clip -> sum -> noise
    # -> normalise, and the inner strategy's post-processing.
    "strategies.joint_dp.plan.xǁReleasePlanǁ_select",
    "strategies.joint_dp.plan.xǁReleasePlanǁ_calibrate",
    "strategies.joint_dp.plan.xǁReleasePlanǁconfigure_train",
    "strategies.joint_dp.aggregation.xǁAggregationǁaggregate_train",
    "strategies.joint_dp.aggregation.xǁAggregationǁ_aggregate",
    "strategies.joint_dp.aggregation.xǁAggregationǁ_post_process",
    "flwr_jdp.joint_dp.client",
    "flwr_jdp.joint_dp.release",
    "flwr_jdp.joint_dp.owner_store",
    # The generic accounting: events, both backends, calibration, the ledger and
    # horizontal composition (subject-level DP).
    "flwr_jdp.privacy.ledger",
    "flwr_jdp.privacy.calibration",
    "flwr_jdp.privacy.accountants",
    "flwr_jdp.privacy.events",
    "flwr_jdp.privacy.rdp",
    "flwr_jdp.privacy.horizontal",
    # DP-MTL: the release (noise calibration, events) and the server's sampling, noisy
    # mean, charge and reply checks.
    "flwr_jdp.mtl.noise",
    "flwr_jdp.mtl.algorithm.xǁMeanServerǁ__init__",
    "flwr_jdp.mtl.algorithm.xǁMeanServerǁsample",
    "flwr_jdp.mtl.algorithm.xǁMeanServerǁnoisy_mean",
    "strategies.dp_mtl.xǁDPMeanRegularizedMTLǁ_plan",
    "strategies.dp_mtl.xǁDPMeanRegularizedMTLǁconfigure_train",
    "strategies.dp_mtl.xǁDPMeanRegularizedMTLǁaggregate_train",
    # Subject-level DP: the plan (worst-case counts, rates, z), the per-subject cap,
    # the silos' DP training, and the server's charge, instruction and averaging.
    "flwr_jdp.subject.plan",
    "flwr_jdp.subject.silos",
    "flwr_jdp.training.subject_level",
    "strategies.subject_level.xǁSubjectLevelFedAvgǁround_events",
    "strategies.subject_level.xǁSubjectLevelFedAvgǁ_train_messages",
    "strategies.subject_level.xǁSubjectLevelFedAvgǁ_collect",
    "strategies.subject_level.xǁSubjectLevelFedAvgǁconfigure_train",
    "strategies.subject_level.xǁSubjectLevelFedAvgǁaggregate_train",
    # Priv-AltMin: its Gaussian releases, the charge and the noisy aggregation.
    "flwr_jdp.altmin.release",
    "strategies.priv_altmin.xǁPrivAltMinǁconfigure_train",
    "strategies.priv_altmin.xǁPrivAltMinǁ_valid",
    "strategies.priv_altmin.xǁPrivAltMinǁaggregate_train",
    "strategies.priv_altmin.xǁPrivAltMinǁround_releases",
    "strategies.priv_altmin.xǁPrivAltMinǁrelease_events",
    "strategies.priv_altmin.xǁPrivAltMinǁ_charge",
    # The winsorized user-level mean: the estimator and the strategy's aggregation.
    "flwr_jdp.winsorized.estimator",
    "strategies.winsorized.xǁDifferentialPrivacyWinsorizedMeanǁconfigure_train",
    "strategies.winsorized.xǁDifferentialPrivacyWinsorizedMeanǁ_update",
    "strategies.winsorized.xǁDifferentialPrivacyWinsorizedMeanǁaggregate_train",
)


#: The accounting every release goes through: almost every test of the selection calls
#: it, so a survivor here would rerun all of them (up to 300 s each on 2 cores). These
#: are run against the accounting's own unit tests (:data:`SCOPED_TESTS`) instead.
SCOPED_MODULES = (
    "flwr_jdp.privacy.calibration",
    "flwr_jdp.privacy.accountants",
    "flwr_jdp.privacy.events",
    "flwr_jdp.privacy.rdp",
)
SCOPED_TESTS = (
    "tests/test_mutation_privacy.py",
    "tests/test_ledger.py",
    "tests/test_calibration_relation.py",
)


#: The five modules of the first run (commit 2a5b73a: every mutant checked, survivors
#: re-checked after the unit tests were added), before they moved into
#: ``flwr_jdp/joint_dp/`` with only imports and docstrings changed (``validation.py``'s
#: ``spec_of``, 6 mutants, all killed, moved to ``flwr_jdp/records.py``). A module whose
#: mutants were not all re-checked in ``./mutants`` after the move is reported with
#: these counts, and with what was re-checked (``rechecked_after_move``).
FULL_RUN_BEFORE_MOVE = {
    "flwr_jdp/privacy/mechanisms.py": {"killed": 320, "survived": 19, "timeout": 1},
    "flwr_jdp/joint_dp/owner_guard.py": {"killed": 162, "survived": 5},
    "flwr_jdp/training/user_loop.py": {"killed": 127, "survived": 10},
    "flwr_jdp/training/dp_sgd.py": {"killed": 479, "survived": 30},
    "flwr_jdp/joint_dp/validation.py": {"killed": 208, "survived": 8},
}


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _rate(counts: Counter) -> float | None:
    checked = sum(counts.values()) - counts.get("not checked", 0)
    return round(counts.get("killed", 0) / checked, 4) if checked else None


def _is_function(name: str) -> bool:
    return ".x_" in name or ".xǁ" in name


def patterns(scoped: bool = False) -> list[str]:
    """mutmut name patterns (fnmatch) for :data:`SELECTED` without (``scoped``: only)
    :data:`SCOPED_MODULES`: each must also match the function's own name, so that
    mutmut's clean run is limited to its tests."""
    chosen = [s for s in SELECTED if (s in SCOPED_MODULES) == scoped]
    return [f"{s}*" if _is_function(s) else f"{s}.*" for s in chosen]


def selected(mutant: str) -> bool:
    function = mutant.partition("__mutmut_")[0]
    return any(function == s if _is_function(s) else function.startswith(s + ".") for s in SELECTED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triaged", default="docs/mutation.md")
    parser.add_argument("--out", default="results/mutation/summary.json")
    parser.add_argument("--patterns", action="store_true", help="print the mutant name patterns and stop")
    parser.add_argument("--scoped", action="store_true",
                        help="with --patterns: the patterns of SCOPED_MODULES only")
    parser.add_argument("--scoped-tests", action="store_true",
                        help="print SCOPED_TESTS comma-separated (FLWR_JDP_MUTATION_TESTS) and stop")
    args = parser.parse_args()
    if args.scoped_tests:
        print(",".join(SCOPED_TESTS))
        return
    if args.patterns:
        print("\n".join(patterns(args.scoped)))
        return
    cfg = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]
    triaged_text = Path(args.triaged).read_text() if Path(args.triaged).is_file() else ""
    triaged = set(re.findall(r"`([\w.ǁ]+__mutmut_\d+)`", triaged_text))
    modules, total = {}, Counter()
    for path in cfg["only_mutate"]:
        meta = json.loads((Path("mutants") / (path + ".meta")).read_text())
        codes = {k: code for k, code in meta["exit_code_by_key"].items() if selected(k)}
        counts = Counter(status_by_exit_code[code] for code in codes.values())
        survivors = [k for k, code in codes.items() if status_by_exit_code[code] == "survived"]
        row: dict = {}
        if counts.get("not checked") and path in FULL_RUN_BEFORE_MOVE:
            rechecked = Counter({k: v for k, v in counts.items() if k != "not checked"})
            row["source"] = "full run before the move (2a5b73a); see rechecked_after_move"
            row["rechecked_after_move"] = dict(sorted(rechecked.items()), checked=sum(rechecked.values()),
                                               of=sum(counts.values()))
            counts = Counter(FULL_RUN_BEFORE_MOVE[path])
            named = {k for k in triaged if k.startswith(_module_of(path) + ".")}
            row["survived_triaged"] = min(len(named), counts.get("survived", 0))
        else:
            row["survived_triaged"] = sum(1 for k in survivors if k in triaged)
        row["survived_untriaged"] = sorted(k for k in survivors if k not in triaged)
        row.update(dict(sorted(counts.items())), total=sum(counts.values()), kill_rate=_rate(counts))
        modules[path] = row
        total.update(counts)
    summary = {
        "tool": "mutmut",
        "command": "mutmut run --max-children 1 " + " ".join(f"'{p}'" for p in patterns()),
        "scoped_command": (f"FLWR_JDP_MUTATION_TESTS={','.join(SCOPED_TESTS)} mutmut run --max-children 2 "
                           + " ".join(f"'{p}'" for p in patterns(scoped=True))),
        "selected": list(SELECTED),
        "test_selection": cfg["pytest_add_cli_args_test_selection"],
        "scoped_modules": list(SCOPED_MODULES),
        "scoped_test_selection": list(SCOPED_TESTS),
        "modules": modules,
        "total": dict(sorted(total.items()), total=sum(total.values()), kill_rate=_rate(total),
                      survived_triaged=sum(r["survived_triaged"] for r in modules.values()),
                      survived_untriaged=sum(len(r["survived_untriaged"]) for r in modules.values())),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    for path, row in modules.items():
        print(f"{path}: {row['total']} mutants, killed {row.get('killed', 0)}, survived {row.get('survived', 0)}"
              f" ({row['survived_triaged']} triaged), timeout {row.get('timeout', 0)},"
              f" no tests {row.get('no tests', 0)}, kill rate {row['kill_rate']}")


if __name__ == "__main__":
    main()
