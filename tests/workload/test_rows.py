"""Rows as served: every assistant turn is trained on the prompt it is served with, with the
tokens the target writes after it, under templates with the semantics of the real thinking
templates (our own text: reasoning dropped from earlier turns, thinking on and off,
preserve_thinking, Qwen3-8B's bare generation prompt) and plain ChatML."""

from __future__ import annotations

import copy
import json

import pytest

from workload.data.chat import PAST_MAX_LENGTH, Example, render_rows, rows_of_record
from workload.data.source import open_source
from workload.data.token_store import RenderSettings, build, report_line

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
    ],
    "two turns, no reasoning": [
        SYSTEM,
        _user("Count from 3 to 6."),
        _reply("3 4 5 6"),
        _user("And back?"),
        _reply("6 5 4 3"),
    ],
    "three turns, mixed": [
        SYSTEM,
        _user("Name a cat."),
        _reply("Tom", "a short name"),
        _user("And a dog?"),
        _reply("Rex"),
        _user("And a bird?"),
        _reply("Tweety", "", inline=True),
    ],
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


# ----------------------------------------------------------------------------- Qwen3.6


# A Qwen3.6-like template, our own text with the public template's semantics
# (shared/reference/chat-templates.md): system first; `reasoning_content` when it is a string,
# else a think block at the start of the content; reasoning kept for the turns after the last
# user query (a tool response is no query), or for every turn with preserve_thinking (an empty
# block for a turn with none); the generation prompt opens a think block, or writes an empty one
# with enable_thinking false.
QWEN36_LIKE = r"""
{%- set ns = namespace(query=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}
    {%- set ns.query = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- set text = m.content if m.content is string else '' -%}
  {%- if m.role == 'assistant' -%}
    {%- if m.reasoning_content is string -%}
      {%- set thought = m.reasoning_content -%}
    {%- elif '</think>' in text -%}
      {%- set thought = text.split('</think>')[0].split('<think>')[-1] -%}
      {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
    {%- else -%}
      {%- set thought = '' -%}
    {%- endif -%}
    {%- if preserve_thinking is true or loop.index0 > ns.query -%}
      {{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + text -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + text -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}
  {%- else -%}{{- '<think>\n' -}}{%- endif -%}
{%- endif -%}
"""

QWEN36_SETTINGS = {
    "thinking": {},
    "no thinking": {"enable_thinking": False},
    "preserve_thinking": {"preserve_thinking": True},
    "no thinking, preserve_thinking": {"enable_thinking": False, "preserve_thinking": True},
}

MIXED = {
    **CONVERSATIONS,
    "reasoning second only": [
        _user("Say hi."),
        _reply("hi"),
        _user("Count from 3 to 6."),
        _reply("3 4 5 6", "count up"),
    ],
    "reasoning second only, think block": [
        _user("Say hi."),
        _reply("hi"),
        _user("Count from 3 to 6."),
        _reply("3 4 5 6", "count up", inline=True),
    ],
    "empty reasoning, then reasoning": [
        SYSTEM,
        _user("Say hi."),
        _reply("hi", ""),
        _user("And back?"),
        _reply("ih", "reverse"),
    ],
    "reasoning first only": [
        _user("Count from 3 to 6."),
        _reply("3 4 5 6", "count up"),
        _user("Say hi."),
        _reply("hi"),
    ],
    "four turns, mixed": [
        _user("Say hi."),
        _reply("hi"),
        _user("Name a cat."),
        _reply("Tom", "a short name", inline=True),
        _user("Say bye."),
        _reply("bye", ""),
        _user("And a dog?"),
        _reply("Rex", "short too"),
    ],
}


def qwen36_reply(kwargs: dict, message: dict) -> str:
    """What the target writes after the Qwen3.6 serving prompt, stated by hand."""
    reasoning, answer = message.get("reasoning_content"), message["content"]
    if reasoning is None and "</think>" in answer:
        reasoning, answer = _reasoning_and_answer(message)
    if kwargs.get("enable_thinking") is False:
        return answer + "<|im_end|>"
    return f"{(reasoning or '').strip(chr(10))}\n</think>\n\n{answer}<|im_end|>"


def own_spans(tok, rows, messages, template, kwargs, expected) -> list[int]:
    """The assistant turns whose reply a supervised span holds, after their own serving prompt,
    in order; AssertionError for a span that holds anything else."""
    spans = [(row, span) for row in rows for span in _supervised_spans(row)]
    placed = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or len(placed) == len(spans):
            continue
        row, (start, end) = spans[len(placed)]
        served = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                         chat_template=template, **kwargs)  # fmt: skip
        if (tok.decode(row.input_ids[:start]), tok.decode(row.input_ids[start:end])) == (
            served, expected(kwargs, m)
        ):  # fmt: skip
            placed.append(i)
    assert len(placed) == len(spans), "a supervised span is not a turn's own reply after its prompt"
    return placed


@pytest.mark.parametrize("setting", QWEN36_SETTINGS)
@pytest.mark.parametrize("name", MIXED)
def test_qwen36_every_span_is_the_turns_own_reply_after_its_own_prompt(
    thinking_tokenizer, setting, name
):  # fmt: skip
    """Thinking on and off, preserve_thinking, reasoning as reasoning_content and as think
    blocks, turns with and without it: every supervised span is a turn's own reply after its
    own serving prompt, or the turn is counted unplaced with its reason (here none need be)."""
    tok, kwargs, messages = thinking_tokenizer, QWEN36_SETTINGS[setting], MIXED[name]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    r = render_rows(tok, messages, max_length=4096, chat_template=QWEN36_LIKE,
                    template_kwargs=kwargs)  # fmt: skip
    placed = own_spans(tok, r.rows, messages, QWEN36_LIKE, kwargs, qwen36_reply)
    assert r.turns == len(placed) and len(placed) + len(r.unplaced) == len(turns)
    assert placed == turns and not r.unplaced


def test_an_earlier_empty_think_block_is_never_taken_for_a_later_reply(chat_tokenizer):
    """Issue 32, item 1: thinking off with preserve_thinking, a first reply without reasoning
    and a second with some: the second turn's reply is its own ("3 4 5 6", its reasoning
    dropped as the prompt closes it), never the first's trained again after the second prompt."""
    tok = _tokenizer(chat_tokenizer, False)
    kwargs = QWEN36_SETTINGS["no thinking, preserve_thinking"]
    for name in ("reasoning second only", "reasoning second only, think block"):
        r = render_rows(tok, MIXED[name], max_length=4096, chat_template=QWEN36_LIKE,
                        template_kwargs=kwargs)  # fmt: skip
        replies = [tok.decode(row.input_ids[a:b]) for row in r.rows
                   for a, b in _supervised_spans(row)]  # fmt: skip
        assert replies == ["hi<|im_end|>", "3 4 5 6<|im_end|>"], name
        assert (r.turns, r.no_reasoning, r.unplaced) == (2, 1, [])


def test_a_reply_not_provably_the_turns_own_is_left_out_with_its_reason(chat_tokenizer):
    """A template that rewrites earlier text (no prompt is a prefix of the next render) and
    renders a reply other than the turn's own at the end: the turn is counted unplaced, with
    its reason, not trained on a guess."""
    tok = _tokenizer(chat_tokenizer, False)
    swaps = ("{{ messages|length }} messages\n" + QWEN36_LIKE).replace(
        "+ text -}}", "+ text|replace('3 4 5 6', 'hi') -}}"
    )
    r = render_rows(tok, MIXED["reasoning second only"], max_length=4096, chat_template=swaps,
                    template_kwargs=QWEN36_SETTINGS["no thinking, preserve_thinking"])  # fmt: skip
    assert r.turns == 1 and len(r.unplaced) == 1
    assert "not provably its own reply" in r.unplaced[0]
    ((start, end),) = _supervised_spans(r.rows[0])
    assert tok.decode(r.rows[0].input_ids[start:end]) == "hi<|im_end|>"


# ----------------------------------------------------------------------------- max_length


def _served(tok, messages, i, template=None, kwargs=None):
    text = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                   chat_template=template, **(kwargs or {}))  # fmt: skip
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_turn_past_max_length_is_counted_cut_never_placed_silently(chat_tokenizer):
    """Issue 32, item 2: a merged row cut at max_length: the turns past it are counted (cut,
    left out) with the supervised tokens lost, not counted as placed."""
    tok, messages = chat_tokenizer, CONVERSATIONS["two turns, no reasoning"]
    full = render_rows(tok, messages, max_length=4096)
    ((row,),) = (full.rows,)
    second = _supervised_spans(row)[1]
    reply2 = second[1] - second[0]
    # the second prompt fills max_length: that turn is left out, counted, its reply lost
    gone = render_rows(tok, messages, max_length=_served(tok, messages, 4))
    assert gone.turns == 1 and gone.unplaced == [PAST_MAX_LENGTH]
    assert (gone.length_cut, gone.lost) == (0, reply2)
    assert [tok.decode(gone.rows[0].input_ids[a:b]) for a, b in
            _supervised_spans(gone.rows[0])] == ["3 4 5 6<|im_end|>"]  # fmt: skip
    # the second prompt fits, 2 tokens of its reply do: trained up to the cut, counted
    cut = render_rows(tok, messages, max_length=second[0] + 2)
    assert (cut.turns, cut.length_cut, cut.lost, cut.unplaced) == (2, 1, reply2 - 2, [])
    assert cut.rows[0].truncated and sum(cut.rows[0].loss_mask) == sum(row.loss_mask) - reply2 + 2


def test_a_turn_that_does_not_fit_its_row_starts_its_own(chat_tokenizer):
    """Thinking on (earlier reasoning dropped from later prompts): a first turn with a long
    reasoning is cut at max_length; the second, whose own prompt is short, is trained whole in
    a row of its own."""
    tok = _tokenizer(chat_tokenizer, False)
    messages = [_user("Count."), _reply("1 2 3", " ".join(["think"] * 80)),
                _user("Again?"), _reply("4 5 6")]  # fmt: skip
    limit = _served(tok, messages, 1, QWEN36_LIKE) + 40
    r = render_rows(tok, messages, max_length=limit, chat_template=QWEN36_LIKE)
    assert len(r.rows) == 2 and (r.turns, r.length_cut, r.unplaced) == (2, 1, [])
    assert r.rows[0].truncated and len(r.rows[0].input_ids) == limit and r.lost > 0
    assert not r.rows[1].truncated
    ((a, b),) = _supervised_spans(r.rows[1])
    assert tok.decode(r.rows[1].input_ids[a:b]).endswith("4 5 6<|im_end|>")


def test_a_datagen_record_past_max_length_is_counted(chat_tokenizer):
    """The engine's own tokens (rows_of_record) go through the same rows: a turn past
    max_length is counted, never placed silently."""
    tok = chat_tokenizer
    p1 = tok("<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n",
             add_special_tokens=False)["input_ids"]  # fmt: skip
    r1 = tok("1 2 3<|im_end|>", add_special_tokens=False)["input_ids"]
    p2 = p1 + r1 + tok("\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n",
                       add_special_tokens=False)["input_ids"]  # fmt: skip
    r2 = tok("4 5 6 7 8 9<|im_end|>", add_special_tokens=False)["input_ids"]
    turns = [{"prompt_ids": p, "reply_ids": r, "finish_reason": "stop"}
             for p, r in ((p1, r1), (p2, r2))]  # fmt: skip
    gone = rows_of_record(turns, len(p2))
    assert gone.turns == 1 and gone.unplaced == [PAST_MAX_LENGTH]
    assert gone.lost == len(r2) and gone.rows[0].input_ids == p1 + r1
    cut = rows_of_record(turns, len(p2) + 1)
    assert (cut.turns, cut.length_cut, cut.lost) == (2, 1, len(r2) - 1)
    whole = rows_of_record(turns, 4096)
    assert (whole.turns, whole.lost, len(whole.rows)) == (2, 0, 1)


def test_the_store_reports_what_max_length_lost(chat_tokenizer, tmp_path):
    """The store's header and report line: turns cut and left out past max_length, and the
    share of the supervised tokens lost."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS.values()))
    messages = CONVERSATIONS["two turns, no reasoning"]
    limit = _served(chat_tokenizer, messages, 4)
    header = build(open_source(data), chat_tokenizer, RenderSettings(limit), tmp_path / "store",
                   key="k", digests={"source": "s", "tokenizer": "t"}, say=lambda m: None)  # fmt: skip
    whole = build(open_source(data), chat_tokenizer, RenderSettings(4096), tmp_path / "whole",
                  key="k", digests={"source": "s", "tokenizer": "t"}, say=lambda m: None)  # fmt: skip
    past = header["unplaced"].get(PAST_MAX_LENGTH, 0)
    assert past >= 1 and header["turns"] + past == whole["turns"]
    assert header["supervised"] + header["supervised_lost"] == whole["supervised"]
    assert whole["supervised_lost"] == 0 and whole["length_cut"] == 0
    share = header["supervised_lost"] / whole["supervised"]
    assert f"left out past it: {share:.1%} of the supervised tokens lost" in report_line(header)
    assert f"max_length {limit}" in report_line(header)
