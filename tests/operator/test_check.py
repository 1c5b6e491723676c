"""`dflashops check`: train-to-serve parity of a run on the `local` target (and on a second
local target as the eval target: the facts gathered where the run trained, compared where it
will serve), through the real command line, with the tiny target and a chat template that
behaves like Qwen3.5/3.6's (workload/eval/parity.py's own tests cover each setting)."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import yaml

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run
from tests.operator.tiny_target import tiny_build
from tests.workload.test_parity import THINKING, write_checkpoint_config


@pytest.fixture
def bed(tmp_path):
    ws, evals = tmp_path / "ws", tmp_path / "evalws"
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {sys.executable}}}\n"
        f"  evalbox: {{kind: local, workspace: {evals}, python: {sys.executable}}}\n"
    )
    run = make_run(ws, "v1", ckpts=(10,))
    cfg = yaml.safe_load((tiny_build() / "run.yaml").read_text())
    cfg["target"]["path"] = str(tiny_build() / "target")
    (run / "thinking.jinja").write_text(THINKING)
    cfg["data"]["chat_template"] = "thinking.jinja"
    cfg["data"]["chat_template_kwargs"] = {"enable_thinking": False}
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    write_checkpoint(run, cfg["drafter"])

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=inventory, home=tmp_path)

    return run, cli


def write_checkpoint(run, drafter: dict, target_layers: int = 6) -> None:
    ckpt = run / "checkpoints" / "step_10"
    write_checkpoint_config(ckpt, drafter)
    doc = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**doc, "num_target_layers": target_layers}))
    names = ("config.json", "model.safetensors")
    (ckpt / "MANIFEST.sha256").write_text("".join(
        f"{hashlib.sha256((ckpt / n).read_bytes()).hexdigest()}  {n}\n" for n in names))  # fmt: skip


def test_a_thinking_off_run_passes_when_served_as_it_trained_and_fails_otherwise(bed):
    """The run trains with thinking off: served in the engine's words with the same template
    and {"enable_thinking": false} it passes; served with the template's default (thinking
    on) the line names enable_thinking on both sides."""
    run, cli = bed
    template = str(run / "thinking.jinja")
    off = '{"enable_thinking": false}'
    ran = cli("check", "v1", "--serve-chat-template", template, "--serve-chat-template-kwargs", off)
    assert ran.code == 0, ran.err + ran.out
    assert "v1 step 10: training (local) and serving (local) agree" in ran.out
    assert "assumed: num_speculative_tokens not given: compared as 7 (block 8 - 1" in ran.err
    ran = cli("check", "v1", "--serve-chat-template", template)
    assert ran.code == 2, ran.err
    (line,) = ran.out.splitlines()
    assert line.startswith('v1 step 10: chat template kwargs: training renders with '
                           '{"enable_thinking": false} (run config ')  # fmt: skip
    assert "serving with {} (enable_thinking not given: the template's default) " in line
    assert f"(--serve-chat-template {template} (the rest the engine's default))" in line
    assert "assumed: --serve-chat-template-kwargs not given: compared as {}" in ran.err


def test_a_run_trained_on_the_defaults_fails_against_thinking_off_serving(bed):
    run, cli = bed
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    del cfg["data"]["chat_template_kwargs"]
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    ran = cli("check", "v1", "--serve-chat-template", str(run / "thinking.jinja"),
              "--serve-chat-template-kwargs", '{"enable_thinking": false}')  # fmt: skip
    assert ran.code == 2, ran.err
    (line,) = ran.out.splitlines()
    assert line.startswith("v1 step 10: chat template kwargs: training renders with {} "
                           "(enable_thinking not given: the template's default) (run config")  # fmt: skip
    assert 'serving with {"enable_thinking": false} (--serve-chat-template ' in line


def test_a_drafter_made_for_another_layer_count_is_named(bed):
    run, cli = bed
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    write_checkpoint(run, cfg["drafter"], target_layers=4)
    ran = cli("--json", "check", "v1", "--serve-chat-template", str(run / "thinking.jinja"),
              "--serve-chat-template-kwargs", '{"enable_thinking": false}')  # fmt: skip
    assert ran.code == 2, ran.err
    (m,) = json.loads(ran.out)["mismatches"]
    assert m["key"] == "num_target_layers"
    assert m["line"].startswith("num_target_layers: the drafter was made for a 4-layer target")
    assert m["line"].endswith("has 6 layers")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--serve-chat-template-kwargs", "{bad"],
         "dflashops: error: --serve-chat-template-kwargs {bad: not JSON ("),
        (["--serve-chat-template-kwargs", "[1]"],
         "dflashops: error: --serve-chat-template-kwargs [1]: a JSON object, e.g."),
        (["--serve-chat-template", "nope.jinja"],
         "dflashops: error: --serve-chat-template nope.jinja: no such file here"),
        (["--serve-chat-template", "/nonexistent/t.jinja"],
         "dflashops: error: local: --serve-chat-template /nonexistent/t.jinja: no such file"),
    ],
)  # fmt: skip
def test_bad_serving_settings_are_one_line_exit_2(bed, args, said):
    _, cli = bed
    ran = cli("check", "v1", *args)
    assert ran.code == 2 and ran.out == ""
    errors = [x for x in ran.err.splitlines() if "error" in x or "Traceback" in x]
    assert len(errors) == 1 and errors[0].startswith(said), ran.err


def test_serving_with_the_engines_defaults_is_named_then_a_consistent_run_passes(bed):
    run, cli = bed
    ran = cli("check", "v1")
    assert ran.code == 2, ran.err
    lines = ran.out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("v1 step 10: chat template: training renders")
    assert "serving with {}" in lines[0] and "--default-chat-template-kwargs" in lines[0]
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    del cfg["data"]["chat_template"], cfg["data"]["chat_template_kwargs"]
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    ran = cli("check", "v1")
    assert ran.code == 0, ran.err + ran.out
    assert "v1 step 10: training (local) and serving (local) agree" in ran.out


def test_on_an_eval_target_the_facts_of_both_sides_meet(bed):
    """The template file is read here and compared there (as text with the facts)."""
    run, cli = bed
    ran = cli("--json", "check", "v1", "--on", "evalbox", "--num-speculative-tokens", "15",
              "--serve-chat-template", str(run / "thinking.jinja"),
              "--serve-chat-template-kwargs", '{"enable_thinking": false}')  # fmt: skip
    assert ran.code == 2, ran.err
    doc = json.loads(ran.out)
    assert (doc["target"], doc["on"], doc["step"]) == ("local", "evalbox", 10)
    keys = [m["key"] for m in doc["mismatches"]]
    assert keys == ["block_size"]
    assert doc["facts"]["serving"]["chat_template_file"] == str(run / "thinking.jinja")
    assert doc["facts"]["checkpoint"]["block_size"] == 8  # gathered on local, compared on evalbox


def test_a_step_the_run_does_not_have_is_not_found(bed):
    _, cli = bed
    ran = cli("check", "v1", "--step", "99")
    assert ran.code == 4 and "no complete checkpoint at step 99" in ran.err and "10" in ran.err
    assert cli("check", "nope").code == 4


def test_a_launch_on_data_made_with_other_chat_settings_is_refused_before_it_starts(bed, tmp_path):
    """The dataset was generated with the template's default (thinking on); the run trains
    (and would evaluate) with thinking off: refused, nothing left, unless --force."""
    run, cli = bed
    data = tmp_path / "made"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"chat_template_kwargs": {}}))
    cfg = yaml.safe_load((run / "run.yaml").read_text())
    cfg["data"]["path"] = str(data)
    cfg["data"]["chat_template"] = str(run / "thinking.jinja")
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(cfg))
    ran = cli("launch", "p1", "--host", "local", "--config", str(config))
    assert ran.code == 2, ran.err
    said = [x for x in ran.err.splitlines() if x.startswith("dflashops: error: ")]
    assert said[0].startswith("dflashops: error: p1: parity: chat template kwargs: data renders")
    assert said[-1] == "dflashops: error: p1: fix the config, or pass --force"
    assert not (run.parent / "p1").exists()


def test_setup_installs_no_gpu_extras_where_the_container_sees_no_gpu(tmp_path):
    """hosts.yaml gives the target GPUs, the container shows none: the extras (triton with
    them) would break CPU runs, so setup says why it leaves them out."""
    ws = tmp_path / "ws"
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("version: 1\ntargets:\n"
                         f"  box: {{kind: local, workspace: {ws}, python: {sys.executable}, "
                         "gpus: 1}\n")  # fmt: skip
    empty = tmp_path / "none.txt"
    empty.write_text("# nothing to install\n")
    ran = dflashops("setup", "box", "--requirements", str(empty), inventory=inventory,
                    home=tmp_path)  # fmt: skip
    assert ran.code == 0, ran.err
    assert "box: GPU extras not installed: no GPU visible in the container" in ran.err
    assert not (ws / "dflashops" / "requirements-gpu.txt").exists()
