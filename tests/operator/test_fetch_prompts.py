"""`fetch-prompts TARGET SET...` against the stand-in hub on a loopback port (serving the GSM8K
test file as a dataset repository: the real hub is not reached from the tests): the split's
file lands under <workspace>/prompts/gsm8k/, checked against the hub's hashes, the evaluator
reads it as GSM8K, and a second fetch sends nothing again; an unknown set is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.operator.cli import dflashops
from tests.operator.hub_standin import Hub
from workload.eval.prompts import read_prompt_set

QUESTIONS = [{"question": f"Tom has {n} apples and eats 2. How many are left?", "answer": "#### 1"}
             for n in (3, 5, 8)]  # fmt: skip
FILE = "main/test-00000-of-00001.jsonl"  # the hub ships parquet; the pattern takes any name
REPO = "openai/gsm8k"


@pytest.fixture
def hub():
    data = "".join(json.dumps(q) + "\n" for q in QUESTIONS).encode()
    files = {FILE: data, "main/train-00000-of-00001.jsonl": data * 2, "README.md": b"gsm8k\n"}
    made = Hub("org/unused", {"README.md": b"a model\n"}, set(), token="hf_standin")
    made.publish(REPO, files, {FILE}, "e" * 40, kind="dataset")
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


def fetch(inventory: Path, *args: str):
    return dflashops("fetch-prompts", "here", *args, "--secret", "DFO_HUB_TOKEN",
                     inventory=inventory, env={"DFO_HUB_TOKEN": "hf_standin"}, timeout=300)  # fmt: skip


def test_a_benchmark_set_is_fetched_verified_and_read_by_the_evaluator(hub, inventory, tmp_path):
    ran = fetch(inventory, "gsm8k")
    assert ran.code == 0, ran.err
    got = tmp_path / "ws" / "prompts" / "gsm8k" / FILE
    assert f"eval --prompts {got}" in ran.out and "verified" in ran.out
    assert not (got.parent / "train-00000-of-00001.jsonl").exists()  # the test split only
    read = read_prompt_set(got)
    assert read.kind == "gsm8k" and len(read.items) == len(QUESTIONS)
    sent = len(hub.ranges)
    again = fetch(inventory, "gsm8k")
    assert again.code == 0 and len(hub.ranges) == sent, again.err  # nothing downloaded twice


def test_a_spoiled_file_and_an_unknown_set_are_one_line(hub, inventory):
    repo = hub.repos[REPO]
    repo.served[FILE] = repo.files[FILE].replace(b"Tom", b"Tim")
    ran = fetch(inventory, "gsm8k")
    assert ran.code == 1 and "do not match the hub's hashes: " + FILE in ran.err, ran.err
    ran = fetch(inventory, "gsm9k")
    assert ran.code == 2 and "no prompt set 'gsm9k'" in ran.err and "math500" in ran.err
