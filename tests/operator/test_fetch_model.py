"""`fetch-model` against a stand-in for the hub on a loopback port (tests/operator/hub_standin.py;
HF_ENDPOINT in the target's environment points huggingface_hub at it): the token travels on
stdin only, a fetch cut short goes on with the files that had not arrived, every file is checked against
the hashes the hub lists, and a second fetch sends nothing again."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.operator.cli import dflashops
from tests.operator.hub_standin import COMMIT, Hub

REPO = "org/tiny-model"
TOKEN = "hf_standin_secret_token"
WEIGHTS = os.urandom(3 << 20)
SHARD = os.urandom(1 << 20)


@pytest.fixture
def hub():
    files = {"config.json": b'{"model_type": "tiny"}\n', "model.safetensors": WEIGHTS,
             "shard.safetensors": SHARD}  # fmt: skip
    made = Hub(REPO, files, lfs={"model.safetensors", "shard.safetensors"}, token=TOKEN)
    yield made
    made.close()


@pytest.fixture
def inventory(tmp_path: Path, hub: Hub) -> Path:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # fmt: skip
    here = {"kind": "local", "workspace": str(tmp_path / "ws"), "python": sys.executable,
            "env": env}  # fmt: skip
    path = tmp_path / "hosts.yaml"
    path.write_text("version: 1\ntargets:\n  here: " + json.dumps(here) + "\n")
    return path


def fetch(inventory: Path, *first: str):
    return dflashops(*first, "fetch-model", "here", REPO, "--secret", "DFO_HUB_TOKEN",
                     inventory=inventory, env={"DFO_HUB_TOKEN": TOKEN}, timeout=300)  # fmt: skip


def test_a_model_is_fetched_resumed_and_verified(hub, inventory, tmp_path):
    hub.stall_once.add("model.safetensors")
    stalled = fetch(inventory, "--timeout", "3")
    assert stalled.code == 3, stalled.err  # the hub went silent halfway: our deadline
    hub.release.set()
    ran = fetch(inventory)
    assert ran.code == 0, ran.err
    dest = tmp_path / "ws" / "hf" / "tiny-model"
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert f"here: {REPO} at {dest}: 3 files, 4.0 MiB, commit {COMMIT[:12]}, verified" in ran.out
    # huggingface_hub 2.x resumes by file (each in a process-unique .incomplete): the shard
    # that had arrived is not fetched again, the file cut halfway is
    gets = [name for name, _ in hub.ranges]
    assert gets.count("shard.safetensors") == 1 and gets.count("model.safetensors") == 2, gets
    assert TOKEN not in ran.out + ran.err
    assert f"Bearer {TOKEN}" in hub.auth and set(hub.auth) <= {f"Bearer {TOKEN}", None}
    sent = len(hub.ranges)
    again = fetch(inventory)
    assert again.code == 0, again.err
    assert len(hub.ranges) == sent  # nothing downloaded twice


def test_a_file_that_does_not_match_the_hubs_hash_is_named(hub, inventory):
    hub.served["model.safetensors"] = WEIGHTS[:-1] + bytes([WEIGHTS[-1] ^ 1])
    ran = fetch(inventory)
    assert ran.code == 1, ran.err
    assert ran.err.strip().splitlines()[-1] == (
        f"dflashops: error: here: {REPO}: do not match the hub's hashes: model.safetensors; "
        "run fetch-model again"
    )


def test_without_the_token_the_hub_refuses_in_one_line(hub, inventory):
    ran = dflashops("fetch-model", "here", REPO, inventory=inventory, timeout=120)
    assert ran.code == 3, ran.err
    assert ran.err.strip().splitlines()[-1].startswith(f"dflashops: error: here: {REPO}: ")
    assert "Traceback" not in ran.err
