"""Diagnostics: the flight record of a fit, why a step was skipped, the precision report, plots, and the doctor's checks."""
