"""Chat rendering and loss masks, loading errors, batch streams, anchor sampling."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from workload.data.batches import (
    Batch,
    BatchStream,
    eligible_anchors,
    pack_documents,
    sample_anchors,
)
from workload.data.chat import DataError, Example, load_examples, render_chat, render_rows

TWO_TURNS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Count from 3 to 6."},
    {"role": "assistant", "content": "Counting from 3 to 6: 3 4 5 6. Done."},
    {"role": "user", "content": "Say 'well done' 2 times."},
    {"role": "assistant", "content": "Here it is: well done, well done."},
]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- loss mask


def test_loss_mask_is_exactly_the_assistant_replies(chat_tokenizer):
    tok = chat_tokenizer
    assert "{% generation" not in tok.chat_template and "{%- generation" not in tok.chat_template
    # Hand-rendered ChatML, split where supervision starts and stops.
    pieces = [
        ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", 0),
        ("<|im_start|>user\nCount from 3 to 6.<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Counting from 3 to 6: 3 4 5 6. Done.<|im_end|>", 1),
        ("\n<|im_start|>user\nSay 'well done' 2 times.<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Here it is: well done, well done.<|im_end|>", 1),
    ]  # the row ends with the last reply's end token: nothing after it is served
    want_ids, want_mask = [], []
    for text, m in pieces:
        ids = _ids(tok, text)
        want_ids += ids
        want_mask += [m] * len(ids)
    ex = render_chat(tok, TWO_TURNS, max_length=1000)
    assert ex.input_ids == want_ids
    assert ex.loss_mask == want_mask
    assert not ex.truncated
    supervised = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    assert tok.decode(supervised) == (
        "Counting from 3 to 6: 3 4 5 6. Done.<|im_end|>Here it is: well done, well done.<|im_end|>"
    )


def test_generation_prompt_tokens_are_not_supervised(chat_tokenizer):
    tok = chat_tokenizer
    ex = render_chat(tok, TWO_TURNS[:3], max_length=1000)
    header = _ids(tok, "<|im_start|>assistant\n")
    n = len(_ids(tok, tok.apply_chat_template(TWO_TURNS[:2], tokenize=False,
                                               add_generation_prompt=True)))  # fmt: skip
    assert ex.input_ids[n - len(header) : n] == header
    assert ex.loss_mask[:n] == [0] * n
    assert ex.loss_mask[n] == 1
    assert ex.input_ids[-1] == tok.eos_token_id and ex.loss_mask[-1] == 1


def test_template_that_rewrites_earlier_text(chat_tokenizer):
    # A template whose first line counts the messages: no turn's prompt starts with the row of
    # the turn before, so each turn is a row of its own, on exactly its own serving prompt.
    tmpl = "{{ messages|length }} messages\n" + chat_tokenizer.chat_template
    r = render_rows(chat_tokenizer, TWO_TURNS, max_length=1000, chat_template=tmpl)
    assert not r.unplaced and r.turns == 2 and len(r.rows) == 2
    for row, i in zip(r.rows, (2, 4), strict=True):
        prompt = chat_tokenizer.apply_chat_template(TWO_TURNS[:i], tokenize=False,
                                                    add_generation_prompt=True, chat_template=tmpl)  # fmt: skip
        n = row.loss_mask.index(1)
        assert chat_tokenizer.decode(row.input_ids[:n]) == prompt
        assert chat_tokenizer.decode(row.input_ids[n:]) == TWO_TURNS[i]["content"] + "<|im_end|>"
    with pytest.raises(DataError, match="need 2 rows"):
        render_chat(chat_tokenizer, TWO_TURNS, max_length=1000, chat_template=tmpl)


def test_truncation_keeps_the_head(chat_tokenizer):
    full = render_chat(chat_tokenizer, TWO_TURNS, max_length=1000)
    ex = render_chat(chat_tokenizer, TWO_TURNS, max_length=30)
    assert ex.truncated and len(ex.input_ids) == 30
    assert ex.input_ids == full.input_ids[:30] and ex.loss_mask == full.loss_mask[:30]


# ----------------------------------------------------------------------------- loading


def _write(path, lines):
    path.write_text("".join(x + "\n" for x in lines))
    return path


def _line(messages):
    return json.dumps({"messages": messages})


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ('{"messages": [', "invalid JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ('{"text": "hello"}', "'messages'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_line_is_one_line_error_naming_file_and_line(chat_tokenizer, tmp_path, bad, reason):
    path = _write(tmp_path / "chat.jsonl", [_line(TWO_TURNS[1:3]), "", bad, _line(TWO_TURNS)])
    with pytest.raises(DataError) as e:
        load_examples(path, chat_tokenizer, max_length=256)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and reason in msg
    assert "\n" not in msg


def test_undecodable_line_and_missing_file_are_one_line_errors(chat_tokenizer, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(_line(TWO_TURNS).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:2: not UTF-8 text$"):
        load_examples(path, chat_tokenizer, max_length=256)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=f"^{re.escape(str(missing))}: cannot read the data: "):
        load_examples(missing, chat_tokenizer, max_length=256)


def test_load_examples_sharegpt_and_count_a_prompt_past_max_length(
    chat_tokenizer, tmp_path, caplog
):
    share = {"conversations": [{"from": "human", "value": "Count from 3 to 6."},
                               {"from": "gpt", "value": "3 4 5 6"}]}  # fmt: skip
    long_prompt = [{"role": "user", "content": "Repeat after me: " + "cat " * 300},
                   {"role": "assistant", "content": "cat"}]  # fmt: skip
    lines = [_line(TWO_TURNS), json.dumps(share), _line(long_prompt)]
    path = _write(tmp_path / "chat.jsonl", lines)
    examples = load_examples(path, chat_tokenizer, max_length=128)
    assert len(examples) == 2
    assert examples[1].source == f"{path}:2"
    assert examples[1].input_ids == render_chat(
        chat_tokenizer, [{"role": "user", "content": "Count from 3 to 6."},
                         {"role": "assistant", "content": "3 4 5 6"}], max_length=128
    ).input_ids  # fmt: skip
    # the long prompt fills max_length: its turn is left out, counted with its reason
    assert "1 assistant turns left out (first: line 3: its serving prompt fills max_length" in (
        caplog.text
    )


def test_conversations_without_an_eligible_anchor_are_skipped(chat_tokenizer, tmp_path, caplog):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, friend."}]
    empty_reply = [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ]
    cut = [{"role": "user", "content": "Count from 3 to 6, please."},
           {"role": "assistant", "content": "3 4 5 6"}]  # fmt: skip
    # cut after the reply's first token: one supervised token, no anchor
    max_length = render_chat(chat_tokenizer, cut, max_length=1000).loss_mask.index(1) + 1
    assert sum(render_chat(chat_tokenizer, empty_reply, max_length=1000).loss_mask) == 1
    assert sum(render_chat(chat_tokenizer, short, max_length=max_length).loss_mask) >= 2
    path = _write(tmp_path / "chat.jsonl", [_line(short), _line(empty_reply), _line(cut)])
    examples = load_examples(path, chat_tokenizer, max_length=max_length)
    assert [e.source for e in examples] == [f"{path}:1"]
    assert "skipped 2 rows with no eligible anchor" in caplog.text
    assert len(load_examples(path, chat_tokenizer, max_length=1000)) == 2


# ----------------------------------------------------------------------------- batch streams


def _examples(n: int, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(5, 40, (1,), generator=g))
        ids = [1000 + i] * length  # the token says which example it came from
        start = int(torch.randint(1, length, (1,), generator=g))
        out.append(Example(ids, [0] * start + [1] * (length - start)))
    return out


def _docs_of_row(batch: Batch, b: int) -> list[int]:
    """Example indices of row b, checking each document is a contiguous, intact example."""
    ids, docs, pos = batch.input_ids[b], batch.doc_ids[b], batch.position_ids[b]
    found = []
    for d in range(int(docs.max()) + 1):
        where = (docs == d).nonzero().flatten()
        assert len(where) and (where == torch.arange(where[0], where[-1] + 1)).all()
        assert (pos[where] == torch.arange(len(where))).all()  # positions restart per document
        assert (ids[where] == ids[where[0]]).all()
        found.append(int(ids[where[0]]) - 1000)
    return found


def test_packed_rows_keep_documents_apart():
    examples = _examples(50)
    s = BatchStream(examples, batch_size=4, seq_len=64, pack=True, seed=1, pad_id=7)
    seen = []
    while s.epoch < 1:
        batch = s.next_batch()
        assert batch.input_ids.shape == (4, 64) and batch.loss_mask.dtype == torch.bool
        for b in range(4):
            docs = _docs_of_row(batch, b)
            assert len(docs) >= 1
            for d in docs:
                ex = examples[d]
                where = batch.input_ids[b] == 1000 + d
                assert batch.loss_mask[b][where].tolist() == [bool(m) for m in ex.loss_mask]
            pad = batch.doc_ids[b] < 0
            assert (batch.input_ids[b][pad] == 7).all() and not batch.loss_mask[b][pad].any()
            seen += docs
    assert sorted(seen[: len(examples)]) == list(range(len(examples)))
    assert any(len(_docs_of_row(batch, b)) > 1 for b in range(4))


def test_padded_rows_hold_one_document_each():
    examples = _examples(10)
    s = BatchStream(examples, batch_size=5, seq_len=48, pack=False, seed=0)
    rows = []
    for _ in range(2):
        batch = s.next_batch()
        for b in range(5):
            rows += _docs_of_row(batch, b)
        assert (batch.position_ids == torch.arange(48)).all()  # a plain row: 0..S-1
    assert sorted(rows) == list(range(10)) and s.epoch == 1.0


def test_pack_documents_fills_rows():
    import numpy as np

    lengths = np.array([30, 30, 40, 10, 20, 64, 5])
    rows = pack_documents(lengths, np.arange(7), 64)
    assert sorted(d for r in rows for d in r) == list(range(7))
    assert all(sum(lengths[r]) <= 64 for r in rows)
    assert len(rows) == 4  # 196 tokens need at least 4 rows of 64


def _same(a: Batch, b: Batch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))


@pytest.mark.parametrize("pack", [False, True])
def test_exact_resume(pack):
    examples = _examples(23)
    kw = dict(batch_size=3, seq_len=64, pack=pack, seed=5)
    a = BatchStream(examples, **kw)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints store it as JSON
    expected = [a.next_batch() for _ in range(12)]  # crosses epoch boundaries
    b = BatchStream(examples, **kw)
    b.load_state_dict(state)
    assert all(_same(x, b.next_batch()) for x in expected)
    assert a.epoch == b.epoch > 1


def test_epochs_reshuffle_deterministically():
    examples = _examples(12)
    order = lambda s: [int(s.next_batch().input_ids[0, 0]) for _ in range(24)]  # noqa: E731
    first = order(BatchStream(examples, batch_size=1, seq_len=64, pack=False, seed=3))
    again = order(BatchStream(examples, batch_size=1, seq_len=64, pack=False, seed=3))
    other = order(BatchStream(examples, batch_size=1, seq_len=64, pack=False, seed=4))
    assert first == again and first != other
    assert sorted(first[:12]) == sorted(first[12:]) and first[:12] != first[12:]


def test_ranks_split_the_global_batch():
    examples = _examples(17)
    whole = BatchStream(examples, batch_size=4, seq_len=64, pack=True, seed=2)
    ranks = [BatchStream(examples, batch_size=2, seq_len=64, pack=True, seed=2, rank=r,
                         world_size=2) for r in range(2)]  # fmt: skip
    for _ in range(6):
        w = whole.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([p.input_ids for p in parts]), w.input_ids)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    assert ranks[0].epoch == pytest.approx(whole.epoch)


def test_load_state_from_other_data_is_refused():
    a = BatchStream(_examples(20), batch_size=2, seq_len=64, pack=True, seed=0)
    b = BatchStream(_examples(5), batch_size=2, seq_len=64, pack=True, seed=0)
    with pytest.raises(ValueError, match="rows per epoch"):
        b.load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------- anchors


def _packed_mask():
    # row 0: doc 0 (12 tokens, supervised 4..11), doc 1 (10 tokens, supervised 2..9), padding
    # row 1: one doc, supervised 1..2 and 20..39 (two spans)
    S = 40
    mask, docs = torch.zeros(2, S, dtype=torch.bool), torch.full((2, S), -1)
    docs[0, :12], docs[0, 12:22] = 0, 1
    mask[0, 4:12], mask[0, 14:22] = True, True
    docs[1, :] = 0
    mask[1, 1:3], mask[1, 20:40] = True, True
    return mask, docs


def test_eligibility():
    mask, docs = _packed_mask()
    ok = eligible_anchors(mask, docs)
    assert ok[0].nonzero().flatten().tolist() == list(range(4, 11)) + list(range(14, 21))
    assert ok[1].nonzero().flatten().tolist() == [1] + list(range(20, 39))


@pytest.mark.parametrize("num_anchors", [1, 3, 5, 100])
def test_anchors_eligible_unique_sorted_per_document(num_anchors):
    mask, docs = _packed_mask()
    ok = eligible_anchors(mask, docs)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        anchors, valid = sample_anchors(mask, docs, num_anchors=num_anchors, generator=g)
        assert anchors.dtype == torch.long and valid.shape == anchors.shape
        for b in range(2):
            a = anchors[b][valid[b]]
            assert ok[b, a].all()
            assert (a[1:] > a[:-1]).all()
            assert (anchors[b][~valid[b]] == 0).all()
            assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)
            for d in range(int(docs[b].max()) + 1):
                in_doc = int((docs[b, a] == d).sum())
                assert in_doc == min(num_anchors, int((ok[b] & (docs[b] == d)).sum()))


def test_anchors_are_fresh_uniform_and_reproducible():
    mask = torch.ones(1, 101, dtype=torch.bool)  # 100 eligible positions, one document
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(101)
    draws = [sample_anchors(mask, None, num_anchors=10, generator=g)[0] for _ in range(2000)]
    for a in draws:
        counts[a[0]] += 1
    assert counts[100] == 0
    # each position is drawn with probability 0.1: 200 expected of 2000, std ~13.4
    assert counts[:100].min() > 140 and counts[:100].max() < 260
    assert len({tuple(a[0].tolist()) for a in draws}) > 1990
    again = torch.Generator().manual_seed(1)
    assert torch.equal(sample_anchors(mask, None, num_anchors=10, generator=again)[0], draws[0])


def test_anchor_cap_per_row_samples_uniformly_across_documents():
    docs = torch.arange(60)[None].repeat(2, 1) // 20  # 3 documents of 20 rows per row
    mask = torch.ones(2, 60, dtype=torch.bool)
    mask[1, 20:] = False  # row 1: only document 0 is supervised (19 eligible)
    ok = eligible_anchors(mask, docs)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(60)
    for _ in range(600):
        anchors, valid = sample_anchors(mask, docs, num_anchors=10, generator=g, max_per_row=6)
        assert valid.sum(1).tolist() == [6, 6]
        for b in range(2):
            a = anchors[b][valid[b]]
            assert ok[b, a].all() and (a[1:] > a[:-1]).all()
            assert (docs[b, a].bincount(minlength=3) <= 10).all()
        counts[anchors[0][valid[0]]] += 1
    # each of the 57 eligible positions of row 0 is drawn with probability 6/57: 63 expected
    eligible = counts[ok[0]]
    assert eligible.sum() == 3600 and eligible.min() > 35 and eligible.max() < 95
    assert counts[~ok[0]].sum() == 0


def test_no_eligible_positions_gives_one_invalid_padding_block():
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, -1] = True  # one supervised token at the row end: no anchor
    anchors, valid = sample_anchors(mask, None, num_anchors=4, generator=torch.Generator())
    assert anchors.shape == (2, 1) and valid.shape == (2, 1)
    assert not valid.any() and (anchors == 0).all()


def test_data_path_is_cheap_at_4096_tokens():
    examples = _examples(400)
    for e in examples:  # long documents: 300-1200 tokens
        e.input_ids, e.loss_mask = e.input_ids * 30, e.loss_mask * 30
    s = BatchStream(examples, batch_size=2, seq_len=4096, pack=True, seed=0)
    g = torch.Generator().manual_seed(0)
    s.next_batch()
    t = time.perf_counter()
    for _ in range(10):
        b = s.next_batch()
        sample_anchors(b.loss_mask, b.doc_ids, num_anchors=512, generator=g)
    per_step = (time.perf_counter() - t) / 10
    assert per_step < 0.05, f"{per_step * 1000:.1f} ms per step"


def test_parallel_rendering_matches_sequential(chat_tokenizer, tmp_path):
    from workload import tiny

    r = __import__("random").Random(3)
    convs = [tiny.conversation(r)[0] for _ in range(2100)]
    path = _write(tmp_path / "chat.jsonl", [_line(c) for c in convs])
    one = load_examples(path, chat_tokenizer, max_length=64, workers=1)
    two = load_examples(path, chat_tokenizer, max_length=64, workers=2)
    assert one == two and 2090 <= len(one) <= 2100  # a few cut right after a reply starts
    assert [e.source for e in two[:3]] == [f"{path}:{i}" for i in (1, 2, 3)]


def test_inspect_data_marks_supervised_tokens(tiny_dense, capsys):
    from workload.data.inspect_rows import main

    assert main(["--config", str(tiny_dense / "run.yaml"), "--n", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    spans = re.findall(r"\[\[(.*?)\]\]", out, re.S)
    assert spans and all(s.endswith("<|im_end|>") and "<|im_start|>" not in s for s in spans)
    assert out.count("--- example") == 2
    assert re.search(r"supervised: \d+\.\d% of tokens", out)
    assert "supervised turn openers (<|im_start|>): 0" in out
    assert main(["--config", str(tiny_dense / "run.yaml"), "--index", "999999"]) == 2
