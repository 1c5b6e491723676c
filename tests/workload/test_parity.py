"""Train-to-serve parity (workload/eval/parity.py) on the tiny target with a chat template that
behaves like Qwen3.5/3.6's (thinking on by default, an empty think block when it is off,
reasoning dropped from earlier turns): a consistent run passes; each setting a user gets
wrong is named with both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from workload.eval import parity

# Our own template with the semantics of chat-templates.md (not Qwen's text)
THINKING = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}"
)


@pytest.fixture
def run(tiny_dense: Path, tmp_path: Path) -> dict[str, Path]:
    """A run config trained with thinking off under THINKING, and its checkpoint's config."""
    (tmp_path / "thinking.jinja").write_text(THINKING)
    cfg = yaml.safe_load((tiny_dense / "run.yaml").read_text())
    cfg["data"]["chat_template"] = "thinking.jinja"
    cfg["data"]["chat_template_kwargs"] = {"enable_thinking": False}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    ckpt = tmp_path / "step_10"
    ckpt.mkdir()
    write_checkpoint_config(ckpt, cfg["drafter"])
    return {"config": tmp_path / "run.yaml", "checkpoint": ckpt}


def write_checkpoint_config(ckpt: Path, drafter: dict, **changes) -> None:
    dflash = {"block_size": drafter["block_size"], "mask_token_id": drafter["mask_token_id"],
              "target_layer_ids": drafter["target_layer_ids"], **changes}  # fmt: skip
    doc = {"block_size": dflash["block_size"], "dflash_config": dflash, "dtype": "float32",
           "num_target_layers": 6, "layer_types": ["full_attention", "full_attention"]}  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(doc))


def check(run: dict[str, Path], *extra: str, capsys=None) -> tuple[int, list[str]]:
    argv = ["--config", str(run["config"]), "--checkpoint", str(run["checkpoint"]), "--json"]
    code = parity.main([*argv, *extra])
    doc = json.loads(capsys.readouterr().out)
    return code, [m["line"] for m in doc["mismatches"]]


def test_a_consistent_run_passes(run, capsys):
    code, lines = check(run, "--eval-kwargs", '{"enable_thinking": false}',
                        "--num-speculative-tokens", "7", capsys=capsys)  # fmt: skip
    assert (code, lines) == (0, [])


def test_an_eval_that_thinks_where_training_did_not_is_named_with_both_sides(run, capsys):
    code, lines = check(run, "--eval-kwargs", '{"enable_thinking": true}', capsys=capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("chat template kwargs: training renders with "
                               '{"enable_thinking": false}')  # fmt: skip
    assert 'eval with {"enable_thinking": true}' in lines[0]
    assert "</think>" in lines[0]  # the two serving prompts' ends, shown


def test_empty_kwargs_agree_with_the_templates_default(tiny_dense, run, capsys):
    cfg = yaml.safe_load(run["config"].read_text())
    cfg["data"]["chat_template_kwargs"] = {}
    run["config"].write_text(yaml.safe_dump(cfg))
    code, lines = check(run, "--eval-kwargs", '{"enable_thinking": true}', capsys=capsys)
    assert (code, lines) == (0, [])


def test_the_engines_defaults_are_compared_when_asked(run, capsys):
    code, lines = check(run, "--serving-defaults", capsys=capsys)
    assert code == 2 and len(lines) == 1
    assert "serving with {}" in lines[0] and "--default-chat-template-kwargs" in lines[0]
    assert "chat template:" in lines[0]  # the engine serves the tokenizer's own template


def test_a_block_size_the_engine_does_not_serve_is_named(run, capsys):
    code, lines = check(run, "--num-speculative-tokens", "15", capsys=capsys)
    assert code == 2
    assert lines == [
        f"block size: the drafter drafts blocks of 8 (checkpoint {run['checkpoint']}/config.json), "
        "the engine is asked for num_speculative_tokens 15 (a block of 8 serves 7)"
    ]


def test_a_mask_token_outside_the_vocabulary_is_named(run, capsys):
    cfg = yaml.safe_load(run["config"].read_text())
    cfg["drafter"]["mask_token_id"] = 5000
    write_checkpoint_config(run["checkpoint"], cfg["drafter"])
    run["config"].write_text(yaml.safe_dump(cfg))
    code, lines = check(run, capsys=capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("mask_token_id: 5000 (checkpoint ")
    assert "is not in the target's vocabulary 0..703" in lines[0]


def test_a_checkpoint_that_disagrees_with_its_run_config_is_named(run, capsys):
    cfg = yaml.safe_load(run["config"].read_text())
    write_checkpoint_config(run["checkpoint"], cfg["drafter"], target_layer_ids=[2, 3, 4],
                            block_size=16, mask_token_id=7)  # fmt: skip
    code, lines = check(run, capsys=capsys)
    assert code == 2
    keys = ["block size", "mask_token_id", "target_layer_ids"]
    assert [line.split(":")[0] for line in lines] == keys
    assert lines[1].startswith("mask_token_id: 7 (checkpoint ")
    assert lines[1].endswith(f"the run config says {cfg['drafter']['mask_token_id']}")
    assert "the run config says [1, 2, 3]" in lines[2]


def test_facts_gathered_on_one_machine_are_compared_on_another(run, tmp_path, capsys):
    """The operator's two-machine check: facts of the training target, then the eval
    target's own (here the same files, given as the other side)."""
    argv = ["--config", str(run["config"]), "--checkpoint", str(run["checkpoint"])]
    assert parity.main([*argv, "--gather-only", "--json"]) == 0
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(json.loads(capsys.readouterr().out)["facts"]))
    code = parity.main(["--given", str(facts), "--eval-kwargs", "{}", "--json"])
    lines = [m["line"] for m in json.loads(capsys.readouterr().out)["mismatches"]]
    assert code == 2 and len(lines) == 1 and "eval with {}" in lines[0]


def test_bad_input_is_one_line_exit_2(run, tmp_path, capsys):
    assert parity.main(["--config", str(run["config"]), "--eval-kwargs", "[1]"]) == 2
    assert capsys.readouterr().err == "parity: error: --eval-kwargs: expected a JSON object\n"
    assert parity.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_the_plan_names_data_made_with_other_kwargs_before_a_launch(run, tmp_path, capsys):
    """A datagen dataset made with thinking on, trained (and evaluated) with thinking off."""
    from workload.plan import memory as plan

    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"chat_template_kwargs": {}}))
    cfg = yaml.safe_load(run["config"].read_text())
    cfg["data"]["path"] = str(data)
    run["config"].write_text(yaml.safe_dump(cfg))
    assert plan.main(["--config", str(run["config"]), "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["parity"]
    assert len(lines) == 1 and lines[0].startswith("chat template kwargs: data renders with {}")
    assert 'training with {"enable_thinking": false}' in lines[0]
