"""Sweeps (`launch NAME --sweep KEY=A,B [--sweep KEY2=...]`): one run per combination of the
swept values, named NAME-<key><value>... from the last part of each key and its value (e.g.
`--sweep optim.lr=3e-4,1e-3` -> NAME-lr3e-4, NAME-lr1e-3), each recording the sweep in its
state.json ("sweep": its name, keys and values) so that `status`, `compare`, `diff` and `evals`
find a sweep's runs by its name."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from dflashops.errors import UsageError
from dflashops.runs.reading.view import check_name

STATE_KEY = "sweep"  # state.json: {"name": NAME, "keys": [KEY...], "values": {KEY: VALUE}}
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
UNNAMEABLE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Member:
    """One run of a sweep: its name and the --set overrides that make it."""

    run: str
    values: dict[str, str]

    @property
    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values.items()]

    def state(self, sweep: str) -> dict[str, Any]:
        return {STATE_KEY: {"name": sweep, "keys": list(self.values), "values": self.values}}


def axes(items: list[str]) -> dict[str, list[str]]:
    """--sweep KEY=A,B[,...] (repeated, one key each): the values of each key, in order."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, eq, text = item.partition("=")
        values = [v.strip() for v in text.split(",")]
        if not eq or not KEY_RE.match(key) or not all(values):
            raise UsageError(
                f"--sweep {item}: expected KEY=A,B[,...], a dotted config key and its values, "
                "e.g. --sweep optim.lr=3e-4,1e-3"
            )
        if key in out:
            raise UsageError(f"--sweep {key}: given twice; list all its values in one --sweep")
        if len(set(values)) != len(values):
            raise UsageError(f"--sweep {item}: a value is given twice")
        out[key] = values
    return out


def members(name: str, swept: dict[str, list[str]]) -> list[Member]:
    """Every combination, the first key's values outermost; its run names must be distinct
    and valid run names."""
    keys = list(swept)
    out = []
    for combo in itertools.product(*(swept[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        out.append(Member(run_name(name, values), values))
    names = [m.run for m in out]
    if len(set(names)) != len(names):
        raise UsageError(
            f"--sweep: two runs of sweep {name!r} would get one name ({', '.join(names)}); "
            "sweep keys whose last parts differ, or values that differ in letters or digits"
        )
    return out


def run_name(name: str, values: dict[str, str]) -> str:
    parts = [
        f"{key.rsplit('.', 1)[-1]}{UNNAMEABLE.sub('_', value)}" for key, value in values.items()
    ]
    run = "-".join([name, *parts])
    try:
        return check_name(run)
    except UsageError:
        raise UsageError(
            f"--sweep: run name {run!r} (the sweep's name and its values) is not a run name: "
            "1-64 letters, digits, '.', '_' or '-'; choose a shorter NAME"
        ) from None


def record(state: dict[str, Any]) -> dict[str, Any]:
    """The sweep a run's state.json records ({} for a run of no sweep)."""
    return state.get(STATE_KEY) or {}


def swept_keys(runs_state: list[dict[str, Any]]) -> list[str]:
    """The swept keys of the runs' state.json (in the sweep's order), for `diff`."""
    keys: list[str] = []
    for state in runs_state:
        for key in record(state).get("keys") or []:
            if key not in keys:
                keys.append(key)
    return keys
