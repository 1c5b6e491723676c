"""Rows as served: every assistant turn is trained on the prompt it is served with, with the
tokens the target writes after it, under templates with the semantics of the real thinking
templates (our own text: reasoning dropped from earlier turns, thinking on and off,
preserve_thinking, Qwen3-8B's bare generation prompt) and plain ChatML."""

from __future__ import annotations

import copy
import json

import pytest

from workload.data.chat import Example, render_rows, rows_of_record
from workload.data.source import open_source
from workload.data.token_store import RenderSettings, build

# A Qwen3.5/3.6-like template: reasoning from `reasoning_content` or a think block in the content;
# kept only for assistant turns after the last user turn (or all, with preserve_thinking); the
# generation prompt opens a think block (thinking on) or writes an empty one (thinking off).
_BODY = r"""
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- set said = m.content or '' -%}
    {%- set thought = m.reasoning_content or '' -%}
    {%- if '</think>' in said -%}
      {%- set thought = said.split('</think>')[0].split('<think>')[-1] -%}
      {%- set said = said.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last or preserve_thinking is true -%}
      {{- '<think>\n' + thought.strip('\n') + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- said + '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
"""
QWEN35_LIKE = (
    _BODY
    + r"""
{%- if add_generation_prompt -%}
  {%- if enable_thinking is false -%}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' -}}
  {%- else -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}
{%- endif -%}
"""
)
# Qwen3-8B-like: the same history, but thinking on the generation prompt is the bare header:
# the target writes `<think>` itself.
QWEN3_LIKE = (
    _BODY
    + r"""
{%- if add_generation_prompt -%}
  {%- if enable_thinking is false -%}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' -}}
  {%- else -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
{%- endif -%}
"""
)

SYSTEM = {"role": "system", "content": "You are terse."}


def _user(text):
    return {"role": "user", "content": text}


def _reply(answer, reasoning=None, inline=False):
    if reasoning is None:
        return {"role": "assistant", "content": answer}
    if inline:
        return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning}


CONVERSATIONS = {
    "one turn, reasoning": [_user("Count from 3 to 6."), _reply("3 4 5 6", "count up")],
    "one turn, empty reasoning": [_user("Say hi."), _reply("hi", "")],
    "one turn, no reasoning": [_user("Say hi."), _reply("hi")],
    "two turns, reasoning": [
        _user("Count from 3 to 6."),
        _reply("3 4 5 6", "count up by one"),
        _user("And back?"),
        _reply("6 5 4 3", "reverse it", inline=True),
    ],  # fmt: skip
    "two turns, no reasoning": [
        SYSTEM,
        _user("Count from 3 to 6."),
        _reply("3 4 5 6"),
        _user("And back?"),
        _reply("6 5 4 3"),
    ],  # fmt: skip
    "three turns, mixed": [
        SYSTEM,
        _user("Name a cat."),
        _reply("Tom", "a short name"),
        _user("And a dog?"),
        _reply("Rex"),
        _user("And a bird?"),
        _reply("Tweety", "", inline=True),
    ],  # fmt: skip
}

# (template, its kwargs): how the target is served
SETTINGS = {
    "chatml": (None, {}),
    "qwen35 thinking": (QWEN35_LIKE, {}),
    "qwen35 no thinking": (QWEN35_LIKE, {"enable_thinking": False}),
    "qwen36 preserve_thinking": (QWEN35_LIKE, {"preserve_thinking": True}),
    "qwen3 thinking": (QWEN3_LIKE, {}),
    "qwen3 no thinking": (QWEN3_LIKE, {"enable_thinking": False}),
}


def _reasoning_and_answer(message):
    content = message["content"]
    if "</think>" in content:
        head, answer = content.split("</think>")
        return head.replace("<think>", "").strip("\n"), answer.lstrip("\n")
    return message.get("reasoning_content"), content


def expected_reply(setting: str, message: dict) -> str:
    """What the target writes after the serving prompt, stated by hand for each setting."""
    reasoning, answer = _reasoning_and_answer(message)
    if setting == "chatml":
        return message["content"] + "<|im_end|>"
    if "no thinking" in setting:
        return answer + "<|im_end|>"
    body = f"{reasoning or ''}\n</think>\n\n{answer}<|im_end|>"
    return (
        "<think>\n" + body if setting.startswith("qwen3 ") else body
    )  # Qwen3-8B: the target opens it


def _tokenizer(chat_tokenizer, one_token_blank_line: bool):
    tok = copy.deepcopy(chat_tokenizer)
    tok.add_tokens(["<think>", "</think>"] + (["\n\n"] if one_token_blank_line else []))
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["bpe", "blank-line-one-token"])
def thinking_tokenizer(chat_tokenizer, request):
    return _tokenizer(chat_tokenizer, request.param)


def _supervised_spans(row: Example) -> list[tuple[int, int]]:
    spans, start = [], None
    for j, m in enumerate([*row.loss_mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_every_turn_is_trained_on_its_serving_prompt(thinking_tokenizer, setting, name):
    tok, (template, kwargs) = thinking_tokenizer, SETTINGS[setting]
    messages = CONVERSATIONS[name]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    r = render_rows(tok, messages, max_length=4096, chat_template=template,
                    template_kwargs=kwargs)  # fmt: skip
    assert not r.unplaced and r.turns == len(turns)
    spans = [(row, span) for row in r.rows for span in _supervised_spans(row)]
    assert len(spans) == len(turns)
    for i, (row, (start, end)) in zip(turns, spans, strict=True):
        served = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                         chat_template=template, **kwargs)  # fmt: skip
        assert tok.decode(row.input_ids[:start]) == served
        assert tok.decode(row.input_ids[start:end]) == expected_reply(setting, messages[i])
        assert row.input_ids[end - 1] == tok.convert_tokens_to_ids("<|im_end|>")
    # one row supervises every turn where each prompt extends the one before (as tokens: with
    # `\n\n` one token, an empty think block the target wrote as `\n` `\n` is re-tokenized
    # in the next prompt, so that turn needs a row of its own)
    blank_token = len(tok("\n\n", add_special_tokens=False)["input_ids"]) == 1
    empty = any(_reasoning_and_answer(messages[i])[0] in ("", None) for i in turns[:-1])
    preserved = setting == "qwen36 preserve_thinking" and not (blank_token and empty)
    if setting == "chatml" or len(turns) == 1 or preserved:
        assert len(r.rows) == 1
    elif setting != "qwen3 no thinking" and "reasoning" in name and "no reasoning" not in name:
        assert len(r.rows) == len(turns)  # earlier reasoning dropped: a row per turn


def test_a_blank_line_token_does_not_misplace_empty_reasoning(chat_tokenizer):
    tok = _tokenizer(chat_tokenizer, True)
    assert len(tok("<think>\n\n</think>", add_special_tokens=False)["input_ids"]) == 3
    r = render_rows(tok, CONVERSATIONS["one turn, empty reasoning"], max_length=512,
                    chat_template=QWEN35_LIKE)  # fmt: skip
    (row,) = r.rows
    start = row.loss_mask.index(1)
    # the prompt ends with `<think>\n`; the target writes `\n</think>` after it
    assert tok.decode(row.input_ids[start:]) == "\n</think>\n\nhi<|im_end|>"


def test_a_cut_reply_never_trains_an_end_token(chat_tokenizer):
    tok = chat_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok("<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]  # fmt: skip
    reply = tok("1 2 3 4", add_special_tokens=False)["input_ids"]
    turns = [{"prompt_ids": prompt, "reply_ids": reply, "finish_reason": "length"}]
    r = rows_of_record(turns, 512)
    (row,) = r.rows
    assert r.cut == 1 and row.cut
    assert row.input_ids == prompt + reply
    assert end not in [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert row.loss_mask == [0] * len(prompt) + [1] * len(reply)
    stopped = [{"prompt_ids": prompt, "reply_ids": [*reply, end], "finish_reason": "stop"}]
    assert rows_of_record(stopped, 512).rows[0].input_ids[-1] == end


def test_a_turn_that_cannot_be_placed_is_counted_not_fatal(chat_tokenizer, tmp_path):
    # A template that refuses a second assistant turn: the build goes on, the report says why.
    refuses = ("{%- if messages|selectattr('role', 'equalto', 'assistant')|list|length > 1 -%}"
               "{{ raise_exception('one assistant turn only') }}{%- endif -%}"
               + chat_tokenizer.chat_template)  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS.values()))
    source = open_source(data)
    header = build(source, chat_tokenizer, RenderSettings(512, refuses), tmp_path / "store",
                   key="k", digests={"source": "s", "tokenizer": "t"}, say=lambda m: None)  # fmt: skip
    assert header["conversations_read"] == len(CONVERSATIONS)
    assert header["turns"] == len(CONVERSATIONS)  # the first turn of each still trains
    (reason,) = header["unplaced"]
    assert "one assistant turn only" in reason
    assert sum(header["unplaced"].values()) == sum(
        sum(m["role"] == "assistant" for m in c) - 1 for c in CONVERSATIONS.values()
    )
    assert header["unplaced_examples"][0].startswith(f"{data}:4: ")


def test_inspect_data_json_prints_the_trainers_rows(chat_tokenizer, tiny_dense, tmp_path, capsys):
    """`inspect_data --json`: every row one JSON line, its source, ids and supervised mask; a
    multi-turn conversation under a template that drops earlier reasoning gives a row a turn."""
    import yaml
    from transformers import AutoTokenizer

    from workload.data.inspect_rows import main

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS.values()))
    cfg = yaml.safe_load((tiny_dense / "run.yaml").read_text())
    cfg["data"].update(path=str(data), chat_template=QWEN35_LIKE, max_length=512)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "run.yaml"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok = AutoTokenizer.from_pretrained(cfg["target"]["path"])
    want = render_rows(tok, CONVERSATIONS["two turns, reasoning"], max_length=512,
                       chat_template=QWEN35_LIKE).rows  # fmt: skip
    fourth = [r for r in rows if r["source"] == f"{data}:4"]
    assert [(r["ids"], r["supervised"]) for r in fourth] == [
        (w.input_ids, w.loss_mask) for w in want
    ]
    assert len(fourth) == 2 and len(rows) == 10  # a row per turn: 1 + 1 + 1 + 2 + 2 + 3
