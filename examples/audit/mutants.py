"""Mutation test of the production-path privacy audits (tests/test_audit_production.py).

For the unchanged code (the control) and for each mutant, the repository's files
(``git ls-files``: tracked, plus untracked files git does not ignore) are copied to a
fresh temporary directory, the mutant's textual replacement is applied there (each
pattern must occur exactly once), and the audit test(s) of the mutated path are run
in that copy with pytest. The real working tree is never modified.

Imports come from the copy: the package is installed in editable mode, whose import
hook maps ``flwr_jdp`` to the real tree; in the copy, ``PYTHONPATH`` puts the copy
first, so ``flwr_jdp`` is found there before the hook is asked. This is checked
twice: by a preflight import in the copy, and by every audit, which records where
``flwr_jdp`` was imported from (a run that imported the real tree fails).

Expected: the control passes every audit (lower bound <= claim); every mutant fails
its audit(s) *because the certified lower bound exceeds the claim* (an error of any
other kind counts as not caught). Exit status 1 if any mutant survives or is not
caught by the audit, or if the control fails.

    python examples/audit/mutants.py [--only NAME ...] [--out results/audit/mutants.json]

Writes the summary (table rows, every audit's numbers) to ``results/audit/mutants.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "tests/test_audit_production.py"


@dataclass(frozen=True)
class Mutant:
    """Replacements (file, old, new) applied to a copy, and the tests that must catch them."""

    name: str
    description: str
    replacements: tuple[tuple[str, str, str], ...]
    tests: tuple[str, ...]
    audits: tuple[str, ...]  # the audit records (JSON names) the tests write
    expected: str = "fail"


LOCAL = ("test_local_dp_sgd_release_audit",)
CENTRAL = ("test_central_grad_sum_release_audit",)
DISTRIBUTED = ("test_distributed_secure_sum_release_audit",)
MTL = ("test_dp_mtl_noisy_mean_audit",)
WINSOR = ("test_winsorized_mean_audit",)
SUBJECT = ("test_subject_level_silo_round_audit",)
ALTMIN_TIE = ("test_priv_altmin_init_release_audit[near-tie]",)
ALTMIN_DOMINANT = ("test_priv_altmin_init_release_audit[dominant]",)
ALL_TESTS = LOCAL + CENTRAL + DISTRIBUTED + MTL + WINSOR + SUBJECT + ALTMIN_TIE + ALTMIN_DOMINANT
ALL_AUDITS = ("local_dp_sgd", "central_grad_sum", "distributed_secure_sum", "dp_mtl_mean", "winsorized_mean", "subject_level_silo_round",
              "priv_altmin_init_near_tie", "priv_altmin_init_dominant")

def code(snippet: str) -> str:
    """A regular expression matching ``snippet`` with any whitespace (or none) where it
    has whitespace, so the pattern survives re-wrapping and re-indentation."""
    return r"\s*".join(re.escape(part) for part in snippet.split())


MUTANTS: tuple[Mutant, ...] = (
    Mutant("control", "unchanged code", (), ALL_TESTS, ALL_AUDITS, expected="pass"),
    # (a) local DP-SGD (JointDPClient.train -> private_training in the app's own train)
    Mutant("local-noise/10", "private_training adds noise z/10 (the ledger still records z)",
           (("flwr_jdp/training/dp_pass/entry.py",
             code("GaussianSumMechanism(noise_multiplier, clipping_norm, expected,"),
             "GaussianSumMechanism(noise_multiplier / 10, clipping_norm, expected,"),),
           LOCAL, ("local_dp_sgd",)),
    Mutant("local-clip*10", "private_training clips at 10 C, noise still z C",
           (("flwr_jdp/training/dp_pass/step.py",
             code("sums = batch_sums(self.params, sample, self.clipping_norm)"),
             "sums = batch_sums(self.params, sample, self.clipping_norm * 10)"),),
           LOCAL, ("local_dp_sgd",)),
    # (b) central: owners' clipped sums + JointDP._aggregate's noise
    Mutant("central-noise/10", "JointDP._aggregate (KIND_GRAD_SUM) adds noise z/10",
           (("strategies/joint_dp/aggregation.py",
             code("GaussianSumMechanism(self.noise_multiplier, cfg.clipping_norm, "
                  "self.schedule.server_rate * self.schedule.num_units"),
             "GaussianSumMechanism(self.noise_multiplier / 10, cfg.clipping_norm, "
             "self.schedule.server_rate * self.schedule.num_units"),),
           CENTRAL, ("central_grad_sum",)),
    Mutant("central-clip*10", "owners' private_training (capture) clips at 10 C, server noise z C",
           (("flwr_jdp/training/dp_pass/step.py",
             code("sums = batch_sums(self.params, sample, self.clipping_norm)"),
             "sums = batch_sums(self.params, sample, self.clipping_norm * 10)"),),
           CENTRAL, ("central_grad_sum",)),
    # (b') distributed: owners' rounded sums + Skellam shares, summed by SecAgg+
    Mutant("distributed-share/10", "each owner's Skellam share has a tenth of its planned mu",
           (("flwr_jdp/privacy/skellam.py",
             code("return self.mu / (self.min_survivors - self.colluding)"),
             "return self.mu / (self.min_survivors - self.colluding) / 10"),),
           DISTRIBUTED, ("distributed_secure_sum",)),
    Mutant("distributed-clip*10", "owners clip each record at 10 C and round within 10 delta_2, noise for C",
           (("flwr_jdp/training/dp_pass/step.py",
             code("flat = self.encoder(clipped_unit_rows(self.params, sample, self.clipping_norm))"),
             "flat = self.encoder(clipped_unit_rows(self.params, sample, self.clipping_norm * 10))"),
            ("flwr_jdp/joint_dp/distributed.py",
             code("rounded = round_units(scaled, self.plan.delta_2, self.rng)"),
             "rounded = round_units(scaled, self.plan.delta_2 * 10, self.rng)"),),
           DISTRIBUTED, ("distributed_secure_sum",)),
    # shared by every trainer: the mechanism itself
    Mutant("mechanism-noise/10", "NoisySumMechanism.sum_noise_scale (GaussianSumMechanism.sum_noise_std) is z S / 10",
           (("flwr_jdp/privacy/mechanisms.py",
             code("return self.noise_multiplier * self.sensitivity") + r"(?=\s*\n)",
             "return self.noise_multiplier * self.sensitivity / 10"),),
           LOCAL + CENTRAL + SUBJECT, ("local_dp_sgd", "central_grad_sum", "subject_level_silo_round")),
    # (c1) DP-MTL noisy mean
    Mutant("mtl-noise/10", "MeanRelease.mechanism states sensitivity B/10: noisy_mean adds sigma/10, the ledger keeps z",
           (("flwr_jdp/mtl/noise.py",
             code("GaussianSumMechanism(self.noise_multiplier, self.radius, self.denominator,"),
             "GaussianSumMechanism(self.noise_multiplier, self.radius / 10, self.denominator,"),),
           MTL, ("dp_mtl_mean",)),
    Mutant("mtl-radius*10", "tasks project to, and the server admits, the ball of radius 10 B; noise for B",
           (("flwr_jdp/mtl/algorithm.py",
             code("local_pgd(w, mean, task, model, cfg.lam, cfg.lr, cfg.local_steps, cfg.radius)"),
             "local_pgd(w, mean, task, model, cfg.lam, cfg.lr, cfg.local_steps, cfg.radius * 10)"),
            ("strategies/dp_mtl.py",
             code("float(np.linalg.norm(w)) > self.cfg.radius * (1 + BALL_SLACK)"),
             "float(np.linalg.norm(w)) > self.cfg.radius * 10 * (1 + BALL_SLACK)")),
           MTL, ("dp_mtl_mean",)),
    # (c2) winsorized mean
    Mutant("winsor-noise/10", "WinsorizedMean.mean_mechanism states L2 sensitivity / 10: mean noise / 10",
           (("flwr_jdp/winsorized/estimator.py",
             code("width * math.sqrt(dims), float(n))"),
             "width * math.sqrt(dims) / 10, float(n))"),),
           WINSOR, ("winsorized_mean",)),
    Mutant("winsor-clip*10", "WinsorizedMean.estimate winsorizes to 10 r, noise for r",
           (("flwr_jdp/winsorized/estimator.py",
             code("total = clipped_sum(x, centre, radius)"),
             "total = clipped_sum(x, centre, 10 * radius)"),),
           WINSOR, ("winsorized_mean",)),
    # (c3) subject-level silo round (HiGradAvgDP)
    Mutant("subject-noise/10", "train_silo_round adds noise z/10",
           (("flwr_jdp/training/subject_level.py",
             code("mech = GaussianSumMechanism(z, sensitivity, expected"),
             "mech = GaussianSumMechanism(z / 10, sensitivity, expected"),),
           SUBJECT, ("subject_level_silo_round",)),
    Mutant("subject-clip*10", "HiGradAvgDP clips at 10 C, noise z C",
           (("flwr_jdp/training/subject_level.py",
             code("clipped_unit_sum(params, by_subject, plan.clipping_norm)"),
             "clipped_unit_sum(params, by_subject, plan.clipping_norm * 10)"),),
           SUBJECT, ("subject_level_silo_round",)),
    # (c4) Priv-AltMin initialisation (released: top eigenvector of the noisy statistic)
    Mutant("altmin-noise/10", "SymmetricGaussianMechanism (Wigner) noise std z S / 10",
           (("flwr_jdp/privacy/mechanisms.py",
             code("wigner(shape[0], self.sum_noise_std, rng"),
             "wigner(shape[0], self.sum_noise_std / 10, rng"),),
           ALTMIN_TIE, ("priv_altmin_init_near_tie",)),
    Mutant("altmin-clip*10", "init_statistic clips each user at 10 S, noise for S",
           (("flwr_jdp/altmin/statistics.py",
             code("c = clip_factors(np.linalg.norm(per_user, axis=(1, 2)), clip_init)"),
             "c = clip_factors(np.linalg.norm(per_user, axis=(1, 2)), clip_init * 10)"),),
           ALTMIN_DOMINANT, ("priv_altmin_init_dominant",)),
)

@dataclass
class Outcome:
    mutant: Mutant
    pytest: str = "not run"  # passed | failed
    caught: bool = False
    audits: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        if self.mutant.expected == "pass":
            return (self.pytest == "passed" and len(self.audits) == len(self.mutant.audits)
                    and all(not a["violates_claim"] for a in self.audits.values()))
        return self.caught


def repo_files() -> list[str]:
    """Tracked files and untracked, non-ignored ones (read-only git query)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def in_copy(rel: str) -> str:
    """Where a repository file lies in the copy: as installed, ``strategies/`` inside
    ``flwr_jdp/`` (``flwr_jdp.strategies``; ``[tool.setuptools.package-dir]``), so the
    copy's ``flwr_jdp`` imports its own strategies, not the repository's."""
    return f"flwr_jdp/{rel}" if rel.startswith("strategies/") else rel


def make_copy(files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / in_copy(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def apply(dest: Path, replacements: tuple[tuple[str, str, str], ...]) -> None:
    """Apply each ``(file, pattern, replacement)``: ``pattern`` is a regular expression
    (whitespace between tokens written ``\\s*``, so a re-wrapped line still matches)
    that must match exactly once."""
    for rel, pattern, new in replacements:
        path = dest / in_copy(rel)
        text, count = re.subn(pattern, lambda _m, new=new: new, path.read_text())
        if count != 1:
            raise RuntimeError(f"{rel}: mutant pattern found {count} times (expected exactly 1): {pattern}")
        path.write_text(text)


def env_for(copy: Path, out: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env["FLWR_HOME"] = str(home)
    env["FLWR_JDP_AUDIT_OUT"] = str(out)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def preflight(copy: Path, env: dict[str, str]) -> None:
    """Import the package in the copy as pytest will, and check every part comes from it."""
    code = ("import json, flwr_jdp, flwr_jdp.strategies.joint_dp.aggregation as j, apps.joint_dp.joint_dp.client_app as c, "
            "flwr_jdp.training.dp_sgd as d; print(json.dumps([flwr_jdp.__file__, j.__file__, c.__file__, d.__file__]))")
    got = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, check=True, capture_output=True,
                         text=True).stdout
    for f in json.loads(got.strip().splitlines()[-1]):
        if not Path(f).resolve().is_relative_to(copy.resolve()):
            raise RuntimeError(f"the copy imports {f}, outside {copy}")


def run(mutant: Mutant, files: list[str], keep: bool) -> Outcome:
    outcome = Outcome(mutant)
    tmp = Path(tempfile.mkdtemp(prefix="flwr-jdp-mutant-"))
    try:
        copy, out, home = tmp / "repo", tmp / "audit", tmp / "flwr-home"
        make_copy(files, copy)
        apply(copy, mutant.replacements)
        env = env_for(copy, out, home)
        preflight(copy, env)
        selection = [f"{TEST_FILE}::{t}" for t in mutant.tests]
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                              cwd=copy, env=env, capture_output=True, text=True)
        outcome.seconds = time.time() - t0
        outcome.pytest = "passed" if proc.returncode == 0 else "failed"
        for name in mutant.audits:
            path = out / f"{name}.json"
            if not path.is_file():
                outcome.note += f"{name}: no audit record; "
                continue
            record = json.loads(path.read_text())
            for mod, where in record.get("code", {}).items():
                if not Path(where).resolve().is_relative_to(copy.resolve()):
                    raise RuntimeError(f"{name}: {mod} was imported from {where}, not from the copy")
            outcome.audits[name] = record
        outcome.caught = (proc.returncode != 0 and len(outcome.audits) == len(mutant.audits)
                          and all(a["violates_claim"] for a in outcome.audits.values()))
        if proc.returncode not in (0, 1):
            outcome.note += f"pytest exit {proc.returncode}; "
        if not outcome.ok:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            outcome.note += f"pytest output (tail):\n{tail}"
    except Exception as err:  # noqa: BLE001 - reported as a row, the script fails
        outcome.pytest = "error"
        outcome.note += f"{type(err).__name__}: {err}"
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return outcome


def table(outcomes: list[Outcome]) -> str:
    head = (f"{'mutant':<19} {'expected':<8} {'pytest':<7} {'audit':<26} {'claim':>6} {'bound':>6} "
            f"{'trials':>6} {'s':>5}  result")
    lines = [head, "-" * len(head)]
    for o in outcomes:
        audits = o.audits or {name: None for name in o.mutant.audits}
        verdict = "ok" if o.ok else ("SURVIVED" if o.mutant.expected == "fail" else "CONTROL FAILED")
        for i, (name, rec) in enumerate(audits.items()):
            first = i == 0
            nums = (f"{rec['claimed_epsilon']:>6.3f} {rec['epsilon_lower_bound']:>6.3f} "
                    f"{rec['trials_per_side']:>6d} {rec['seconds']:>5.1f}") if rec else f"{'-':>6} {'-':>6} {'-':>6} {'-':>5}"
            lines.append(f"{o.mutant.name if first else '':<19} {o.mutant.expected if first else '':<8} "
                         f"{o.pytest if first else '':<7} {name:<26} {nums}  {verdict if first else ''}")
    lines.append("claim: the ledger's epsilon of the one release; bound: certified epsilon lower bound "
                 "(95 %); trials: a side; s: the audit's seconds")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=None, help="run these mutants (names) only")
    parser.add_argument("--out", default=str(ROOT / "results" / "audit" / "mutants.json"))
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the temporary copies are removed
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if not chosen:
        parser.error(f"no mutant named {args.only}; names: {[m.name for m in MUTANTS]}")
    files = repo_files()
    outcomes = []
    t0 = time.time()
    for mutant in chosen:
        print(f"[{mutant.name}] {mutant.description} ...", flush=True)
        o = run(mutant, files, args.keep)
        outcomes.append(o)
        bounds = ", ".join(f"{k} {v['epsilon_lower_bound']:.3f} (claim {v['claimed_epsilon']:.3f})"
                           for k, v in o.audits.items())
        print(f"    pytest {o.pytest} in {o.seconds:.0f}s: {bounds or '-'} -> {'ok' if o.ok else 'NOT OK'}",
              flush=True)
        if not o.ok and o.note:
            print("    " + o.note.replace("\n", "\n    "), flush=True)
    print()
    print(table(outcomes))
    failed = [o.mutant.name for o in outcomes if not o.ok]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip())
    doc = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "git_head": head, "working_tree_modified": dirty, "python": platform.python_version(),
        "test_file": TEST_FILE, "seconds": time.time() - t0, "all_ok": not failed, "not_ok": failed,
        "rows": [{"mutant": o.mutant.name, "description": o.mutant.description, "expected": o.mutant.expected,
                  "pytest": o.pytest, "caught_by_audit": o.caught, "ok": o.ok, "seconds": o.seconds,
                  "tests": list(o.mutant.tests),
                  "replacements": [{"file": f, "old": a, "new": b} for f, a, b in o.mutant.replacements],
                  "audits": {k: {key: v[key] for key in v if key != "code"} for k, v in o.audits.items()},
                  **({"note": o.note} if o.note and not o.ok else {})}
                 for o in outcomes],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {os.path.relpath(args.out, ROOT)}")
    if failed:
        print(f"NOT OK: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
