"""The run config: YAML + overrides, one-line errors with file:line and key, the recipe audit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from workload.config import (
    ConfigError,
    TargetFacts,
    audit,
    audit_errors,
    config_hash,
    dump,
    from_dict,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
MINIMAL = "target:\n  path: /models/t\ndata:\n  path: /data/d.jsonl\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def error_of(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_and_yaml_values(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "loss:\n  gamma: 10\n"))
    assert cfg.target.path == "/models/t"
    assert cfg.loss.gamma == 10.0 and isinstance(cfg.loss.gamma, float)
    assert cfg.drafter.block_size == 16
    assert cfg.optim.betas == [0.9, 0.95]


def test_bad_choice_names_file_line_key_and_choices(tmp_path):
    path = write(tmp_path, MINIMAL + "loss:\n  gamma: 7\n  type: kll\n")
    assert error_of(path) == "run.yaml:7: loss.type: 'kll' is not one of ce, kl, blend"


def test_unknown_key_suggests_the_close_one(tmp_path):
    path = write(tmp_path, MINIMAL + "optim:\n  lr: 1e-4\n  warmup_ration: 0.1\n")
    assert error_of(path) == (
        "run.yaml:7: optim.warmup_ration: unknown key; did you mean optim.warmup_ratio?"
    )
    assert "did you mean drafter?" in error_of(write(tmp_path, MINIMAL + "drafer: {}\n"))


def test_wrong_type_names_line_and_expected_type(tmp_path):
    path = write(tmp_path, MINIMAL + "drafter:\n  num_layers: five\n")
    assert error_of(path) == "run.yaml:6: drafter.num_layers: expected an integer, got 'five'"
    path = write(tmp_path, MINIMAL + "data:\n  pack: 1\n")
    assert "data.pack: expected true or false" in error_of(path)


def test_missing_required_path(tmp_path):
    message = error_of(write(tmp_path, "data:\n  path: /d.jsonl\n"))
    assert message.startswith("run.yaml: target.path: required")


def test_overrides_are_yaml_typed_and_named_in_errors(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, ["loss.gamma=4", "drafter.target_layer_ids=[1, 3]", "data.pack=true"])
    assert cfg.loss.gamma == 4.0
    assert cfg.drafter.target_layer_ids == [1, 3]
    assert cfg.data.pack is True
    assert load_config(path, ["optim.lr=3e-4"]).optim.lr == 3e-4  # YAML 1.1 reads this as text
    assert error_of(path, ["optim.lr=fast"]) == (
        "--set optim.lr=fast: optim.lr: expected a number, got 'fast'"
    )
    assert "expected KEY=VALUE" in error_of(path, ["optim.lr"])


def test_invalid_yaml_names_line(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "loss: [unclosed\n"))
    assert message.startswith("run.yaml:") and "not valid YAML" in message


def test_range_and_structure_checks(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert "loss.gamma: must be > 0" in error_of(path, ["loss.gamma=0"])
    assert "duplicate layer ids" in error_of(path, ["drafter.target_layer_ids=[1,1]"])
    assert "layer ids are >= 0" in error_of(path, ["drafter.target_layer_ids=[-1,3]"])
    assert "has 2 entries for 5 drafter layers" in error_of(
        path, ["drafter.layer_types=[full_attention, full_attention]"]
    )
    sliding = "drafter.layer_types=[sliding_attention, full_attention]"
    assert "drafter.sliding_window: required" in error_of(path, ["drafter.num_layers=2", sliding])
    assert "both null never ends" in error_of(path, ["optim.max_steps=null"])


def test_teacher_layer_inside_drafter_input_is_an_error(tmp_path):
    path = write(tmp_path, MINIMAL)
    message = error_of(path, ["loss.teacher=last_layer"])
    assert "teacher layer inside the drafter's input" in message
    assert "set drafter.fc_layers: all_but_last or loss.teacher: logits" in message
    ok = load_config(path, ["loss.teacher=last_layer", "drafter.fc_layers=all_but_last"])
    assert ok.loss.teacher == "last_layer"


def test_noise_scope_is_gone_and_labels_cannot_be_asked_to_see_noise(tmp_path):
    path = write(tmp_path, MINIMAL + "noise:\n  start: 0.1\n  scope: all_layers\n")
    message = error_of(path)
    assert message.startswith("run.yaml:7: noise.scope: 'all_layers' was removed")
    assert "labels never see noise" in message
    old = ["loss.teacher=last_layer", "drafter.fc_layers=all_but_last", "noise.scope=all_layers"]
    assert "noise.scope" in error_of(path, old)
    # the one value that was ever implemented still loads (configs inside old checkpoints)
    cfg = load_config(path, ["noise.scope=fc_inputs"])
    assert "scope" not in cfg.to_dict()["noise"] and cfg.noise.start == 0.1
    assert from_dict({**cfg.to_dict(), "noise": {"start": 0.1, "scope": "fc_inputs"}}) == cfg


def test_old_run_options_load(tmp_path):
    v3 = ["loss.type=blend", "loss.kl_temperature=2", "loss.kl_weight=0.7", "loss.gamma=10",
          "loss.weighting=dpace", "drafter.fc_layers=all_but_last", "noise.start=0.1"]  # fmt: skip
    cfg = load_config(write(tmp_path, MINIMAL), v3)
    keys = {item.key for item in audit(cfg)}
    assert {"loss.type", "loss.gamma", "loss.weighting", "drafter.fc_layers"} <= keys


FACTS = TargetFacts(
    num_layers=64, embedding_rows=248320, pad_token_id=248044, eos_token_ids=(248046,)
)


def test_template_27b_matches_the_recipe():
    cfg = load_config(REPO / "templates/runs/qwen36-27b.yaml")
    assert cfg.drafter.target_layer_ids == [1, 16, 31, 46, 61]
    assert cfg.drafter.mask_token_id == 248070
    assert cfg.drafter.layer_types.count("sliding_attention") == 4
    assert (cfg.drafter.sliding_window, cfg.data.max_length, cfg.data.num_anchors) == (
        2048,
        8192,
        512,
    )
    items = audit(cfg, FACTS)
    assert audit_errors(items) == []
    ours = [i for i in items if i.level != "peer"]  # the template is the recipe but its length
    assert [i.line() for i in ours] == [
        "[info] data.max_length = 8192 (recipe: 4096): training context of the published drafters"
    ]  # thinking replies run 2-8k tokens (templates/runs/qwen36-27b.yaml, README)
    peers = {i.key: i.note for i in items if i.level == "peer"}  # where the peers differ, why
    assert "SpecForge (0.9, 0.999)" in peers["optim.betas"] and "optim.epochs" in peers


def test_mask_token_errors():
    base = load_config(REPO / "templates/runs/qwen36-27b.yaml")
    for mask, words in [(248320, "not a row"), (None, "no mask token"), (248044, "pad"),
                        (248046, "eos")]:  # fmt: skip
        base.drafter.mask_token_id = mask
        errors = audit_errors(audit(base, FACTS))
        assert len(errors) == 1 and errors[0].key == "drafter.mask_token_id"
        assert words in errors[0].note


def test_layer_ids_beyond_the_target_are_an_error():
    cfg = load_config(REPO / "templates/runs/qwen36-27b.yaml")
    small = TargetFacts(num_layers=40, embedding_rows=248320)
    errors = audit_errors(audit(cfg, small))
    assert [e.key for e in errors] == ["drafter.target_layer_ids"]
    assert "40 decoder layers" in errors[0].note


def test_an_fc_tap_on_the_post_norm_last_layer_is_a_warning():
    cfg = load_config(REPO / "templates/runs/qwen36-27b.yaml")
    assert not [i for i in audit(cfg, FACTS) if i.level == "warn"]
    cfg.drafter.target_layer_ids = [1, 16, 31, 46, 63]
    (warn,) = [i for i in audit(cfg, FACTS) if i.level == "warn"]
    assert warn.key == "drafter.target_layer_ids" and "after the final norm" in warn.note
    cfg.drafter.fc_layers, cfg.loss.teacher = "all_but_last", "last_layer"  # 63: teacher only
    assert not [i for i in audit(cfg, FACTS) if i.level == "warn"]


def test_dump_round_trips_and_hash_ignores_logging(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["loss.gamma=5"])
    out = tmp_path / "resolved.yaml"
    dump(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["loss"]["gamma"] == 5.0
    again.log.log_every = 99
    assert config_hash(again) == config_hash(cfg)
    again.loss.gamma = 6.0
    assert config_hash(again) != config_hash(cfg)


PUBLISHED = {  # a published drafter's config.json, in the shape z-lab's carry
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 200, "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64, "block_size": 4,
    "dflash_config": {"block_size": 4, "target_layer_ids": [1, 3], "mask_token_id": 5},
}  # fmt: skip


def test_a_run_takes_its_layout_from_a_published_drafter(tmp_path):
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text(json.dumps(PUBLISHED))
    cfg = load_config(write(tmp_path, MINIMAL + f"drafter:\n  layout_from: {published}\n"))
    d = cfg.drafter
    assert (d.num_layers, d.block_size, d.target_layer_ids, d.mask_token_id) == (2, 4, [1, 3], 5)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (8, 2, 16)
    assert (d.layer_types, d.sliding_window, d.intermediate_size) == (
        ["sliding_attention", "full_attention"], 64, 200)  # fmt: skip
    agree = load_config(write(tmp_path, MINIMAL + f"drafter:\n  layout_from: {published}\n"
                              "  block_size: 4\n"))  # fmt: skip
    assert agree.drafter.block_size == 4
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MINIMAL + f"drafter:\n  layout_from: {published}\n"
                          "  block_size: 16\n"))  # fmt: skip
    assert str(err.value) == (
        f"run.yaml:7: drafter.block_size: 16 here, 4 in the published layout {published} "
        "(drafter.layout_from): drop one"
    )
    with pytest.raises(ConfigError, match="drafter.layout_from: .*nope: not a drafter"):
        load_config(write(tmp_path, MINIMAL + f"drafter:\n  layout_from: {tmp_path / 'nope'}\n"))
