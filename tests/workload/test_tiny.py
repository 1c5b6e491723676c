"""The tiny targets: they load offline as ordinary Hugging Face models and were trained enough
that their greedy replies follow the task patterns; and `load_target`'s CPU fallback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from workload import tiny
from workload.data.chat import load_examples
from workload.drafter.targets import (
    _device_dispatch,
    embedding_rows,
    force_torch_fallback_off_gpu,
    load_target,
    text_config,
)


@pytest.fixture(params=["dense", "hybrid"])
def build(request):
    return request.getfixturevalue(f"tiny_{request.param}"), request.param


REPO = Path(__file__).resolve().parents[2]


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_build_loads_offline_with_auto_classes(build):
    out, kind = build
    model = AutoModelForCausalLM.from_pretrained(out / "target", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out / "target", local_files_only=True)
    cfg = model.config
    assert cfg.model_type == {"dense": "qwen3", "hybrid": "qwen3_5_text"}[kind]
    assert cfg.num_hidden_layers >= 5
    if kind == "hybrid":
        assert {"linear_attention", "full_attention"} == set(cfg.layer_types)
    mask = tok.convert_tokens_to_ids("<|MASK|>")
    assert mask not in (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id)
    assert mask < embedding_rows(model) and embedding_rows(model) >= len(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 5."}],
                                     tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok(prompt)["input_ids"]) == prompt  # byte-level: exact round trip

    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["target"]["path"] == str(out / "target")
    assert run["data"]["path"] == str(out / "data.jsonl")
    assert run["drafter"]["mask_token_id"] == mask
    assert max(run["drafter"]["target_layer_ids"]) < cfg.num_hidden_layers
    from workload.config import load_config

    assert load_config(out / "run.yaml").drafter.mask_token_id == mask

    prompts = _jsonl(out / "prompts.jsonl")
    assert prompts and all([m["role"] for m in p["messages"]] == ["user"] for p in prompts)
    examples = load_examples(out / "data.jsonl", tok, max_length=run["data"]["max_length"])
    assert len(examples) == len(_jsonl(out / "data.jsonl"))


def test_load_target_is_frozen_and_runs_on_cpu(build):
    out, kind = build
    model, tok = load_target(out / "target")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    ids = torch.tensor([tok("Count from 3 to 9.")["input_ids"]])
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == text_config(model.config).num_hidden_layers + 1
    if kind == "hybrid":
        patched = force_torch_fallback_off_gpu(model)  # already done by load_target
        assert patched == []
        import transformers.models.qwen3_5.modeling_qwen3_5 as q5

        assert getattr(q5.torch_chunk_gated_delta_rule, "_dflash_dispatch", False)


def test_cpu_tensors_never_reach_the_gpu_kernel():
    def gpu_kernel(x, **kw):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    def reference(x, cu_seqlens=None):
        return x + 1

    f = _device_dispatch("chunk_gated_delta_rule", gpu_kernel, reference)
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    with pytest.raises(ValueError, match="packed"):
        f(torch.zeros(2), cu_seqlens=torch.tensor([0, 1, 2]))


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def test_trained_dense_target_counts(tiny_dense):
    model, tok = load_target(tiny_dense / "target")
    seen = {m["content"] for c in _jsonl(tiny_dense / "data.jsonl") for m in c["messages"]}
    r = __import__("random").Random(123)
    prompts = []
    while len(prompts) < 8:
        messages, _, _ = tiny.prompt(r, "count_up")
        if messages[0]["content"] not in seen:
            prompts.append(messages)
    replies, unfinished = tiny.greedy_replies(model, tok, prompts,
                                              max_new_tokens=64)  # fmt: skip
    assert unfinished == 0
    follows = 0
    for got in replies:
        nums = _numbers(got.split(":", 1)[-1])
        # held-out prompt: the reply counts up by one from where it starts, and ends as taught
        follows += (got.startswith("Counting from") and got.endswith(". Done.") and len(nums) >= 4
                    and all(b == a + 1 for a, b in zip(nums, nums[1:], strict=False)))  # fmt: skip
    assert follows >= 6, replies


def test_data_replies_are_the_targets_own_greedy_replies(tiny_dense):
    model, tok = load_target(tiny_dense / "target")
    convs = [c["messages"] for c in _jsonl(tiny_dense / "data.jsonl")]
    single = [c for c in convs if len(c) == 2][:24]
    replies, _ = tiny.greedy_replies(model, tok, [c[:1] for c in single], max_new_tokens=96)
    same = sum(got == c[1]["content"] for c, got in zip(single, replies, strict=True))
    assert same >= 22  # batch composition may flip a rare near-tie


def test_build_is_deterministic(tmp_path):
    kw = dict(kind="dense", steps=2, conversations=40, prompts=3, seed=7)
    a, b = tiny.build(tmp_path / "a", **kw), tiny.build(tmp_path / "b", **kw)
    assert a["final_loss"] == b["final_loss"]
    for name in (
        "data.jsonl",
        "prompts.jsonl",
        "target/model.safetensors",
        "target/tokenizer.json",
    ):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert tiny.make_corpus(8, 40, 3) != tiny.make_corpus(7, 40, 3)


def test_multimodal_qwen35_checkpoint_loads_as_its_text_model(tiny_hybrid, tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=704, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                linear_value_head_dim=16)  # fmt: skip
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    vlm.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_hybrid / "target").save_pretrained(tmp_path)
    model, _ = load_target(tmp_path)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert text_config(model.config).num_hidden_layers == 4 and embedding_rows(model) == 704
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, vlm(input_ids=ids).logits)


def test_the_command_line_prints_lines_not_a_progress_bar(tmp_path):
    """demo.sh and logs show the builder's output: lines, never a tqdm bar's carriage returns
    (transformers' "Writing model shards" bar)."""
    cmd = [sys.executable, "-m", "workload.tiny", "--out", str(tmp_path / "t"), "--steps", "2",
           "--conversations", "40", "--prompts", "2", "--no-regenerate"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr.decode()
    assert b"[tiny] wrote" in done.stderr
    assert b"\r" not in done.stdout + done.stderr, done.stderr.decode()
