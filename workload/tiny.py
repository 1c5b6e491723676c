"""`python -m workload.tiny --out DIR [--kind dense|hybrid]`: a tiny target to learn from, offline.

Builds a byte-level BPE tokenizer with a ChatML template and a real `<|MASK|>` row, a tiny
Qwen3 (dense) or Qwen3.5 text (hybrid: Gated DeltaNet + full attention) model, trains it on
synthetic chats whose replies are predictable several tokens ahead (counting, progressions,
copying, reversing, repeated phrases, key lookups, spelling), then regenerates every assistant
reply with the trained model's greedy decoding (the recipe trains drafters on target outputs).
Writes DIR/target/, DIR/data.jsonl, DIR/prompts.jsonl and DIR/run.yaml.
"""

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from workload.common.layout import RUN_CONFIG
from workload.data.batches import BatchStream
from workload.data.chat import Example, render_chat
from workload.drafter.targets import force_torch_fallback_off_gpu

# ----------------------------------------------------------------------------- synthetic tasks


WORDS = (  # noqa: SIM905
    "red blue green black white pink gold gray cat dog fox owl bee cow pig hen "
    "ant bat elk yak apple pear plum fig lime kiwi grape melon peach lemon sun "
    "moon star rain snow wind cloud storm river stone tree leaf tiger lion zebra "
    "horse mouse snake eagle shark whale camel"
).split()
KEYS = "alpha beta gamma delta omega sigma kappa theta".split()  # noqa: SIM905
PHRASES = (
    "good morning",
    "thank you",
    "see you soon",
    "well done",
    "happy birthday",
    "all is well",
    "keep going",
    "one more time",
)
SYSTEM = "You are a helpful assistant."
Task = tuple[str, str]  # (user, assistant)


def _nums(xs) -> str:
    return " ".join(str(x) for x in xs)


def count_up(r: random.Random) -> Task:
    a = r.randint(0, 80)
    b = a + r.randint(4, 19)
    return f"Count from {a} to {b}.", f"Counting from {a} to {b}: {_nums(range(a, b + 1))}. Done."


def count_down(r: random.Random) -> Task:
    b = r.randint(10, 99)
    a = max(0, b - r.randint(4, 15))
    return f"Count down from {b} to {a}.", f"Counting down: {_nums(range(b, a - 1, -1))}. Done."


def progression(r: random.Random) -> Task:
    d, a, n = r.randint(2, 5), r.randint(0, 30), r.randint(4, 8)
    seq = [a + d * i for i in range(n + 3)]
    return (
        f"Continue the sequence {_nums(seq[:3])} for {n} more terms.",
        f"The step is {d}, so the next terms are {_nums(seq[3:])}.",
    )


def multiples(r: random.Random) -> Task:
    k, n = r.randint(2, 9), r.randint(5, 10)
    return (
        f"List the first {n} multiples of {k}.",
        f"The multiples of {k} are {_nums(k * i for i in range(1, n + 1))}.",
    )


def copy_list(r: random.Random) -> Task:
    xs = r.sample(WORDS, r.randint(3, 8))
    return f"Repeat after me: {' '.join(xs)}", f"You said: {' '.join(xs)}."


def reverse_list(r: random.Random) -> Task:
    xs = r.sample(WORDS, r.randint(3, 7))
    return f"Reverse the list: {' '.join(xs)}", f"Reversed: {' '.join(reversed(xs))}."


def repeat_phrase(r: random.Random) -> Task:
    p, n = r.choice(PHRASES), r.randint(2, 5)
    return f"Say '{p}' {n} times.", f"Here it is: {', '.join([p] * n)}."


def lookup(r: random.Random) -> Task:
    keys = r.sample(KEYS, r.randint(3, 5))
    vals = {k: r.choice(WORDS) for k in keys}
    q = r.choice(keys)
    facts = ", ".join(f"{k} is {v}" for k, v in vals.items())
    return f"Remember: {facts}. What is {q}?", f"You told me that {q} is {vals[q]}."


def spell(r: random.Random) -> Task:
    w = r.choice([w for w in WORDS if len(w) >= 4])
    return f"Spell the word {w}.", f"The word {w} is spelled {'-'.join(w)}."


TASKS: dict[str, Callable[[random.Random], Task]] = {
    f.__name__: f
    for f in (
        count_up,
        count_down,
        progression,
        multiples,
        copy_list,
        reverse_list,
        repeat_phrase,
        lookup,
        spell,
    )
}


def conversation(r: random.Random, *, two_turns: float = 0.3, system: float = 0.2):
    """A chat with one or two user/assistant turns; returns (messages, task names)."""
    messages, names = [], []
    if r.random() < system:
        messages.append({"role": "system", "content": SYSTEM})
    for _ in range(2 if r.random() < two_turns else 1):
        name = r.choice(sorted(TASKS))
        user, reply = TASKS[name](r)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        names.append(name)
    return messages, names


def prompt(r: random.Random, name: str | None = None) -> tuple[list[dict], str, str]:
    """A one-turn eval prompt: (messages with the user turn only, task name, reference reply)."""
    name = name or r.choice(sorted(TASKS))
    user, reply = TASKS[name](r)
    return [{"role": "user", "content": user}], name, reply


# ----------------------------------------------------------------------------- tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE trained on `texts`, ChatML specials, `<|MASK|>`, eos = `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------- model

HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention"] * 2


def build_model(kind: str, tokenizer, seed: int) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    rows = math.ceil(len(tokenizer) / 64) * 64  # a padded vocab, like real checkpoints
    ids = dict(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    common = dict(
        vocab_size=rows,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        **ids,
    )
    torch.manual_seed(seed)
    if kind == "dense":
        config = Qwen3Config(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=6,
            num_attention_heads=4,
            **common,
        )
        return Qwen3ForCausalLM(config)
    if kind == "hybrid":
        config = Qwen3_5TextConfig(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=6,
            num_attention_heads=4,
            layer_types=HYBRID_LAYERS,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            **common,
        )
        model = Qwen3_5ForCausalLM(config)
        force_torch_fallback_off_gpu(model)  # tiny builds run on CPU, even where triton exists
        return model
    raise ValueError(f"--kind must be dense or hybrid, not {kind!r}")


# ----------------------------------------------------------------------------- training


def say(msg: str) -> None:
    print(f"[tiny] {msg}", file=sys.stderr, flush=True)


def train(
    model,
    examples: list[Example],
    *,
    steps: int,
    seed: int,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 3e-3,
) -> float:
    """Next-token CE on assistant tokens of packed rows, AdamW, warmup + cosine. Returns the
    final loss (mean over the last 10% of steps).

    Rows are fed as plain causal text (positions 0..S-1, no per-document mask), like LM
    pretraining: it wastes nothing on padding, and it works for linear attention on CPU,
    where the torch fallback can't keep packed documents apart."""
    stream = BatchStream(examples, batch_size=batch_size, seq_len=seq_len, pack=True, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    tail, t0 = [], time.time()
    for step in range(steps):
        b = stream.next_batch()
        target = b.loss_mask[:, 1:]
        logits = model(input_ids=b.input_ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[target].float(), b.input_ids[:, 1:][target])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step >= steps - max(1, steps // 10):
            tail.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------- greedy replies


@torch.no_grad()
def greedy_replies(
    model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int = 128
) -> tuple[list[str], int]:
    """Greedy assistant reply to each chat, in left-padded batches of similar length.
    Returns (replies, how many hit max_new_tokens without an end-of-turn token)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    replies: list[str] = [""] * len(prompts)
    unfinished = 0
    for k in range(0, len(order), batch_size):
        chunk = order[k : k + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            attn[row, width - len(encoded[i]) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for i, row in zip(chunk, out[:, width:].tolist(), strict=True):
            if eos in row:
                row = row[: row.index(eos)]
            else:
                unfinished += 1
            replies[i] = tokenizer.decode(row, skip_special_tokens=True)
    return replies, unfinished


def regenerate(model, tokenizer, convs: list[list[dict]], max_new_tokens: int) -> int:
    """Replace every assistant turn, turn by turn, with the model's greedy reply (in place)."""
    unfinished, turn = 0, 0
    while True:
        todo = []  # (conversation, index of its `turn`-th assistant message)
        for conv in convs:
            at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if turn < len(at):
                todo.append((conv, at[turn]))
        if not todo:
            return unfinished
        replies, n = greedy_replies(
            model, tokenizer, [c[:i] for c, i in todo], max_new_tokens=max_new_tokens
        )
        for (conv, i), reply in zip(todo, replies, strict=True):
            conv[i] = {"role": "assistant", "content": reply}
        unfinished += n
        say(f"assistant turn {turn + 1}: the model's own greedy reply replaced the scripted one "
            f"in {len(todo)} conversations")  # fmt: skip
        turn += 1


def pattern_accuracy(model, tokenizer, r: random.Random, n: int = 90) -> dict[str, float]:
    """Exact-match rate of greedy replies against the task's reference reply, per task."""
    items = [prompt(r, name) for name in sorted(TASKS) for _ in range(n // len(TASKS))]
    replies, _ = greedy_replies(model, tokenizer, [m for m, _, _ in items], max_new_tokens=96)
    hits: dict[str, list[int]] = {}
    for (_, name, ref), got in zip(items, replies, strict=True):
        hits.setdefault(name, []).append(int(got == ref))
    return {k: sum(v) / len(v) for k, v in hits.items()}


# ----------------------------------------------------------------------------- outputs

DEFAULT_STEPS = {"dense": 600, "hybrid": 300}
TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "runs" / "tiny.yaml"


def run_config(out: Path, kind: str, tokenizer, num_layers: int, seed: int) -> dict:
    """templates/runs/tiny.yaml (or a built-in equivalent) pointed at this build."""
    if TEMPLATE.is_file():
        cfg = yaml.safe_load(TEMPLATE.read_text()) or {}
    else:
        cfg = {
            "drafter": {"num_layers": 1, "block_size": 8},
            "data": {"max_length": 256, "pack": False, "num_anchors": 32},
            "optim": {"lr": 1.0e-3, "warmup_ratio": 0.05, "batch_size": 8, "max_steps": 300},
            "log": {"log_every": 10},
            "checkpoint": {"every": 100, "keep_last": 2},
        }
    cfg.setdefault("target", {})["path"] = str(out / "target")
    cfg.setdefault("data", {})["path"] = str(out / "data.jsonl")
    cfg["data"]["seed"] = seed
    drafter = cfg.setdefault("drafter", {})
    drafter["mask_token_id"] = tokenizer.convert_tokens_to_ids("<|MASK|>")
    if not drafter.get("target_layer_ids"):
        drafter["target_layer_ids"] = [1, 2, num_layers - 3]
    cfg["seed"] = seed
    if kind == "hybrid":  # the torch GDN fallback can't keep packed documents apart
        cfg["data"]["pack"] = False
    return cfg


def _write_jsonl(path: Path, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def build(
    out: str | os.PathLike,
    *,
    kind: str = "dense",
    steps: int | None = None,
    seed: int = 0,
    conversations: int = 3000,
    prompts: int = 64,
    regenerate_replies: bool = True,
    threads: int = 1,
) -> dict:
    """Build the tiny target, data and run config under `out`; returns a summary (also written
    to out/tiny.json). One torch thread by default: a model this small gains little from two,
    and on shared cores two threads run up to 30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _build(Path(out), kind, steps, seed, conversations, prompts, regenerate_replies)
    finally:
        torch.set_num_threads(before)


def make_corpus(seed: int, conversations: int, prompts: int) -> tuple[list, list[dict]]:
    """Training conversations, and eval prompts (held out from them where the task allows)."""
    r = random.Random(seed)
    convs = [conversation(r)[0] for _ in range(conversations)]
    seen = {m["content"] for c in convs for m in c if m["role"] == "user"}
    pr = random.Random(seed + 1)
    evals: list[dict] = []
    for k in range(prompts):
        # tasks with few distinct prompts (phrases, spelling) may have none left unseen
        for _ in range(50):
            messages, name, ref = prompt(pr, sorted(TASKS)[k % len(TASKS)])
            if messages[0]["content"] not in seen:
                break
        evals.append({"messages": messages, "task": name, "reference": ref})
    return convs, evals


def write_outputs(out: Path, kind: str, model, tokenizer, convs, evals, seed: int) -> None:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out / "target")
    tokenizer.save_pretrained(out / "target")
    _write_jsonl(out / "data.jsonl", ({"messages": c} for c in convs))
    _write_jsonl(out / "prompts.jsonl", evals)
    cfg = run_config(out, kind, tokenizer, model.config.num_hidden_layers, seed)
    (out / RUN_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))


def _build(out: Path, kind: str, steps: int | None, seed: int, conversations: int,
           prompts: int, regenerate_replies: bool) -> dict:  # fmt: skip
    t0 = time.time()
    out = out.resolve()
    (out / "target").mkdir(parents=True, exist_ok=True)
    steps = DEFAULT_STEPS[kind] if steps is None else steps
    random.seed(seed)
    torch.manual_seed(seed)
    convs, evals = make_corpus(seed, conversations, prompts)
    tokenizer = build_tokenizer([chatml(c) for c in convs], vocab_size=1024)
    say(f"tokenizer: {len(tokenizer)} tokens, <|MASK|> = {tokenizer.mask_token_id}")
    model = build_model(kind, tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"{kind} model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters")
    examples = [render_chat(tokenizer, c, max_length=512) for c in convs]
    t1 = time.time()
    loss = train(model, examples, steps=steps, seed=seed)
    train_s = time.time() - t1
    tail = max(1, steps // 10)
    say(f"trained {steps} steps in {train_s:.0f}s; loss {loss:.4f}, the mean over the last "
        f"{tail} steps (a single step's loss varies with its batch)")  # fmt: skip
    acc = pattern_accuracy(model, tokenizer, random.Random(seed + 2))
    say("greedy exact match: " + ", ".join(f"{k} {v:.2f}" for k, v in acc.items()))
    unfinished, t2 = 0, time.time()
    if regenerate_replies:
        say(
            "replacing the scripted replies with the model's own (the drafter learns the "
            "target's greedy output, as with real data regenerated by the target)"
        )
        longest = max(sum(e.loss_mask) for e in examples)
        unfinished = regenerate(model, tokenizer, convs, max_new_tokens=longest + longest // 4)
    regen_s = time.time() - t2
    write_outputs(out, kind, model, tokenizer, convs, evals, seed)
    summary = {
        "kind": kind, "steps": steps, "seed": seed, "final_loss": round(loss, 4),
        "exact_match": acc, "params": n_params, "conversations": len(convs),
        "regenerated": regenerate_replies, "unfinished_replies": unfinished,
        "train_seconds": round(train_s, 1), "regenerate_seconds": round(regen_s, 1),
        "build_seconds": round(time.time() - t0, 1),
    }  # fmt: skip
    (out / "tiny.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"wrote {out} in {summary['build_seconds']}s")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.tiny", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--kind", choices=("dense", "hybrid"), default="dense")
    p.add_argument(
        "--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--no-regenerate",
        action="store_true",
        help="keep the synthetic replies instead of the target's greedy ones",
    )
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # lines, not a tqdm bar's carriage returns, in logs
    build(
        a.out,
        kind=a.kind,
        steps=a.steps,
        seed=a.seed,
        conversations=a.conversations,
        prompts=a.prompts,
        regenerate_replies=not a.no_regenerate,
        threads=a.threads,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
