"""The trainer's side of `watch`'s W&B alert: requests in <run dir>/alerts/ sent once each
with `wandb.run.alert` at a log step and renamed ID.sent, never again on a resume; nothing sent
without W&B. W&B runs offline (the hub cannot be reached here): what it would send is read back
from the run's offline transaction log (tests/wandb_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.wandb_files import alerts
from tests.workload.test_train import config, group  # noqa: F401 (a fixture)
from workload.train import loop as T


def ask(run_dir: Path, name: str, text: str) -> None:
    (run_dir / "alerts").mkdir(parents=True, exist_ok=True)
    (run_dir / "alerts" / name).write_text(text)


@pytest.mark.slow
def test_each_request_is_sent_once_a_resume_included(tiny_dense, tmp_path, group, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    ask(run_dir, "stall-acc-step2.json", json.dumps({"title": "stall acc step 2: run",
                                                     "text": "acc has not risen", "level": "ERROR"}))  # fmt: skip
    ask(run_dir, "broken.json", "{not json")
    wb = ("log.wandb.project=dflash-tests", "log.wandb.mode=offline")
    assert T.train(config(tiny_dense, "optim.max_steps=2", *wb), run_dir) == 0
    names = sorted(p.name for p in (run_dir / "alerts").iterdir())
    assert names == ["broken.json", "stall-acc-step2.sent"]  # a file not ours is left alone
    (sent,) = alerts(run_dir)
    assert (sent["title"], sent["text"], sent["level"]) == ("stall acc step 2: run",
                                                            "acc has not risen", "ERROR")  # fmt: skip
    assert T.train(config(tiny_dense, "optim.max_steps=4", *wb), run_dir, resume=True) == 0
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2
    assert [a["title"] for a in alerts(run_dir)] == ["stall acc step 2: run"]


@pytest.mark.slow
def test_without_wandb_a_request_stays_unsent(tiny_dense, tmp_path, group):  # noqa: F811
    run_dir = tmp_path / "run"
    ask(run_dir, "a.json", json.dumps({"title": "t", "text": "x", "level": "WARN"}))
    assert T.train(config(tiny_dense, "optim.max_steps=2"), run_dir) == 0
    assert sorted(p.name for p in (run_dir / "alerts").iterdir()) == ["a.json"]
    assert not (run_dir / "wandb").exists()
