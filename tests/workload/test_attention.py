"""block_attention: the visibility rule, and chunked/flex agreeing with dense."""

from __future__ import annotations

import math

import pytest
import torch

import workload.drafter.attention as attention_module
from workload.drafter.attention import block_attention

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),
]


B, HQ, HKV, D, S, N, K = 2, 4, 2, 8, 40, 5, 4
CASES = [  # (window, causal_in_block, docs)
    (None, False, False),
    (None, True, False),
    (7, True, False),
    (7, False, True),
    (None, False, True),
    (9, True, True),
]


def _inputs(seed: int, docs: bool, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values
    valid = torch.rand(B, N, generator=g) > 0.25
    valid[:, 0] = True
    valid[0, -1] = False  # at least one padding block
    doc_ids = torch.cumsum((torch.rand(B, S, generator=g) < 0.15).long(), dim=1) if docs else None

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    qkv = [
        t(B, HQ, N * K, D),
        t(B, HKV, S, D),
        t(B, HKV, S, D),
        t(B, HKV, N * K, D),
        t(B, HKV, N * K, D),
    ]
    return qkv, anchors, valid, doc_ids


def _run(qkv, anchors, valid, doc_ids, window, causal, impl):
    return block_attention(
        *qkv,
        anchors=anchors,
        anchor_valid=valid,
        block_size=K,
        doc_ids=doc_ids,
        sliding_window=window,
        causal_in_block=causal,
        scaling=D**-0.5,
        impl=impl,
    )


def _visible(b, j, s, anchors, valid, doc_ids, window, causal):
    """The rule from the design doc, spelled out: (context rows, own-block slots)."""
    a = int(anchors[b, j])
    ctx = []
    if valid[b, j]:
        for p in range(S):
            same_doc = doc_ids is None or doc_ids[b, p] == doc_ids[b, a]
            in_window = window is None or (a + s) - p < window
            if p < a and same_doc and in_window:
                ctx.append(p)
    slots = [t for t in range(K) if not causal or t <= s]
    return ctx, slots


def _naive(qkv, anchors, valid, doc_ids, window, causal):
    q, kc, vc, kb, vb = (x.detach() for x in qkv)
    out = torch.zeros_like(q)
    group = HQ // HKV
    for b in range(B):
        for h in range(HQ):
            kv = h // group
            for j in range(N):
                for s in range(K):
                    ctx, slots = _visible(b, j, s, anchors, valid, doc_ids, window, causal)
                    keys = torch.cat([kc[b, kv, ctx], kb[b, kv, [j * K + t for t in slots]]])
                    vals = torch.cat([vc[b, kv, ctx], vb[b, kv, [j * K + t for t in slots]]])
                    w = torch.softmax(keys @ q[b, h, j * K + s] / math.sqrt(D), dim=0)
                    out[b, h, j * K + s] = w @ vals
    return out


def _flex_or_skip():
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as err:
        pytest.skip(f"flex_attention unavailable in this torch: {err}")


@pytest.mark.parametrize("impl", ["dense", "chunked", "flex"])
@pytest.mark.parametrize("window,causal,docs", CASES)
def test_matches_the_rule_written_out(impl, window, causal, docs):
    if impl == "flex":
        _flex_or_skip()  # CPU flex runs forward only (no backward on CPU)
    qkv, anchors, valid, doc_ids = _inputs(1, docs)
    got = _run(qkv, anchors, valid, doc_ids, window, causal, impl)
    want = _naive(qkv, anchors, valid, doc_ids, window, causal)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.fixture(params=[K, 2 * K, 256], ids=["1-block-groups", "2-block-groups", "default"])
def chunk_queries(request, monkeypatch):
    """Small groups make every group's context slice tight, so a wrong bound shows."""
    monkeypatch.setattr(attention_module, "CHUNK_QUERIES", request.param)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window,causal,docs", CASES)
def test_chunked_equals_dense_forward_and_gradients(seed, window, causal, docs, chunk_queries):
    qkv, anchors, valid, doc_ids = _inputs(seed, docs, grad=True)
    outs = {}
    for impl in ("dense", "chunked"):
        out = _run(qkv, anchors, valid, doc_ids, window, causal, impl)
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        outs[impl] = (out, torch.autograd.grad((out * weight).sum(), qkv))
    torch.testing.assert_close(outs["chunked"][0], outs["dense"][0], rtol=1e-10, atol=1e-10)
    for got, want in zip(outs["chunked"][1], outs["dense"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert outs["dense"][1][1].abs().sum() > 0  # context keys did receive gradient


@pytest.mark.parametrize("impl", ["dense", "chunked", "flex"])
@pytest.mark.parametrize("window,causal", [(None, False), (6, True)])
def test_hidden_positions_cannot_move_a_query(impl, window, causal):
    if impl == "flex":
        _flex_or_skip()
    qkv, anchors, valid, doc_ids = _inputs(3, docs=True)
    anchors[0] = torch.tensor([3, 12, 20, 28, 35])
    doc_ids[0] = torch.tensor([0] * 10 + [1] * 20 + [2] * 10)
    valid[0] = True
    j, a = 2, 20  # block 2 of row 0: doc 1 spans rows 10..29
    base = _run(qkv, anchors, valid, doc_ids, window, causal, impl)[0, :, j * K : (j + 1) * K]

    def perturbed(tensor_idx, rows):
        moved = [x.clone() for x in qkv]
        moved[tensor_idx][0, :, rows] += 3.0
        return _run(moved, anchors, valid, doc_ids, window, causal, impl)[0, :, j * K : (j + 1) * K]

    hidden_ctx = list(range(a, S)) + list(range(0, 10))  # at/after the anchor, other document
    if window is not None:
        hidden_ctx += list(range(10, a - window + 1))  # outside the window of every slot
    other_blocks = [r for r in range(N * K) if not j * K <= r < (j + 1) * K]
    for idx, rows in [(1, hidden_ctx), (2, hidden_ctx), (3, other_blocks), (4, other_blocks)]:
        torch.testing.assert_close(perturbed(idx, rows), base, rtol=0, atol=1e-12)
    assert not torch.allclose(perturbed(1, [a - 1]), base)  # the row just before the anchor
    assert not torch.allclose(perturbed(2, [a - 1]), base)
    own = perturbed(4, [j * K + K - 1])  # last slot of the own block
    moved_slots = (own - base).abs().amax(dim=(0, 2)) > 1e-9
    assert moved_slots.tolist() == ([False] * (K - 1) + [True] if causal else [True] * K)


@pytest.mark.parametrize("impl", ["dense", "chunked", "flex"])
def test_padding_blocks_are_finite_and_blind_to_context(impl):
    if impl == "flex":
        _flex_or_skip()
    qkv, anchors, _, _ = _inputs(4, docs=False)
    valid = torch.zeros(B, N, dtype=torch.bool)
    anchors[:] = 0
    out = _run(qkv, anchors, valid, None, None, False, impl)
    assert torch.isfinite(out).all()
    moved = [x.clone() for x in qkv]
    moved[1] += 5.0
    torch.testing.assert_close(_run(moved, anchors, valid, None, None, False, impl), out)


@pytest.mark.slow
def test_compiled_flex_equals_dense_and_compiles_once_per_row_bucket(monkeypatch, request):
    """The trainer's CUDA path (compiled flex, rows padded to power-of-two buckets), run on
    CPU by inductor (forward only): equal to dense for changing S and N, and a new S or N in
    a bucket already seen compiles nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention_module, "COMPILE_FLEX", True)
    monkeypatch.setattr(attention_module, "_COMPILED", {})
    # dynamo keeps per-function state (e.g. which sizes changed) that later compiles of
    # flex_attention (transformers' own) would inherit: start and leave it clean
    torch._dynamo.reset()
    request.addfinalizer(torch._dynamo.reset)
    g = torch.Generator().manual_seed(0)

    def check(seq_len: int, blocks: int, window, causal) -> None:
        anchors = torch.sort(torch.randperm(seq_len - 1, generator=g)[:blocks]).values[None]
        valid = torch.rand(1, blocks, generator=g) > 0.2
        docs = (torch.arange(seq_len)[None] * 3 // seq_len).long()
        qkv = [torch.randn(1, h, n, D, generator=g) for h, n in
               [(HQ, blocks * K), (HKV, seq_len), (HKV, seq_len), (HKV, blocks * K),
                (HKV, blocks * K)]]  # fmt: skip
        kw = dict(anchors=anchors, anchor_valid=valid, block_size=K, doc_ids=docs,
                  sliding_window=window, causal_in_block=causal, scaling=D**-0.5)  # fmt: skip
        got = block_attention(*qkv, impl="flex", **kw)
        torch.testing.assert_close(got, block_attention(*qkv, impl="dense", **kw))

    for window, causal in ((None, False), (24, True)):
        check(150, 20, window, causal)  # buckets: 256 context rows, 128 block rows
    before = counters["stats"]["unique_graphs"]
    for seq_len, blocks in ((200, 30), (129, 17), (256, 32)):  # same buckets
        for window, causal in ((None, False), (24, True)):
            check(seq_len, blocks, window, causal)
    assert counters["stats"]["unique_graphs"] == before


def test_rejects_mismatched_shapes():
    qkv, anchors, valid, _ = _inputs(0, docs=False)
    with pytest.raises(ValueError, match="block_size"):
        block_attention(*qkv, anchors=anchors, anchor_valid=valid, block_size=K + 1, scaling=1.0)
    with pytest.raises(ValueError, match="impl"):
        _run(qkv, anchors, valid, None, None, False, "sparse")
