"""The tuner's one error kind for bad input: every step (the options, the app lookup, the workload, the plan)
raises it, and only the command (tuning/search.py) prints it, so it lives below them all."""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix; printed without a traceback, exit code 2."""
