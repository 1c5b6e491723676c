"""Rows into batches: a corpus's tokens (`TokenArrays`), padded or packed rows, the resumable
batch stream, the held-out split and its batches, and anchor sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workload.data.chat import Example


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] long
    loss_mask: torch.Tensor  # [B, S] bool
    doc_ids: torch.Tensor  # [B, S] long, -1 on padding
    position_ids: torch.Tensor  # [B, S] long, restarting at 0 for each document; padding
    # continues the last document's count, so a padded (unpacked) row is simply 0..S-1

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.input_ids, self.loss_mask, self.doc_ids, self.position_ids)
            )
        )


@dataclass
class TokenArrays:
    """Every document's tokens and loss mask, concatenated, with offsets: in memory (from
    examples) or memory-mapped from a token store, which a rank then reads only where its rows
    are. Document d is `ids[offsets[d]:offsets[d + 1]]`."""

    ids: np.ndarray  # int32 [T]
    mask: np.ndarray  # bool or uint8 [T]
    offsets: np.ndarray  # int64 [n + 1]

    @classmethod
    def from_examples(cls, examples: list[Example]) -> TokenArrays:
        lengths = np.array([len(e.input_ids) for e in examples], dtype=np.int64)
        return cls(
            np.concatenate([np.asarray(e.input_ids, np.int32) for e in examples]),
            np.concatenate([np.asarray(e.loss_mask, bool) for e in examples]),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def pack_rows(
    lengths: np.ndarray, order: np.ndarray, seq_len: int, open_rows: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit over a few open rows, in `order`: (row_ptr [R + 1], docs [n]); row r holds
    docs[row_ptr[r]:row_ptr[r + 1]] in the order they were placed. Arrays, so an epoch of
    800k documents costs a few MB, not a list per row."""
    row_of = np.empty(len(order), dtype=np.int64)
    rows = 0
    open_: list[tuple[int, int]] = []  # (row index, free tokens)
    for i, doc in enumerate(order.tolist()):
        n = min(int(lengths[doc]), seq_len)
        slot = next((k for k, (_, free) in enumerate(open_) if free >= n), None)
        if slot is None:
            open_.append((rows, seq_len))
            rows += 1
            slot = len(open_) - 1
        row, free = open_[slot]
        row_of[i] = row
        open_[slot] = (row, free - n)
        if free - n == 0 or len(open_) > open_rows:
            open_.pop(0 if free - n else slot)
    placed = np.argsort(row_of, kind="stable")
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))])
    return row_ptr.astype(np.int64), np.asarray(order, dtype=np.int64)[placed]


def pack_documents(lengths: np.ndarray, order: np.ndarray, seq_len: int, open_rows: int = 8):
    """`pack_rows` as a list of rows (lists of doc indices)."""
    row_ptr, docs = pack_rows(lengths, order, seq_len, open_rows)
    return [docs[row_ptr[r] : row_ptr[r + 1]].tolist() for r in range(len(row_ptr) - 1)]


def collate(arrays: TokenArrays, rows: list[np.ndarray], seq_len: int, pad_id: int) -> Batch:
    """Rows of documents (store indices) -> a Batch of host tensors [len(rows), seq_len]."""
    shape = (len(rows), seq_len)
    ids = np.full(shape, pad_id, np.int64)
    mask = np.zeros(shape, bool)
    docs = np.full(shape, -1, np.int64)
    pos = np.zeros(shape, np.int64)
    for b, row in enumerate(rows):
        at = 0
        for k, d in enumerate(np.asarray(row).tolist()):
            start = int(arrays.offsets[d])
            n = min(int(arrays.offsets[d + 1]) - start, seq_len)
            ids[b, at : at + n] = arrays.ids[start : start + n]
            mask[b, at : at + n] = arrays.mask[start : start + n]
            docs[b, at : at + n] = k
            pos[b, at : at + n] = np.arange(n)
            at += n
        if len(row) and at < seq_len:  # padding continues the last document's positions
            pos[b, at:] = pos[b, at - 1] + 1 + np.arange(seq_len - at)
    return Batch(*(torch.from_numpy(a) for a in (ids, mask, docs, pos)))


class BatchStream:
    """Endless stream of batches. Epoch e visits every row once in an order drawn from seed + e;
    global batch k holds rows [k*B*W, (k+1)*B*W) of the concatenated epochs and rank r takes its
    B rows. State is a global position, identical on every rank. `data` is a list of examples or
    the `TokenArrays` of a store; `docs` the documents of it to train on (default: all)."""

    def __init__(
        self,
        data: list[Example] | TokenArrays,
        *,
        batch_size: int,
        seq_len: int,
        pack: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        pad_id: int = 0,
        docs: np.ndarray | None = None,
    ):
        arrays = data if isinstance(data, TokenArrays) else None
        if arrays is None:
            if not data:
                raise ValueError("BatchStream needs at least one example")
            arrays = TokenArrays.from_examples(data)
        self._docs = np.arange(len(arrays), dtype=np.int64) if docs is None else np.asarray(docs)
        if not len(self._docs):
            raise ValueError("BatchStream needs at least one example")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.batch_size, self.seq_len, self.pack = batch_size, seq_len, pack
        self.seed, self.rank, self.world_size, self.pad_id = seed, rank, world_size, pad_id
        self._arrays = arrays
        self._lengths = np.minimum(arrays.lengths()[self._docs], seq_len)
        self._epoch, self._index = 0, 0
        self._set_epoch(0)

    def _set_epoch(self, epoch: int) -> None:
        """Rows of epoch `epoch` as (row_ptr, positions in docs); None: one document a row."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._lengths))
        if self.pack:
            self._row_ptr, self._row_docs = pack_rows(self._lengths, order, self.seq_len)
        else:
            self._row_ptr, self._row_docs = None, order
        self._epoch = epoch

    def _row_count(self) -> int:
        return len(self._row_docs) if self._row_ptr is None else len(self._row_ptr) - 1

    def _next_row(self) -> np.ndarray:
        if self._index >= self._row_count():
            self._set_epoch(self._epoch + 1)
            self._index = 0
        i = self._index
        self._index += 1
        if self._row_ptr is None:
            return self._docs[self._row_docs[i : i + 1]]
        return self._docs[self._row_docs[self._row_ptr[i] : self._row_ptr[i + 1]]]

    def next_batch(self) -> Batch:
        global_rows = [self._next_row() for _ in range(self.batch_size * self.world_size)]
        mine = global_rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return collate(self._arrays, mine, self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "rows_in_epoch": self._row_count(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"data state was saved with seed {state['seed']}, stream has {self.seed}"
            )
        self._set_epoch(int(state["epoch"]))
        self._index = int(state["index"])
        if "rows_in_epoch" in state and state["rows_in_epoch"] != self._row_count():
            raise ValueError("data state does not match this data set (rows per epoch differ)")

    @property
    def epoch(self) -> float:
        return self._epoch + self._index / self._row_count()

    @property
    def rows_per_epoch(self) -> int:
        return self._row_count()


def split_holdout(n: int, holdout: float | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training documents, held-out documents) of a store of `n`, both sorted. `holdout`: a
    fraction in (0, 1), a count, 0 for none, or None for min(64, n // 10). The held-out ones
    are the first of a permutation drawn from (seed, n) alone: the same on every rank, every
    start and every world size."""
    if holdout is None:
        count = min(DEFAULT_HOLDOUT, n // 10)
    elif 0 < holdout < 1:
        count = max(1, round(holdout * n))
    else:
        count = int(holdout)
    count = min(count, n - 1)  # at least one document trains
    if count <= 0:
        return np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
    perm = np.random.default_rng([seed, n, _HOLDOUT_STREAM]).permutation(n)
    held = np.sort(perm[:count])
    keep = np.ones(n, dtype=bool)
    keep[held] = False
    return np.flatnonzero(keep).astype(np.int64), held.astype(np.int64)


DEFAULT_HOLDOUT = 64
_HOLDOUT_STREAM = 0x484F4C44  # "HOLD": the holdout's draw is its own random stream


class HoldoutBatches:
    """One pass over the held-out documents, one a row in a fixed order; rank r of W takes
    documents r, r+W, ..., in batches of `batch_size` rows. Read from the store at each pass."""

    def __init__(self, arrays: TokenArrays, docs: np.ndarray, *, batch_size: int, seq_len: int,
                 rank: int = 0, world_size: int = 1, pad_id: int = 0) -> None:  # fmt: skip
        self.arrays, self.mine = arrays, np.asarray(docs)[rank::world_size]
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.total = len(docs)

    def __iter__(self):
        for i in range(0, len(self.mine), self.batch_size):
            rows = [
                self.mine[j : j + 1] for j in range(i, min(i + self.batch_size, len(self.mine)))
            ]
            yield collate(self.arrays, rows, self.seq_len, self.pad_id)


# ----------------------------------------------------------------------------- anchors


def eligible_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] bool: loss_mask[a] and loss_mask[a+1] and doc_ids[a] == doc_ids[a+1]."""
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    if doc_ids is not None:
        ok[:, :-1] &= (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return ok


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    num_anchors: int,
    generator: torch.Generator,
    max_per_row: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` eligible positions per document, uniformly without replacement;
    then, if a row has more than `max_per_row` (packed rows of many documents), a uniform
    subset of that many.

    Returns anchors [B, N] (long, ascending per row, 0 where invalid) and valid [B, N] (bool),
    N = the largest per-row count of this call, at least 1: a batch without any eligible
    position gets one invalid padding block per row, so shapes stay valid downstream.
    """
    B, S = loss_mask.shape
    device = loss_mask.device
    ok = eligible_anchors(loss_mask, doc_ids)
    docs = (
        torch.zeros_like(ok, dtype=torch.long) if doc_ids is None else doc_ids.long().clamp(min=0)
    )
    # One group per (row, document); random keys in [0, 0.5) for eligible positions and 0.75 for
    # the rest, so that sorting by group + key ranks the eligible positions of a group first.
    keys = torch.rand((B, S), generator=generator, device=generator.device, dtype=torch.float64)
    keys = torch.where(ok, keys.to(device) * 0.5, torch.full_like(keys, 0.75, device=device))
    group = torch.arange(B, device=device)[:, None] * (S + 1) + docs
    order = torch.argsort((group.double() + keys).flatten())
    sorted_group = group.flatten()[order]
    idx = torch.arange(B * S, device=device)
    new_group = torch.ones_like(sorted_group, dtype=torch.bool)
    new_group[1:] = sorted_group[1:] != sorted_group[:-1]
    group_start = torch.cummax(torch.where(new_group, idx, 0), 0).values
    rank_in_group = torch.empty_like(idx)
    rank_in_group[order] = idx - group_start
    chosen = ok & (rank_in_group.view(B, S) < num_anchors)
    if max_per_row is not None:
        chosen &= _random_rank_in_row(chosen, generator) < max_per_row

    counts = chosen.sum(1)
    n = max(int(counts.max()) if B else 0, 1)
    pos = torch.arange(S, device=device).expand(B, S)
    ranked = torch.sort(torch.where(chosen, pos, pos + S), dim=1).values[:, :n]
    valid = torch.arange(n, device=device)[None, :] < counts[:, None]
    return torch.where(valid, ranked, 0), valid


def _random_rank_in_row(chosen: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[B, S] rank of each chosen position among its row's chosen ones, in a random order."""
    B, S = chosen.shape
    keys = torch.rand((B, S), generator=generator, device=generator.device, dtype=torch.float64)
    keys = torch.where(chosen, keys.to(chosen.device), 2.0)
    rank = torch.empty((B, S), dtype=torch.long, device=chosen.device)
    rank.scatter_(1, keys.argsort(dim=1), torch.arange(S, device=chosen.device).expand(B, S))
    return rank
