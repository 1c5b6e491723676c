"""Block attention for DFlash training: every block of a row attends at once.

Visibility of the query at slot s of block j, whose anchor has row index a = anchors[b, j]:
  - context row p iff the block is valid, p < a, doc_ids[p] == doc_ids[a] (when given) and,
    for a sliding window W, (a + s) - p < W;
  - block keys of its own block only: every slot, or slots t <= s when causal_in_block.
Three implementations share these two rules (`context_visible`, `block_visible`):
  flex     flex_attention with a BlockMask (fused and compiled on CUDA),
  chunked  an exact fallback: one SDPA per group of consecutive blocks over the context slice
           the group can see plus the group's own block keys,
  dense    one [B, 1, N*K, S+N*K] boolean mask and SDPA (the reference).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLS = ("flex", "chunked", "dense")
# queries per chunked SDPA call; a group of blocks covers about this many queries
CHUNK_QUERIES = 256


def context_visible(
    a: Tensor,
    s: Tensor,
    p: Tensor,
    valid: Tensor,
    doc_a: Tensor | None,
    doc_p: Tensor | None,
    window: int | None,
) -> Tensor:
    """Whether the query at slot s of a block anchored at a sees context row p (broadcasting)."""
    visible = valid & (p < a)
    if doc_a is not None:
        visible = visible & (doc_p == doc_a)
    if window is not None:
        visible = visible & ((a + s - p) < window)
    return visible


def block_visible(j: Tensor, s: Tensor, kj: Tensor, t: Tensor, causal: bool) -> Tensor:
    """Whether slot s of block j sees slot t of block kj."""
    visible = j == kj
    if causal:
        visible = visible & (t <= s)
    return visible


def resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be auto, {', '.join(IMPLS)}; got {impl!r}")
    return impl


def block_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    *,
    anchors: Tensor,
    anchor_valid: Tensor,
    block_size: int,
    doc_ids: Tensor | None = None,
    sliding_window: int | None = None,
    causal_in_block: bool = False,
    scaling: float,
    impl: str = "auto",
    masks: dict | None = None,
    pad_to: tuple[int, int] | None = None,
) -> Tensor:
    """q [B,Hq,N*K,D]; k_ctx/v_ctx [B,Hkv,S,D]; k_blk/v_blk [B,Hkv,N*K,D] -> [B,Hq,N*K,D].

    `masks`: a dict shared by the layers of one forward (same anchors, documents and rows), in
    which flex keeps the block mask of each (window, causal) kind instead of rebuilding it.
    `pad_to`: the most context rows and block queries a run's rows have (training sets it):
    flex pads every call up to them, so it compiles one shape per layer kind."""
    _check_shapes(q, k_ctx, k_blk, anchors, anchor_valid, block_size, doc_ids)
    spec = _Spec(anchors, anchor_valid, block_size, doc_ids, sliding_window, causal_in_block)
    impl = resolve_impl(impl, q.device)
    if impl == "flex":
        masks = {} if masks is None else masks
        return _flex(q, k_ctx, v_ctx, k_blk, v_blk, spec, scaling, masks, pad_to)
    fn = {"chunked": _chunked, "dense": _dense}[impl]
    return fn(q, k_ctx, v_ctx, k_blk, v_blk, spec, scaling)


class _Spec:
    """Who sees what, in tensors ready for the three implementations."""

    def __init__(self, anchors, anchor_valid, block_size, doc_ids, window, causal) -> None:
        self.anchors = anchors.long()
        self.valid = anchor_valid.bool()
        self.block_size = block_size
        self.doc_ids = doc_ids
        self.window = window
        self.causal = causal
        self.doc_anchor = None
        if doc_ids is not None:
            safe = self.anchors.clamp(0, doc_ids.shape[1] - 1)
            self.doc_anchor = doc_ids.gather(1, safe)

    def context_mask(self, block_lo: int, block_hi: int, p: Tensor) -> Tensor:
        """[B, (block_hi-block_lo)*K, len(p)] visibility of context rows p for a range of blocks."""
        k = self.block_size
        rep = slice(block_lo, block_hi)
        a = self.anchors[:, rep].repeat_interleave(k, dim=1)[:, :, None]
        valid = self.valid[:, rep].repeat_interleave(k, dim=1)[:, :, None]
        s = torch.arange((block_hi - block_lo) * k, device=p.device)[None, :, None] % k
        doc_a = doc_p = None
        if self.doc_anchor is not None:
            doc_a = self.doc_anchor[:, rep].repeat_interleave(k, dim=1)[:, :, None]
            doc_p = self.doc_ids[:, p][:, None, :]
        return context_visible(a, s, p[None, None, :], valid, doc_a, doc_p, self.window)

    def own_block_mask(self, num_blocks: int, device: torch.device) -> Tensor:
        """[n*K, n*K] visibility among the block keys of n consecutive blocks."""
        idx = torch.arange(num_blocks * self.block_size, device=device)
        j, s = idx // self.block_size, idx % self.block_size
        return block_visible(j[:, None], s[:, None], j[None, :], s[None, :], self.causal)


def _dense(q, k_ctx, v_ctx, k_blk, v_blk, spec: _Spec, scaling: float) -> Tensor:
    num_blocks = spec.anchors.shape[1]
    p = torch.arange(k_ctx.shape[2], device=q.device)
    ctx = spec.context_mask(0, num_blocks, p)
    own = spec.own_block_mask(num_blocks, q.device).expand(ctx.shape[0], -1, -1)
    mask = torch.cat([ctx, own], dim=-1)[:, None]
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    return _sdpa(q, k, v, mask, scaling)


def _chunked(q, k_ctx, v_ctx, k_blk, v_blk, spec: _Spec, scaling: float) -> Tensor:
    k = spec.block_size
    num_blocks = spec.anchors.shape[1]
    per_group = max(1, CHUNK_QUERIES // k)
    lo, hi = _context_bounds(spec, k_ctx.shape[2])
    own = spec.own_block_mask(min(per_group, num_blocks), q.device)
    outs = []
    for g0 in range(0, num_blocks, per_group):
        g1 = min(g0 + per_group, num_blocks)
        start = min(lo[g0:g1])
        stop = max(start, max(hi[g0:g1]))
        rows = slice(g0 * k, g1 * k)
        n = rows.stop - rows.start
        ctx = spec.context_mask(g0, g1, torch.arange(start, stop, device=q.device))
        mask = torch.cat([ctx, own[:n, :n].expand(ctx.shape[0], -1, -1)], dim=-1)[:, None]
        keys = torch.cat([k_ctx[:, :, start:stop], k_blk[:, :, rows]], dim=2)
        vals = torch.cat([v_ctx[:, :, start:stop], v_blk[:, :, rows]], dim=2)
        outs.append(_sdpa(q[:, :, rows], keys, vals, mask, scaling))
    return torch.cat(outs, dim=2)


def _context_bounds(spec: _Spec, seq_len: int) -> tuple[list[int], list[int]]:
    """Per block, a half-open row range [lo, hi) containing every context row it may see.

    Invalid blocks get an empty range at +inf so they never widen a group's slice."""
    a = spec.anchors.clamp(0, seq_len)
    lo = torch.zeros_like(a)
    if spec.window is not None:
        lo = torch.maximum(lo, a - spec.window + 1)
    if spec.doc_ids is not None:
        same = spec.doc_ids[:, None, :] == spec.doc_anchor[:, :, None]
        lo = torch.maximum(lo, same.int().argmax(dim=-1))
    big = torch.full_like(a, seq_len)
    lo = torch.where(spec.valid, lo, big).amin(dim=0)
    hi = torch.where(spec.valid, a, torch.zeros_like(a)).amax(dim=0)
    return lo.tolist(), hi.tolist()


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, spec: _Spec, scaling: float, masks: dict,
          pad_to: tuple[int, int] | None) -> Tensor:  # fmt: skip
    """Rows padded (`flex_padded`): the padding is masked out (its blocks are skipped, so a
    padded query or key block costs no attention compute), and a compiled kernel sees one
    shape per layer kind (a few power-of-two buckets without `pad_to`), not one per step."""
    batch, seq_len, total = q.shape[0], k_ctx.shape[2], q.shape[2]
    ctx_pad, blk_pad = flex_padded(seq_len, total, pad_to)
    compiled = flex_compiled(q.device)
    FLEX_SHAPES.add(flex_shape_key(batch, q.shape[1], q.shape[3], ctx_pad, blk_pad, spec.window,
                                   spec.causal))  # fmt: skip
    key = ("flex", spec.window, spec.causal, seq_len, total)
    if key not in masks:  # one block mask per layer kind and forward, not per layer
        build = _compiled_fn("create_block_mask") if compiled else _flex_api("create_block_mask")
        mask_mod = _flex_mask_mod(spec, seq_len, ctx_pad, total, blk_pad, q.device)
        masks[key] = build(mask_mod, batch, None, blk_pad, ctx_pad + blk_pad, device=q.device)
    # flex_attention is not an autocast op: give it one dtype, the autocast one when active
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)

    def keys(ctx: Tensor, blk: Tensor) -> Tensor:
        return torch.cat([_pad(ctx, ctx_pad, 2), _pad(blk, blk_pad, 2)], dim=2).to(dtype)

    fn = _compiled_fn("flex_attention") if compiled else _flex_api("flex_attention")
    out = fn(
        _pad(q, blk_pad, 2).to(dtype), keys(k_ctx, k_blk), keys(v_ctx, v_blk),
        block_mask=masks[key], scale=scaling, enable_gqa=q.shape[1] != k_ctx.shape[1],
    )  # fmt: skip
    return out[:, :, :total]


FLEX_MIN = 128  # flex attention's block size
# every (shape, layer kind) flex ran at in this process: what a compiled flex compiles for
FLEX_SHAPES: set[tuple] = set()


def flex_bucket(rows: int) -> int:
    """The padded length of `rows`: the next power of two, at least FLEX_MIN."""
    return max(FLEX_MIN, 1 << (rows - 1).bit_length())


def flex_padded(seq_len: int, total: int, pad_to: tuple[int, int] | None) -> tuple[int, int]:
    """(context rows, block queries) flex runs at: the bucket of the run's most (`pad_to`),
    whatever this batch has (a batch past them takes its own bucket); without `pad_to`, the
    batch's own power-of-two buckets."""
    if pad_to is not None:
        seq_len, total = max(seq_len, pad_to[0]), max(total, pad_to[1])
    return flex_bucket(seq_len), flex_bucket(total)


def flex_shape_key(batch: int, heads: int, head_dim: int, ctx_pad: int, blk_pad: int,
                   window: int | None, causal: bool) -> tuple:  # fmt: skip
    """What a static-shape compile of flex_attention and create_block_mask is specialised on."""
    return (batch, heads, head_dim, ctx_pad, blk_pad, window, causal)


def _pad(x: Tensor, size: int, dim: int, value: float = 0) -> Tensor:
    """`x` with dimension `dim` filled up to `size` with `value` at the end."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def _flex_mask_mod(
    spec: _Spec, seq_len: int, ctx_pad: int, total: int, blk_pad: int, device: torch.device
) -> Callable:
    """Keys are [context (seq_len rows, padded to ctx_pad) | blocks (total, padded to blk_pad)];
    queries are the blocks. Padding rows see nothing and are seen by nothing. Every tensor the
    mask reads is padded to the buckets too, so a compiled mask is not specialised on S or N."""
    k = spec.block_size
    blocks = -(-blk_pad // k)
    anchors = _pad(spec.anchors, blocks, 1)
    valid = _pad(spec.valid, blocks, 1, False)
    doc_ids = None if spec.doc_ids is None else _pad(spec.doc_ids, ctx_pad, 1, -1)
    doc_anchor = None if spec.doc_anchor is None else _pad(spec.doc_anchor, blocks, 1, -1)
    # lengths as tensors, not Python ints: a compiled mask would be specialised on them
    ctx_len, ctx_end, blk_len = (torch.tensor(n, device=device) for n in (seq_len, ctx_pad, total))

    def mask_mod(b, h, q_idx, kv_idx):
        j, s = q_idx // k, q_idx % k
        p = torch.minimum(kv_idx, ctx_end - 1)
        doc_a = doc_anchor[b, j] if doc_anchor is not None else None
        doc_p = doc_ids[b, p] if doc_ids is not None else None
        ctx = (kv_idx < ctx_len) & context_visible(
            anchors[b, j], s, kv_idx, valid[b, j], doc_a, doc_p, spec.window
        )
        t = torch.clamp(kv_idx - ctx_end, min=0)
        own = (kv_idx >= ctx_end) & (t < blk_len) & block_visible(j, s, t // k, t % k, spec.causal)
        return (q_idx < blk_len) & (ctx | own)

    return mask_mod


# None: compile flex attention on CUDA only (CPU runs it eagerly, forward only); True/False
# force it (bench/gpu_check.py and tests use True to run the compiled path on CPU).
COMPILE_FLEX: bool | None = None
_COMPILED: dict[str, Callable] = {}


def flex_compiled(device: torch.device) -> bool:
    return device.type == "cuda" if COMPILE_FLEX is None else COMPILE_FLEX


def _flex_api(name: str) -> Callable:
    from torch.nn.attention import flex_attention

    return getattr(flex_attention, name)


def _compiled_fn(name: str) -> Callable:
    """flex_attention / create_block_mask compiled once, for static shapes: a training run pads
    every call to its longest rows and most anchors (`pad_to`), so it compiles once per layer
    kind (the last batch of an epoch, if smaller, once more); without `pad_to` rows go to
    power-of-two buckets (at most 6 x 7 per kind for 4096-token rows and 512 anchors of 16).
    The recompile limit is raised above that: past it torch would run flex unfused (full score
    matrices: out of memory). dynamic=True would avoid recompiles, but inductor's CPU flex
    kernel does not compile with dynamic shapes (torch 2.13) and the CUDA one is unverified."""
    if name not in _COMPILED:
        import torch._dynamo

        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, FLEX_RECOMPILE_LIMIT)
        _COMPILED[name] = torch.compile(_flex_api(name), dynamic=False)
    return _COMPILED[name]


FLEX_RECOMPILE_LIMIT = 128


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float) -> Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )


def _check_shapes(q, k_ctx, k_blk, anchors, anchor_valid, block_size, doc_ids) -> None:
    batch, heads, total, _ = q.shape
    if total != anchors.shape[1] * block_size:
        raise ValueError(
            f"q has {total} block queries, expected anchors ({anchors.shape[1]}) x "
            f"block_size ({block_size})"
        )
    if k_blk.shape[2] != total or anchor_valid.shape != anchors.shape:
        raise ValueError("k_blk / anchor_valid do not match the block layout of q")
    if heads % k_ctx.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({k_ctx.shape[1]})")
    if doc_ids is not None and doc_ids.shape != (batch, k_ctx.shape[2]):
        raise ValueError(f"doc_ids must be [B, S] = {(batch, k_ctx.shape[2])}")
