"""Calibration uses the ledger's own accountant under replace-one: with RDP and
unsampled Gaussian releases (DP-MTL's noisy means) the calibrated noise keeps the
RDP ledger within the target instead of calibrating with PLD and overrunning it."""

import dp_accounting as dpa

from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.calibration import calibrate


def test_rdp_replace_one_calibration_matches_the_rdp_ledger():
    def run(z):
        return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 6)

    z = calibrate(3.0, 1e-5, run, "rdp", relation="replace-one")
    spent = epsilon(run(z), 1e-5, "rdp", "replace-one")
    assert 0.95 * 3.0 <= spent <= 3.0
