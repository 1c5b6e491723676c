"""Simulated acceptance lengths equal real draft-and-verify loops on a tiny target."""

from __future__ import annotations

import collections
import copy
import json
import os
import shutil
import subprocess
import sys
import time

import dflash.model as zlab
import pytest
import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

from workload.drafter.model import DFlashDrafter
from workload.eval import decode as dc
from workload.eval import evaluate as ev
from workload.eval import summary
from workload.eval.decode import Round, evaluate_drafter, greedy_continuation, real_draft_and_verify

VOCAB, BLOCK = 32, 8
MASK, MASK_CTX = 31, 30  # two drafters, two mask rows of the target's embedding

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_cuda_timer(monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # it calls cuda.synchronize


def _qwen3(**kw) -> Qwen3Config:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return Qwen3Config(**{**base, **kw})


def _prompts() -> list[torch.Tensor]:
    return [
        torch.randint(0, VOCAB - 1, (1, 6 + s), generator=torch.Generator().manual_seed(s))
        for s in range(6)
    ]


def _drafter_config(mask: int, sliding: bool = False) -> Qwen3Config:
    swa = {}
    if sliding:  # a window shorter than the context, as Qwen3.6-27B's drafter has
        swa = dict(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            use_sliding_window=True,
            max_window_layers=2,
        )
    config = _qwen3(num_hidden_layers=2, num_target_layers=4, **swa)
    config.dflash_config = {"target_layer_ids": [1, 2], "mask_token_id": mask, "block_size": BLOCK}
    return config


def _point_mask_at(target, mask: int, token: int, norm: float) -> None:
    row = target.lm_head.weight[token]
    target.model.embed_tokens.weight[mask] = norm * row / row.norm()


@pytest.fixture(scope="module")
@torch.no_grad()
def tiny():
    """A random float32 Qwen3 target and two drafters.

    "zlab" (and "ours", the same weights in our class) often guesses the target's favourite
    token: its mask embedding points at that token's LM-head row and dominates the damped
    layers, so acceptance lengths vary from 1 to the whole block. "zlab_ctx" has a faint mask
    embedding, so its guesses depend on the context (and accept less). "zlab_swa" and
    "ours_swa" are alike with a sliding-window layer."""
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(_qwen3(num_hidden_layers=4, tie_word_embeddings=False)).eval()
    counts = collections.Counter()
    for p in _prompts():
        counts.update(greedy_continuation(target, p[0].tolist(), 40, []))
    favourite, runner_up = (t for t, _ in counts.most_common(2))
    drafter = zlab.DFlashDraftModel(_drafter_config(MASK)).eval()
    for layer in drafter.layers:
        layer.self_attn.o_proj.weight.mul_(0.5)
        layer.mlp.down_proj.weight.mul_(0.5)
    _point_mask_at(target, MASK, favourite, 3.0)
    ctx = zlab.DFlashDraftModel(_drafter_config(MASK_CTX)).eval()
    _point_mask_at(target, MASK_CTX, favourite, 0.05)
    ours = DFlashDrafter(_drafter_config(MASK)).eval()
    ours.load_state_dict(drafter.state_dict())
    swa = zlab.DFlashDraftModel(_drafter_config(MASK_CTX, sliding=True)).eval()
    ours_swa = DFlashDrafter(_drafter_config(MASK_CTX, sliding=True)).eval()
    ours_swa.load_state_dict(swa.state_dict())
    return {
        "target": target,
        "zlab": drafter,
        "ours": ours,
        "zlab_ctx": ctx,
        "zlab_swa": swa,
        "ours_swa": ours_swa,
        "stop": runner_up,
    }


def _zlab_run(drafter, target, prompt, max_new, stops):
    out = zlab.dflash_generate(drafter, target, prompt, max_new, stops, return_stats=True)
    return out.output_ids[0, prompt.shape[1] :].tolist(), out.acceptance_lengths


def _simulated(drafter, target, prompt, max_new, stops, budgets=()):
    ids = prompt[0].tolist()
    seq = ids + greedy_continuation(target, ids, max_new, stops or [])
    hidden = dc.target_hidden_states(target, seq)
    return seq[len(ids) :], evaluate_drafter(
        drafter, target, hidden, seq, len(ids), max_new, stops or [], budgets
    )


CASES = [(40, False), (23, False), (37, True)]  # (max_new_tokens, stop at the runner-up token)


REFERENCE = {"ours": "zlab", "ours_swa": "zlab_swa"}


@pytest.mark.parametrize("kind", ["zlab", "ours", "zlab_ctx", "ours_swa"])
def test_simulated_rounds_equal_dflash_generate(tiny, kind):
    target, drafter = tiny["target"], tiny[kind]
    seen = []
    for max_new, use_stop in CASES:
        stops = [tiny["stop"]] if use_stop else None
        for prompt in _prompts():
            reference = tiny[REFERENCE.get(kind, kind)]
            tokens, lengths = _zlab_run(reference, target, prompt, max_new, stops)
            continuation, result = _simulated(drafter, target, prompt, max_new, stops)
            assert continuation == tokens  # lossless: dflash emits the greedy continuation
            assert [r.produced for r in result.chain] == lengths, (max_new, use_stop)
            assert real_draft_and_verify(drafter, target, prompt, max_new, stops) == lengths
            seen += lengths
    counts = collections.Counter(seen)
    assert len(counts) >= 3 and max(counts) >= 3, counts  # the comparison is not trivial
    if kind in ("zlab", "ours"):
        assert max(counts) == BLOCK and counts[1] < 0.9 * len(seen), counts


def test_layer_ids_outside_the_target_are_refused(tiny):
    """Id k is hidden_states[k + 1]: an id of -1 would silently read the embeddings."""
    target, drafter = tiny["target"], copy.deepcopy(tiny["ours"])
    drafter.target_layer_ids = [-1, *drafter.target_layer_ids[1:]]
    ids = _prompts()[0][0].tolist()
    seq = ids + greedy_continuation(target, ids, 8, [])
    hidden = dc.target_hidden_states(target, seq)
    with pytest.raises(ValueError, match=r"target layer ids \[-1\] out of range 0\.\.3"):
        evaluate_drafter(drafter, target, hidden, seq, len(ids), 8, [], [8])


@pytest.mark.parametrize("kind", ["zlab_ctx", "ours", "ours_swa"])
@torch.no_grad()
def test_oracle_drafts_equal_drafts_from_the_full_context(tiny, kind):
    """Whatever order blocks are asked for in (the cache grows, is reused, or restarts), a
    block at `start` is drafted from exactly the features of positions < start."""
    target, drafter = tiny["target"], tiny[kind]
    ids = _prompts()[3][0].tolist()
    seq = ids + greedy_continuation(target, ids, 30, [])
    hidden = dc.target_hidden_states(target, seq)
    feats = dc.select_target_features(hidden, drafter.target_layer_ids)
    oracle = dc.DraftOracle(dc.DraftSession(drafter, target), feats, seq, top=5)
    p = len(ids)
    for start, size in [(p, 8), (p + 1, 8), (p + 7, 8), (p + 3, 8), (p + 20, 5), (p + 21, 8)]:
        block = torch.tensor([[seq[start]] + [drafter.mask_token_id] * (size - 1)])
        out = drafter(
            position_ids=torch.arange(start + size)[None],
            noise_embedding=target.model.embed_tokens.weight[block],
            target_hidden=feats[:, :start],
        )
        want = torch.log_softmax(target.lm_head(out[0, 1:]), dim=-1).topk(5, dim=-1)
        got = oracle(start, size)
        assert torch.equal(got.top_ids, want.indices), start
        assert torch.tensor(got.top_logprobs) == pytest.approx(want.values, abs=1e-5), start


def test_stop_token_ends_the_rounds(tiny):
    target, drafter, stop = tiny["target"], tiny["zlab"], tiny["stop"]
    stopped = 0
    for prompt in _prompts():
        continuation, result = _simulated(drafter, target, prompt, 60, [stop])
        assert sum(r.produced for r in result.chain) == len(continuation) - 1
        stopped += continuation[-1] == stop
        assert stop not in continuation[:-1]
    assert stopped >= 2


# ----------------------------------------------------------------------------- DDTree, for real


def _build_tree(logprobs: torch.Tensor, budget: int) -> list[tuple[int, int, int, float]]:
    """Nodes (parent index or -1, depth, token, score): repeatedly add the best-scoring child
    not yet in the tree (scan every node; no heap), `budget` times."""
    nodes: list[tuple[int, int, int, float]] = []
    depths = logprobs.shape[0]
    for _ in range(budget):
        best = None
        for parent in [-1, *range(len(nodes))]:
            depth = 0 if parent < 0 else nodes[parent][1]
            if depth == depths:
                continue
            score = 0.0 if parent < 0 else nodes[parent][3]
            taken = {n[2] for n in nodes if n[0] == parent}
            for token in logprobs[depth].argsort(descending=True).tolist():
                if token not in taken:
                    cand = (parent, depth + 1, token, score + float(logprobs[depth, token]))
                    if best is None or cand[3] > best[3]:
                        best = cand
                    break
        nodes.append(best)
    return nodes


def _real_tree_rounds(drafter, target, prompt, max_new, budget) -> list[int]:
    """Draft from scratch each round (no caches), build the tree, verify it with the target
    node by node, commit the accepted path plus the target's bonus token."""
    tokens = prompt[0].tolist()
    prompt_len, max_length = len(tokens), len(tokens) + max_new
    embed = target.model.embed_tokens.weight

    def argmax_after(ids):
        return int(target(torch.tensor([ids])).logits[0, -1].argmax())

    tokens.append(argmax_after(tokens))
    start, lengths = prompt_len, []
    while start + 1 < max_length:
        size = min(BLOCK, max_length - start)
        hs = target(torch.tensor([tokens[:start]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[k + 1] for k in drafter.target_layer_ids], dim=-1)
        block = torch.tensor([[tokens[start]] + [drafter.mask_token_id] * (size - 1)])
        hidden = drafter(
            position_ids=torch.arange(start + size)[None],
            noise_embedding=embed[block],
            target_hidden=feats,
        )
        logprobs = torch.log_softmax(target.lm_head(hidden[0, 1:]), dim=-1)
        nodes = _build_tree(logprobs, budget)
        node, path = -1, []
        while True:
            want = argmax_after(tokens[: start + 1] + path)
            child = next((i for i, n in enumerate(nodes) if n[0] == node and n[2] == want), None)
            if child is None:
                break
            node, path = child, [*path, want]
        produced = min(len(path) + 1, max_length - start - 1)
        tokens += [*path, want][:produced]
        start += produced
        lengths.append(produced)
    return lengths


@pytest.mark.parametrize("kind", ["zlab", "zlab_ctx"])
@torch.no_grad()
def test_simulated_ddtree_equals_real_tree_verification(tiny, kind):
    target, drafter = tiny["target"], tiny[kind]
    budgets = [2, 5, 12]
    deeper = 0
    for prompt in _prompts()[:3]:
        _, result = _simulated(drafter, target, prompt, 30, None, budgets)
        for b in budgets:
            real = _real_tree_rounds(drafter, target, prompt, 30, b)
            assert [r.produced for r in result.trees[b]] == real, b
        deeper += summary.tau(result.trees[12]) > summary.tau(result.chain)
    assert deeper >= 1  # a wide tree beats the chain somewhere, as it should


@pytest.mark.parametrize("kind", ["ours", "zlab_ctx"])
@torch.no_grad()
def test_real_tree_loop_equals_the_simulated_ddtree(tiny, kind):
    """The real DDTree loop (drafts from its own caches, the target walks the tree) accepts what
    the simulation says, round for round, stops and the length limit included."""
    target, drafter = tiny["target"], tiny[kind]
    budgets, deeper = [2, 5, 16], 0
    for prompt, (max_new, use_stop) in zip(_prompts(), CASES * 2, strict=False):
        stops = [tiny["stop"]] if use_stop else None
        continuation, result = _simulated(drafter, target, prompt, max_new, stops, budgets)
        for b in budgets:
            tokens, real = dc.real_tree_generate(drafter, target, prompt, max_new, stops, b)
            assert tokens == continuation
            assert real == [r.produced for r in result.trees[b]], b
        deeper += (summary.tau(result.trees[16]) or 0) > (summary.tau(result.chain) or 0)
    assert deeper >= 1


# ----------------------------------------------------------------------------- summaries


def test_summary_follows_the_contract():
    a = dc.PromptResult([Round(10, 4, 3, 4), Round(14, 4, 0, 1), Round(15, 3, 1, 2)])
    a.trees[8] = [Round(10, 4, 3, 4), Round(14, 4, 2, 3)]
    b = dc.PromptResult([Round(5, 4, 1, 2)])
    b.trees[8] = [Round(5, 4, 1, 2)]
    s = summary.summarize([a, b, dc.PromptResult([], {8: []})], block_size=4, budgets=[8])
    assert s["tau"] == pytest.approx(((4 + 1 + 2) / 3 + 2) / 2)  # mean over prompts of means
    assert s["ddtree"] == {"8": pytest.approx((3.5 + 2) / 2)}
    assert s["histogram"] == [0, 1, 2, 0, 1]  # rounds by accepted + 1
    # slot k: rounds whose block had slot k, and how many accepted at least k drafts
    assert s["per_position"] == pytest.approx([3 / 4, 1 / 4, 1 / 3])


# ----------------------------------------------------------------------------- command line

CHATS = [
    [
        {"role": "user", "content": f"Count from {n} to {n + 5}."},
        {"role": "assistant", "content": " ".join(str(n + i) for i in range(6)) + ". Done."},
    ]
    for n in range(12)
]


@pytest.fixture(scope="module")
@torch.no_grad()
def run_dir(tmp_path_factory):
    """A run directory as the operator lays it out: a saved tiny target with a ChatML tokenizer,
    data + prompts, run.yaml with relative paths, a checkpoint with its manifest, and the same
    drafter saved by z-lab's class (no manifest) as the reference."""
    from workload.drafter.checkpoint import write_manifest
    from workload.drafter.model import build_drafter_config
    from workload.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("run")
    chatml = [
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in CHATS
    ]
    tok = build_tokenizer(chatml, vocab_size=300)
    torch.manual_seed(1)
    config = _qwen3(
        vocab_size=-(-len(tok) // 64) * 64,
        num_hidden_layers=4,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    target = Qwen3ForCausalLM(config).eval()
    target.generation_config.eos_token_id = tok.eos_token_id
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    # the prompts here (and test_eval_inputs's "Count from 4 to 9.") are held out: an eval on
    # training prompts is refused (eval/overlap.py)
    held_out = [c for k, c in enumerate(CHATS) if k not in (0, 3, 4, 5)]
    (root / "data.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in held_out))
    prompts = [
        {"messages": CHATS[0][:1]},
        {"prompt": "Count from 3 to 8."},
        {"messages": CHATS[5][:1], "chat_template_kwargs": {}},
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    mask = tok.mask_token_id
    (root / "run.yaml").write_text(
        "target: {path: target}\ndata: {path: data.jsonl, max_length: 128}\n"
        f"drafter: {{num_layers: 1, block_size: 8, target_layer_ids: [1, 2], mask_token_id: {mask}}}\n"
    )
    dconf = build_drafter_config(
        config, num_layers=1, block_size=8, mask_token_id=mask, target_layer_ids=[1, 2]
    )
    drafter = DFlashDrafter(dconf)
    ckpt = root / "checkpoints" / "step_5"
    drafter.save_pretrained(ckpt)
    write_manifest(ckpt)
    reference = zlab.DFlashDraftModel(copy.deepcopy(dconf))
    reference.load_state_dict(drafter.state_dict())
    reference.save_pretrained(root / "zlab-drafter")
    return root


def _eval(capsys, run_dir, *extra, checkpoint=None, config=None):
    out = run_dir / "out" / "eval.json"
    out.unlink(missing_ok=True)
    argv = [
        "--config",
        str(config or run_dir / "run.yaml"),
        "--checkpoint",
        str(checkpoint or run_dir / "checkpoints" / "step_5"),
        "--max-new-tokens",
        "24",
        "--out",
        str(out),
        *extra,
    ]
    rc = ev.main(argv)
    captured = capsys.readouterr()
    result = json.loads(out.read_text()) if out.exists() else None
    return rc, captured.out, captured.err, result


def test_cli_writes_the_contract_keys(run_dir, capsys):
    rc, out, err, r = _eval(
        capsys,
        run_dir,
        "--reference",
        str(run_dir / "zlab-drafter"),
        "--budgets",
        "4,8",
        "--check-real",
        "2",
    )
    assert rc == 0, err
    assert out == ""  # stdout stays clean
    assert "prompt 3/3" in err and "running" in err
    for key in (
        "tau",
        "ddtree",
        "per_position",
        "histogram",
        "n_prompts",
        "max_new_tokens",
        "checkpoint",
        "reference",
        "prompts",
        "timing",
    ):
        assert key in r, key
    assert r["n_prompts"] == 3 and r["max_new_tokens"] == 24
    assert r["checkpoint"] == str((run_dir / "checkpoints" / "step_5").resolve())
    assert set(r["ddtree"]) == {"4", "8", "16", "32", "64"}  # asked for + training's + official
    assert len(r["per_position"]) == 7 and len(r["histogram"]) == 9
    assert sum(r["histogram"]) == r["rounds"] > 0
    assert 1.0 <= r["tau"] <= 8.0
    for p in r["prompts"]:  # every generated token but the first comes from a round
        assert sum(p["checkpoint"]["rounds"]) == p["new_tokens"] - 1
    # the reference is the same weights saved by z-lab's class: identical rounds
    ref = r["reference"]
    assert ref["checkpoint"] == str((run_dir / "zlab-drafter").resolve())
    assert ref["tau"] == r["tau"] and ref["histogram"] == r["histogram"]
    assert ref["ddtree"] == r["ddtree"] and ref["n_prompts"] == 3
    real = r["check_real"]
    assert real["prompts"] == 2 and real["equal"] == 2
    checked = r["prompts"][:2]
    rounds = sum(len(p["checkpoint"]["rounds"]) for p in checked)
    rounds += sum(len(p["checkpoint"]["ddtree"][b]["rounds"]) for p in checked for b in r["ddtree"])
    assert r["real_loop_rounds_checked"] == real["rounds_checked"] == real["rounds_equal"] == rounds
    assert real["real_tau"] == real["simulated_tau"]
    assert set(real["ddtree"]) == set(r["ddtree"])
    for tree in real["ddtree"].values():
        assert tree["real_tau"] == tree["simulated_tau"] and tree["rounds_checked"] > 0
    assert real["real_tokens_per_s"] > 0 and real["ar_tokens_per_s"] > 0 and real["speedup"] > 0
    assert "rounds as simulated" in err and "tokens/s vs" in err
    assert r["timing"]["total_s"] > 0


def _one_line_error(rc, out, err) -> str:
    assert rc == 2 and out == ""
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_cli_refuses_an_eval_that_renders_otherwise_than_training_unless_forced(
    run_dir, capsys, tmp_path
):
    """Train-to-serve parity before an eval: a run trained with thinking off under a template
    that thinks by default, evaluated with thinking on, is one line naming both sides."""
    from tests.workload.test_parity import THINKING

    (tmp_path / "thinking.jinja").write_text(THINKING)
    cfg = yaml.safe_load((run_dir / "run.yaml").read_text())
    cfg["data"]["chat_template"] = str(tmp_path / "thinking.jinja")
    cfg["data"]["chat_template_kwargs"] = {"enable_thinking": False}
    config = run_dir / "thinking-off.yaml"  # its relative paths as the run's
    config.write_text(yaml.safe_dump(cfg))
    thinking = ("--chat-template-kwargs", '{"enable_thinking": true}')
    rc, out, err, r = _eval(capsys, run_dir, *thinking, config=config)
    assert rc == 2 and r is None and "Traceback" not in err
    lines = err.splitlines()
    assert lines[0].startswith("eval: error: parity: chat template kwargs: training renders with")
    assert lines[-1].startswith("eval: error: (--force") and len(lines) == 2
    rc, _, err, r = _eval(capsys, run_dir, *thinking, "--force", "--budgets", "8", config=config)
    assert rc == 0, err
    assert r["parity"]["forced"] is True and len(r["parity"]["mismatches"]) == 1
    rc, _, err, r = _eval(capsys, run_dir, "--budgets", "8", config=config)
    assert rc == 0 and r["parity"] == {"mismatches": [], "forced": False}


def test_cli_refuses_a_checkpoint_without_manifest(run_dir, capsys, tmp_path):
    partial = tmp_path / "step_9"
    shutil.copytree(run_dir / "checkpoints" / "step_5", partial)
    (partial / "MANIFEST.sha256").unlink()
    rc, out, err, _ = _eval(capsys, run_dir, checkpoint=partial)
    err = _one_line_error(rc, out, err)
    assert str(partial / "MANIFEST.sha256") in err and "--allow-incomplete" in err
    rc, _, err, r = _eval(
        capsys, run_dir, "--allow-incomplete", "--budgets", "8", checkpoint=partial
    )
    assert rc == 0 and r["checkpoint"] == str(partial.resolve())
    assert r["real_loop_rounds_checked"] == 0  # no real loop ran
    assert set(r["ddtree"]) == {"8", "16", "32", "64"}


def test_cli_refuses_a_changed_checkpoint(run_dir, capsys, tmp_path):
    changed = tmp_path / "step_9"
    shutil.copytree(run_dir / "checkpoints" / "step_5", changed)
    with open(changed / "config.json", "a") as f:
        f.write(" ")
    err = _one_line_error(*_eval(capsys, run_dir, checkpoint=changed)[:3])
    assert str(changed / "MANIFEST.sha256") in err and "does not match" in err


@pytest.mark.parametrize(
    ("lines", "bad_line"),
    [
        (['{"prompt": "hi"}', '{"messages": [', '{"prompt": "x"}'], 2),
        (['{"prompt": "hi"}', "", '{"text": "no"}'], 3),
        (['{"messages": [{"role": "user"}]}'], 1),
    ],
)
def test_cli_names_the_bad_prompts_line(run_dir, capsys, tmp_path, lines, bad_line):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    err = _one_line_error(*_eval(capsys, run_dir, "--prompts", str(prompts))[:3])
    assert f"{prompts}:{bad_line}:" in err


def test_cli_names_the_config_problem(run_dir, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {path: data.jsonl}\n")
    err = _one_line_error(*_eval(capsys, run_dir, config=bad)[:3])
    assert "bad.yaml" in err and "target.path" in err
    err = _one_line_error(*_eval(capsys, run_dir, checkpoint=tmp_path / "nope")[:3])
    assert str(tmp_path / "nope") in err


def test_module_entry_point_exits_with_one_line(run_dir, tmp_path):
    partial = tmp_path / "step_1"
    partial.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workload.eval",
            "--config",
            str(run_dir / "run.yaml"),
            "--checkpoint",
            str(partial),
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"eval: error: {partial / 'MANIFEST.sha256'}: missing, the checkpoint is incomplete "
        "(pass --allow-incomplete to evaluate it anyway)"
    ]
