"""Calibration's own failure: the measurement could not finish (a rank died, hung or failed).

A user's mistake is ``sim.errors.UserError`` (exit code 2); this is exit code 1."""


class CalibrationFailed(Exception):
    """The measurement could not finish; no profile was written (an existing one is untouched)."""
