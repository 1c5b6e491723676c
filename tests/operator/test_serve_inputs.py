"""`eval --serve`'s refusals, before anything connects or starts: one line each, exit 2."""

from __future__ import annotations

import sys

import pytest

from tests.operator.cli import dflashops


@pytest.fixture
def inv(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {tmp_path / 'ws'}, python: {sys.executable}}}\n"
    )
    return path


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--steps", "2,4", "--serve"], "--serve: one checkpoint at a time; give --step N"),
        (["--step", "2", "--concurrency", "4"], "--concurrency: only with --serve"),
        (["--step", "2", "--vs", "r:2"], "--vs: only with --serve"),
        (["--step", "2", "--serve", "--concurrency", "0,4"], "--concurrency 0,4: expected"),
        (["--step", "2", "--serve", "--concurrency", "a"], "--concurrency a: expected"),
        (["--step", "2", "--serve", "--vs", "other"], "--vs other: expected RUN:STEP"),
        (["--step", "2", "--serve", "--reference", "/x"], "--serve: --reference belong"),
        (["--step", "2", "--serve", "--engine", "sim"], "--serve: --engine sim belong"),
    ],
)
def test_bad_serve_options_are_one_line(inv, tmp_path, args, said):
    ran = dflashops("eval", "sv", "--on", "local", *args, inventory=inv, home=tmp_path)
    assert ran.code == 2, ran.err
    assert said in ran.err
    assert "Traceback" not in ran.err and len(ran.err.strip().splitlines()) == 1
