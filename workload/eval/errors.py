"""The evaluator's two kinds of failure, each one line: bad input (exit 2), a failed engine
(exit 1)."""

from __future__ import annotations


class EvalError(Exception):
    """A refusal the user can fix; printed as one line, exit status 2."""


class EngineError(Exception):
    """The serving engine failed (not the input); printed as one line, exit status 1."""
