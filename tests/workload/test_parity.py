"""Train-to-serve parity (workload/eval/parity.py) on the tiny target with a chat template that
behaves like Qwen3.5/3.6's (thinking on by default, an empty think block when it is off,
reasoning dropped from earlier turns): a consistent run passes; each setting a user gets
wrong is named with both sides."""

from __future__ import annotations

import hashlib
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


@pytest.mark.slow
def test_the_engine_says_itself_how_it_serves_the_drafters_layers(run, vllm_python, capsys):
    """Probed in vLLM itself (its registry, its DFlash model's per-layer attention of this
    drafter's config), no string search: 27B-like mixed sliding and full layers are refused by
    this vLLM's V1 model runner, in its own words."""
    cfg = json.loads((run["checkpoint"] / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
               architectures=["DFlashDraftModel"])  # fmt: skip
    (run["checkpoint"] / "config.json").write_text(json.dumps(cfg))
    code, lines = check(run, "--vllm-python", vllm_python, capsys=capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("layer_types: the drafter has sliding_attention layers (checkpoint ")
    assert "DFlash model refuses them: NotImplementedError: " in lines[0]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in lines[0]


def test_sliding_layers_an_engine_serves_with_full_attention_are_named():
    ckpt = {"dir": "/c", "block_size": 8, "mask_token_id": 1, "target_layer_ids": [1],
            "num_target_layers": 6, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    engine = {"name": "vllm", "version": "0.1", "of": "drafter", "windows": [None, None],
              "architectures": ["DFlashDraftModel"]}  # fmt: skip
    found = parity.mismatches({"checkpoint": ckpt, "engine": engine})
    assert [m.line for m in found] == [
        "layer_types: the drafter's layers [0] are sliding_attention (checkpoint "
        "/c/config.json), vllm 0.1's DFlash model serves them with full attention"
    ]
    engine["windows"] = [6, None]
    assert parity.mismatches({"checkpoint": ckpt, "engine": engine}) == []


def test_an_ab_of_drafters_trained_for_other_chat_settings_is_named(run, tmp_path):
    """`eval --serve --vs`: the second drafter (its run.yaml above it, as pull-ckpt leaves it)
    is checked against the same serving, and the two runs' chat settings against each other;
    a drafter without a run config is said to be unknown."""
    other = tmp_path / "elsewhere" / "other"
    (other / "step_3").mkdir(parents=True)
    cfg = yaml.safe_load(run["config"].read_text())
    write_checkpoint_config(other / "step_3", cfg["drafter"])
    del cfg["data"]["chat_template_kwargs"]
    cfg["data"]["chat_template"] = str(tmp_path / "thinking.jinja")
    (other / "run.yaml").write_text(yaml.safe_dump(cfg))
    serving = {"chat_template": str(tmp_path / "thinking.jinja"),
               "chat_template_kwargs": '{"enable_thinking": false}'}  # fmt: skip
    found = parity.before_vs(run["config"], other / "step_3", None, [], None, serving)
    assert found["config"] == str(other / "run.yaml")
    (line,) = found["mismatches"]
    assert line.startswith("chat template kwargs: training renders with {} (enable_thinking not")
    assert 'serving with {"enable_thinking": false} (--serve-chat-template ' in line
    assert found["apart"].startswith(f"trained chat settings: {run['config']} renders with "
                                     '{"enable_thinking": false}, ')  # fmt: skip
    (other / "run.yaml").unlink()
    found = parity.before_vs(run["config"], other / "step_3", None, [], None, serving)
    assert found == {"unknown": f"--vs {other / 'step_3'}: no run config beside it: the chat "
                     "settings it was trained for are not known, nor checked"}  # fmt: skip


def test_an_eval_result_measured_with_other_chat_settings_than_serving_is_named(run, tmp_path,
                                                                               capsys):  # fmt: skip
    """The checkpoint's stored eval result (its fingerprint) rendered with thinking on; it is
    served with thinking off, as it trained: its tau is not what will be served."""
    template = tmp_path / "thinking.jinja"
    result = tmp_path / "step_10.json"
    result.write_text(json.dumps({"fingerprint": {
        "chat_template_kwargs": {"enable_thinking": True},
        "chat_template_sha256": hashlib.sha256(THINKING.encode()).hexdigest()}}))  # fmt: skip
    code, lines = check(run, "--serve-chat-template", str(template), "--serve-chat-template-kwargs",
                        '{"enable_thinking": false}', "--eval-result", str(result),
                        "--eval-result", str(tmp_path / "serve_10.json"), capsys=capsys)  # fmt: skip
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith('chat template kwargs: eval renders with {"enable_thinking": true} '
                               f"(the eval result {result}), serving with "
                               '{"enable_thinking": false} (--serve-chat-template ')  # fmt: skip
