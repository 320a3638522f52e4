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
