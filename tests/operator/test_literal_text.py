"""Text is text: remote text with Rich markup in it ([/], [bold], [link=x], :smile:) is printed
exactly as it is, by the real command line over the local target."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.operator.cli import dflashops

HOSTILE = "[/] [bold]loud [link=x]click :smile: [red]x[/]"


@pytest.fixture
def inv(tmp_path) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {tmp_path / 'ws'}, python: python3}}\n"
    )
    return path


def make_run(ws: Path, name: str, config: str) -> None:
    run = ws / "runs" / name
    run.mkdir(parents=True)
    now = time.time()
    (run / "train_log.jsonl").write_text(json.dumps({"step": 10, "time": now, "loss": 1.0}) + "\n")
    state = {"status": "finished", "exit_code": 0, "started": now - 60, "finished": now,
             "wandb_url": HOSTILE}  # fmt: skip
    (run / "state.json").write_text(json.dumps(state))
    (run / "run.yaml").write_text(config)
    (run / "console.log").write_text(f"step 10/10 {HOSTILE}\n")


def test_status_diff_and_logs_print_markup_literally(tmp_path, inv):
    ws = tmp_path / "ws"
    make_run(ws, "r1", f"note: {json.dumps(HOSTILE)}\n")
    make_run(ws, "r2", "note: plain\n")
    for args in (("status", "r1"), ("diff", "r1", "r2"), ("logs", "r1")):
        ran = dflashops(*args, inventory=inv, home=tmp_path)
        assert ran.code == 0, (args, ran.err)
        assert HOSTILE in ran.out, (args, ran.out)
