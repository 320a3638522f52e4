import subprocess
import sys

import pytest

from flwr_jdp.cli import main


def last_line(capsys) -> float:
    out = capsys.readouterr().out.strip().splitlines()
    return float(out[-1])


def test_epsilon_rdp_reference(capsys):
    assert main(["epsilon", "--noise-multiplier", "1.5", "--sample-rate", "0.04", "--steps", "2250",
                 "--delta", "1e-5", "--accountant", "rdp"]) == 0
    assert last_line(capsys) == pytest.approx(7.32911, abs=1e-5)


def test_calibrate_then_epsilon_meets_target(capsys):
    main(["calibrate", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "1000"])
    z = last_line(capsys)
    main(["epsilon", "--noise-multiplier", str(z), "--sample-rate", "0.01", "--steps", "1000",
          "--delta", "1e-5"])
    eps = last_line(capsys)
    assert 0.99 * 3 <= eps <= 3


def test_console_script_rejects_bad_delta():
    proc = subprocess.run([sys.executable, "-m", "flwr_jdp.cli", "epsilon", "--noise-multiplier", "1",
                           "--sample-rate", "0.1", "--steps", "10", "--delta", "2"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--delta" in proc.stderr and "(0, 1)" in proc.stderr


def test_unreachable_target_is_one_line_and_exit_code_2(capsys):
    assert main(["calibrate", "--epsilon", "0.001", "--sample-rate", "1", "--steps", "100000",
                 "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unreachable" in err and "--epsilon" in err


def test_large_target_is_calibrated_on_a_proportional_grid_within_the_target(capsys):
    """epsilon 1000 over 10 sampled steps: small noise multipliers, whose PLD on the
    ledger's fine grid took minutes; the answer is checked against the epsilon of
    the ledger's own (finer, hence tighter) grid."""
    from flwr_jdp.privacy import events as ev
    from flwr_jdp.privacy.accountants import epsilon
    from flwr_jdp.privacy.calibration import pld_grid

    assert pld_grid(8.0) == 1e-4 and pld_grid(1000.0) == pytest.approx(0.1)
    assert main(["calibrate", "--epsilon", "1000", "--sample-rate", "0.1", "--steps", "10",
                 "--delta", "1e-5"]) == 0
    z = last_line(capsys)
    assert epsilon(ev.dp_sgd(z, 0.1, 10), 1e-5, "pld", discretization=pld_grid(1000.0)) <= 1000
    assert epsilon(ev.dp_sgd(z, 0.1, 10), 1e-5, "pld", discretization=pld_grid(1000.0) / 10) <= 1000


def test_every_cli_option_has_help_text():
    import argparse

    from flwr_jdp.cli import build_parser

    def parsers(p):
        yield p
        for action in p._actions:  # noqa: SLF001 - argparse keeps its subparsers here
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                for sub in action.choices.values():
                    yield from parsers(sub)

    missing = [f"{p.prog} {a.option_strings[0]}" for p in parsers(build_parser()) for a in p._actions  # noqa: SLF001
               if a.option_strings and a.help in (None, "") and a.option_strings[0] != "-h"]
    assert missing == []
