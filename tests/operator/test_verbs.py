"""The verbs as `--help` lists them without importing them (commands.VERBS) agree with the verbs
themselves, and a command line imports only the verb it runs."""

from __future__ import annotations

import subprocess
import sys

from dflashops.commands import VERBS
from dflashops.verbs import load


def test_each_verbs_short_help_is_its_own():
    for name, verb in VERBS.items():
        command = load(name)
        own = " ".join((command.help or "").split("\n\n")[0].split())
        assert own == verb.help, name


def _verb_modules_imported(*argv: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflashops", *argv],
                          capture_output=True, text=True)  # fmt: skip
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    verbs = {f"dflashops.commands.{v.module}" for v in VERBS.values()}
    return names & verbs


def test_help_imports_no_verb_and_a_verb_only_its_own():
    assert _verb_modules_imported("--help") == set()
    assert _verb_modules_imported("exec", "--help") == {"dflashops.commands.exec_cmd"}
