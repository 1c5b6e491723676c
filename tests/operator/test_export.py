"""`export RUN --step N --to DIR|TARGET:PATH` of the cached trained tiny drafter (a run on a
`local` target): the directory a server loads (the drafter's files without the optimizer state,
the chat template it was trained with, a model card), verified against a manifest of its own and
placed whole; exporting again is free; a directory that holds anything else is refused and left
as it was; and across two containers of the test bed, cut short and resumed. Serving the
export in vLLM is tests/operator/test_serve.py's."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.operator.ckpt_copies import BIG, SHARDS, big_checkpoint, stop_mid_transfer
from tests.operator.cli import dflashops, start
from tests.workload.conftest import FIXTURE_BUILDS, cached_tiny
from tests.workload.drafters import STEPS, trained_drafter

RUN = "ex"


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> dict:
    """A local target whose workspace holds run `ex` (the tiny build's run.yaml, the trained
    drafter as step STEPS) and a stored eval result of that step."""
    build = cached_tiny(FIXTURE_BUILDS["dense"])
    where = tmp_path_factory.mktemp("export")
    ws = where / "ws"
    run = ws / "runs" / RUN
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(build / "run.yaml", run / "run.yaml")
    shutil.copytree(trained_drafter(build) / "checkpoints" / f"step_{STEPS}",
                    run / "checkpoints" / f"step_{STEPS}")  # fmt: skip
    (run / "train_log.jsonl").write_text(json.dumps({"step": STEPS, "time": time.time()}) + "\n")
    state = {"status": "finished", "exit_code": 0, "started": time.time() - 60,
             "finished": time.time(), "last_step": STEPS, "pid": 999999}  # fmt: skip
    (run / "state.json").write_text(json.dumps(state))
    result = {"tau": 2.875, "n_prompts": 8, "max_new_tokens": 96, "speedup": 1.42,
              "engine": {"name": "vllm", "version": "0.32.0"},
              "prompt_set": {"name": "gsm8k", "kind": "gsm8k"}}  # fmt: skip
    (ws / "evals" / RUN).mkdir(parents=True)
    (ws / "evals" / RUN / f"step_{STEPS}.json").write_text(json.dumps(result))
    inv = where / "hosts.yaml"
    local = {"kind": "local", "workspace": str(ws), "python": sys.executable}
    inv.write_text("version: 1\ntargets:\n  local: " + json.dumps(local) + "\n")
    return {"ws": ws, "inv": inv, "home": where, "build": build, "run": run}


def cli(bed: dict, *args: str):
    return dflashops(*args, inventory=bed["inv"], home=bed["home"])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_export_is_what_a_server_loads_and_it_verifies(bed):
    out = bed["home"] / "drafters" / "ex-200"
    ran = cli(bed, "export", RUN, "--step", str(STEPS), "--to", str(out))
    assert ran.code == 0, ran.err
    assert f"exported to {out}" in ran.out and "README.md" in ran.out
    ckpt = bed["run"] / "checkpoints" / f"step_{STEPS}"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["MANIFEST.sha256", "README.md", "chat_template.jinja", "config.json",
                     "dflash.py", "model.safetensors"]  # fmt: skip
    for name in ("config.json", "model.safetensors", "dflash.py"):
        assert sha256(out / name) == sha256(ckpt / name)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 8
    template = (bed["build"] / "target" / "chat_template.jinja").read_text()
    assert (out / "chat_template.jinja").read_text() == template
    listed = dict(
        line.split("  ")[::-1] for line in (out / "MANIFEST.sha256").read_text().splitlines()
    )
    assert listed == {n: sha256(out / n) for n in names if n != "MANIFEST.sha256"}
    assert not list(out.parent.glob(".partial-*"))  # placed whole, nothing left beside it
    again = cli(bed, "export", RUN, "--step", str(STEPS), "--to", str(out))
    assert again.code == 0 and "already exported" in again.out, again.err


def test_the_card_states_the_settings_the_measures_and_the_serving_lines(bed):
    out = bed["home"] / "card"
    assert cli(bed, "export", RUN, "--step", str(STEPS), "--to", str(out)).code == 0
    card = (out / "README.md").read_text()
    target = str(bed["build"] / "target")
    assert f"`{target}`" in card
    assert "block size | 8" in card and "mask token id | 3" in card
    assert "| local (eval) | gsm8k (8) | vllm | 2.88 | 1.42 |" in card  # the stored result
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": 7}
    assert f"vllm serve {target} \\\n  --speculative-config '{json.dumps(spec)}'" in card
    assert f"--chat-template {out}/chat_template.jinja" in card
    assert "--speculative-algorithm DFLASH" in card
    assert f"--speculative-draft-model-path {out}" in card
    assert "--speculative-num-draft-tokens 8" in card


def test_into_a_target_and_refusals(bed):
    ran = cli(bed, "--json", "export", RUN, "--step", str(STEPS), "--to", "local:exports/ex")
    assert ran.code == 0, ran.err
    done = json.loads(ran.out)
    assert done["to"] == "local" and done["dest"] == str(bed["ws"] / "exports" / "ex")
    assert (bed["ws"] / "exports" / "ex" / "MANIFEST.sha256").is_file()
    taken = bed["home"] / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    ran = cli(bed, "export", RUN, "--step", str(STEPS), "--to", str(taken))
    assert ran.code == 2 and "exists and is not this export" in ran.err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    ran = cli(bed, "export", RUN, "--step", str(STEPS), "--to", "ct9:x")
    assert ran.code == 2 and "no target 'ct9'" in ran.err and str(bed["inv"]) in ran.err
    ran = cli(bed, "export", RUN, "--step", "7", "--to", str(bed["home"] / "x"))
    assert ran.code == 4 and f"complete steps: {STEPS}" in ran.err
    assert not (bed["home"] / "x").exists()


@pytest.mark.testbed
def test_from_one_container_into_another_cut_short_and_resumed(testbed, make_container, tmp_path):
    """On the fake Proxmox bed (real sshd, pct, ns containers): the export of a run on a pve1
    container into a pve2 container, stopped with Ctrl-C once the small files verified there,
    then run again: only what had not verified is sent, and the export is placed whole."""
    src, dst = make_container("pve1"), make_container("pve2")
    inv = testbed.write_inventory(tmp_path / "pair.yaml", {"src": src, "dst": dst})
    home = tmp_path / "home"
    home.mkdir()
    source = big_checkpoint(src, run=RUN, step=4)
    (source.parent.parent / "run.yaml").write_text(
        "target: {path: /workspace/hf/t}\ndrafter: {block_size: 16}\n"
        "data: {path: /workspace/data/d, chat_template: '{{ messages }}'}\n"
    )
    exports = dst.host_path("/workspace/exports")
    dst.host.set_faults(slow_exec_stdin_after=12 << 20)  # the big file takes 12 s or more
    try:
        proc = start("export", RUN, "--step", "4", "--to", "dst:exports/ex", inventory=inv,
                     home=home)  # fmt: skip
        code, err, _ = stop_mid_transfer(proc, exports / ".partial-ex", lambda: proc.send_signal(2))
    finally:
        dst.host.set_faults()
    assert code == 130 and "Traceback" not in err, err
    assert not (exports / "ex").exists()  # nothing that looks complete
    again = dflashops("--json", "export", RUN, "--step", "4", "--to", "dst:exports/ex",
                      inventory=inv, home=home)  # fmt: skip
    assert again.code == 0, again.err
    done = json.loads(again.out)
    assert done["copied"] and done["kept_files"] == 3  # config.json and the two shards
    out = exports / "ex"
    for name in ("config.json", BIG, *SHARDS):
        assert sha256(out / name) == sha256(source / name)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert "--speculative-num-draft-tokens 16" in (out / "README.md").read_text()
    assert sorted(p.name for p in exports.iterdir()) == ["ex"]
