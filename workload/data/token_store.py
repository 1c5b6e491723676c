"""The tokenized data set on disk: rendered once, memory-mapped by every rank of a node.

A store is a directory `<root>/<source name>.<key>/` of flat little-endian arrays and a header:

    ids.i32        int32   token ids of every kept conversation, concatenated
    mask.u8        uint8   1 where the token is supervised (the assistant's), same length
    offsets.i64    int64   [n + 1]: conversation i is ids[offsets[i]:offsets[i + 1]]
    lines.i64      int64   [n] its line in its shard     files.i32  int32 [n] which shard
    truncated.u8   uint8   [n] cut at data.max_length
    header.json    written last: format, key, source, counts; a store without it is not one

The key is sha256 of the source's contents (every shard), the tokenizer (its serialisation and
special tokens), the chat template text, `data.chat_template_kwargs`, `data.max_length` (what is
kept of a conversation depends on it) and STORE_FORMAT: the same data, tokenizer and settings
find the same store, on a resume or in another run; anything else makes a new one.

Why numpy memmap and not Arrow (`datasets`): the trainer needs three flat arrays read by offset,
which a memmap gives with no new dependency, no cache logic of its own, and pages shared by
every process of the node through the page cache; a rank touches only the pages of its rows.

Building streams the source in chunks through a bounded pool of tokenizer processes (`workers`
per node: only one process of a node builds) and appends to the arrays, so neither the builder
nor a reader holds the corpus: what a reader keeps grows by 8 bytes a conversation (lengths).
The build happens in `.<name>.tmp-<host>-<pid>` beside the store and is renamed into place, under
an flock, so concurrent builders (ranks of several nodes on shared storage, tests) do not clash.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workload.common.jsonfile import write_json_atomic
from workload.data.batches import TokenArrays
from workload.data.chat import (
    PAST_MAX_LENGTH,
    DataError,
    Example,
    Rendered,
    has_anchor,
    parse_line,
    render_at,
)
from workload.data.source import DataSource, raw_lines, source_digest

STORE_FORMAT = 3  # bump when render_rows' output or this layout changes (3: rows cut at
# max_length counted, a reply never found by a guess)
HEADER = "header.json"
CHUNK = 512  # conversations a tokenizer worker renders at a time
PROGRESS_S = 10.0
EXAMPLES_KEPT = 20  # unplaced turns named in the header, beside the counts


@dataclass
class Report:
    """What the build made of the conversations beyond the rows: the store's report."""

    conversations: int = 0  # lines read
    turns: int = 0  # assistant turns placed in rows
    cut: int = 0  # of them, replies datagen cut at max_new_tokens (trained with no end token)
    length_cut: int = 0  # of them, replies that run past max_length (trained up to it)
    lost: int = 0  # supervised tokens past max_length (in length_cut turns and left-out ones)
    no_reasoning: int = 0  # turns trained without the data's reasoning (thinking off)
    skipped: int = 0  # rows with no eligible anchor within max_length
    unplaced: dict[str, int] = field(default_factory=dict)  # reason -> turns left out
    examples: list[str] = field(default_factory=list)  # "FILE:LINE: reason", the first few

    _COUNTS = ("conversations", "turns", "cut", "length_cut", "lost", "no_reasoning", "skipped")

    def add(self, out: Rendered, where: str) -> None:
        self.conversations += 1
        self.turns += out.turns
        self.cut += out.cut
        self.length_cut += out.length_cut
        self.lost += out.lost
        self.no_reasoning += out.no_reasoning
        for why in out.unplaced:
            self.unplaced[why] = self.unplaced.get(why, 0) + 1
            if len(self.examples) < EXAMPLES_KEPT:
                self.examples.append(f"{where}: {why}")

    def merge(self, other: Report) -> None:
        for name in self._COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for why, n in other.unplaced.items():
            self.unplaced[why] = self.unplaced.get(why, 0) + n
        self.examples += other.examples[: EXAMPLES_KEPT - len(self.examples)]

    def fields(self) -> dict[str, Any]:
        return {"conversations_read": self.conversations, "turns": self.turns, "cut": self.cut,
                "length_cut": self.length_cut, "supervised_lost": self.lost,
                "no_reasoning": self.no_reasoning, "skipped": self.skipped,
                "unplaced": dict(sorted(self.unplaced.items())),
                "unplaced_examples": self.examples}  # fmt: skip


def lost_share(h: dict[str, Any]) -> float:
    """The share of the data's supervised tokens that lie past max_length (header fields)."""
    lost = h.get("supervised_lost", 0)
    return lost / max(1, h["supervised"] + lost)


def length_line(h: dict[str, Any]) -> str:
    """What max_length cost, e.g. "3 turns cut at max_length 4096, 2 left out past it: 4.1%
    of the supervised tokens lost"."""
    past = h.get("unplaced", {}).get(PAST_MAX_LENGTH, 0)
    return (f"{h.get('length_cut', 0)} turns cut at max_length {h['max_length']}, {past} left "
            f"out past it: {lost_share(h):.1%} of the supervised tokens lost")  # fmt: skip


def report_line(h: dict[str, Any]) -> str:
    """The store's report in one line (header fields)."""
    left = sum(h.get("unplaced", {}).values())
    why = "; ".join(f"{n} {reason}" for reason, n in h.get("unplaced", {}).items())
    return (f"{h['conversations']} rows from {h.get('conversations_read', '?')} conversations "
            f"({h.get('turns', '?')} assistant turns, {h.get('cut', 0)} cut at max_new_tokens"
            f"{f', {left} left out: {why}' if left else ''}), {h['tokens']} tokens "
            f"({h['supervised']} supervised), {h['skipped']} rows skipped without an anchor; "
            f"{length_line(h)}")  # fmt: skip


_ARRAYS = {  # name -> dtype, per token (ids, mask) or per conversation
    "ids.i32": np.int32,
    "mask.u8": np.uint8,
    "lines.i64": np.int64,
    "files.i32": np.int32,
    "truncated.u8": np.uint8,
}


@dataclass(frozen=True)
class RenderSettings:
    max_length: int
    chat_template: str | None = None  # the template text (None: the tokenizer's own)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids: its serialisation (vocabulary, merges, added
    tokens, normalisation) and its special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = {k: getattr(tokenizer, k, None) for k in ("eos_token", "pad_token", "unk_token")}
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()


def template_digest(tokenizer: Any, settings: RenderSettings) -> str:
    template = settings.chat_template or getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


def store_key(source_sha: str, tokenizer_sha: str, template_sha: str, s: RenderSettings) -> str:
    payload = {
        "format": STORE_FORMAT,
        "source": source_sha,
        "tokenizer": tokenizer_sha,
        "chat_template": template_sha,
        "chat_template_kwargs": s.template_kwargs,
        "max_length": s.max_length,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def store_root(source: DataSource, run_dir: Path | None, cache_dir: str | None) -> Path:
    """Where stores of `source` live: `data.cache_dir` when set; else `.tokens/` beside the data
    (the file's or the directory's parent) when that is writable; else the run's workspace
    (`<workspace>/cache/tokens` for a run in `<workspace>/runs/<run>`, else `<run_dir>/tokens`)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    beside = source.path.parent / ".tokens"
    if _writable(beside):
        return beside
    if run_dir is None:
        return Path(tempfile.gettempdir()) / "dflashops-tokens"
    run_dir = Path(run_dir).resolve()
    if run_dir.parent.name == "runs":
        return run_dir.parent.parent / "cache" / "tokens"
    return run_dir / "tokens"


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


# ---------------------------------------------------------------- reading


class TokenStore:
    """A complete store, memory-mapped read-only."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.header: dict[str, Any] = json.loads((self.path / HEADER).read_text())
        if self.header.get("format") != STORE_FORMAT:
            raise DataError(f"{self.path}: token store format {self.header.get('format')}, "
                            f"this trainer reads {STORE_FORMAT}; delete it to rebuild")  # fmt: skip
        self.files: list[str] = self.header["source"]["files"]
        self.offsets = np.fromfile(self.path / "offsets.i64", dtype=np.int64)
        self.arrays = TokenArrays(self._map("ids.i32"), self._map("mask.u8"), self.offsets)

    def _map(self, name: str) -> np.ndarray:
        return np.memmap(self.path / name, dtype=_ARRAYS[name], mode="r")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def source_of(self, i: int) -> str:
        f = int(self._map("files.i32")[i])
        return f"{self.files[f]}:{int(self._map('lines.i64')[i])}"

    def example(self, i: int) -> Example:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return Example(
            self.arrays.ids[lo:hi].tolist(),
            self.arrays.mask[lo:hi].astype(int).tolist(),
            truncated=bool(self._map("truncated.u8")[i]),
            source=self.source_of(i),
        )

    def truncated_count(self) -> int:
        return int(self._map("truncated.u8").sum())

    def summary(self) -> str:
        return report_line(self.header)


def find_or_build(
    source: DataSource,
    tokenizer: Any,
    settings: RenderSettings,
    *,
    root: Path,
    workers: int | None = None,
    say: Callable[[str], None] = print,
) -> TokenStore:
    """The store of (source, tokenizer, settings) under `root`, built when missing (DataError
    on bad data: nothing is left behind). One process of a node calls this; the others open
    the path it returns."""
    root.mkdir(parents=True, exist_ok=True)
    source_sha = source_digest(source, memo=root / "digests.json")
    tokenizer_sha = tokenizer_digest(tokenizer)
    key = store_key(source_sha, tokenizer_sha, template_digest(tokenizer, settings), settings)
    dest = root / f"{source.path.name}.{key[:16]}"
    with open(root / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_stale_builds(dest)
        if not (dest / HEADER).is_file():
            t0 = time.monotonic()
            header = build(source, tokenizer, settings, dest, key=key, workers=workers, say=say,
                           digests={"source": source_sha, "tokenizer": tokenizer_sha})  # fmt: skip
            say(f"data: tokenized {source.describe()} into {dest} in "
                f"{time.monotonic() - t0:.1f}s: {report_line(header)} (max_length "
                f"{settings.max_length})")  # fmt: skip
            for example in header["unplaced_examples"][:3]:
                say(f"data: left out: {example}")
            return TokenStore(dest)
    store = TokenStore(dest)
    say(f"data: reusing {dest} (tokenized {time.ctime(store.header['built'])}): "
        f"{store.summary()}")  # fmt: skip
    return store


# ---------------------------------------------------------------- building


def _remove_stale_builds(dest: Path) -> None:
    """Temporary directories of builds of `dest` on this machine whose process is gone."""
    host = socket.gethostname()
    for tmp in dest.parent.glob(f".{dest.name}.tmp-{host}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def default_workers(source: DataSource) -> int:
    """Tokenizer processes of a node: 1 for a small source, else the node's CPUs, at most 16."""
    if source.bytes < (8 << 20):
        return 1
    return max(1, min(16, len(os.sched_getaffinity(0))))


_JOB: dict[str, Any] = {}  # what forked tokenizer workers render with (inherited, not pickled)


def _render_chunk(items: list[tuple[int, int, bytes]]) -> tuple[Any, ...]:
    tokenizer, s, names = _JOB["tokenizer"], _JOB["settings"], _JOB["names"]
    ids: list[list[int]] = []
    masks: list[list[int]] = []
    lines, files, truncated = [], [], []
    report = Report()
    for fi, lineno, raw in items:
        where = f"{names[fi]}:{lineno}"
        out = render_at(tokenizer, parse_line(raw, where), where, max_length=s.max_length,
                        template=s.chat_template, template_kwargs=s.template_kwargs)  # fmt: skip
        report.add(out, where)
        for ex in out.rows:
            if not has_anchor(ex.loss_mask):
                report.skipped += 1
                continue
            ids.append(ex.input_ids)
            masks.append(ex.loss_mask)
            lines.append(lineno)
            files.append(fi)
            truncated.append(ex.truncated)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat_ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(lengths.sum()))
    flat_mask = np.fromiter((m for x in masks for m in x), dtype=np.uint8, count=len(flat_ids))
    return (flat_ids, flat_mask, lengths, np.array(lines, np.int64), np.array(files, np.int32),
            np.array(truncated, np.uint8), report)  # fmt: skip


def _chunks(source: DataSource) -> Iterable[list[tuple[int, int, bytes]]]:
    chunk: list[tuple[int, int, bytes]] = []
    for item in raw_lines(source):
        chunk.append(item)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _worker_init() -> None:
    """A tokenizer worker takes the default signal dispositions, not the trainer's handlers it
    was forked with: SIGTERM ends it (the trainer's handler only asks for a stop, which would
    leave a pool that terminates its workers waiting for ever), and Ctrl-C is the trainer's."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _rendered(source: DataSource, workers: int) -> Iterable[tuple[Any, ...]]:
    """Rendered chunks in source order; at most 2 x workers chunks in flight (bounded memory).
    A worker that dies (killed, out of memory) fails the build in one line, never hangs it."""
    if workers <= 1:
        yield from map(_render_chunk, _chunks(source))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_worker_init)  # fmt: skip
    try:
        pending: deque = deque()
        for chunk in _chunks(source):
            pending.append(pool.submit(_render_chunk, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise DataError(f"{source.path}: a tokenizer worker died (out of memory? fewer "
                        "data.workers use less)") from None  # fmt: skip
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def build(
    source: DataSource,
    tokenizer: Any,
    settings: RenderSettings,
    dest: Path,
    *,
    key: str,
    digests: dict[str, str],
    workers: int | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Render `source` into a new store at `dest` (atomically); returns its header. `digests`:
    the source's and the tokenizer's, as in the key."""
    workers = default_workers(source) if workers is None else max(1, workers)
    names = [str(f) for f in source.files]
    tmp = dest.parent / f".{dest.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _JOB.update(tokenizer=tokenizer, settings=settings, names=names)
    t0 = last = time.monotonic()
    n = tokens = supervised = 0
    report = Report()
    try:
        outs = {name: (tmp / name).open("wb") for name in (*_ARRAYS, "offsets.i64")}
        try:
            outs["offsets.i64"].write(np.zeros(1, np.int64).tobytes())
            for ids, mask, lengths, lines, files, trunc, part in _rendered(source, workers):
                for name, values in (("ids.i32", ids), ("mask.u8", mask), ("lines.i64", lines),
                                     ("files.i32", files), ("truncated.u8", trunc)):  # fmt: skip
                    outs[name].write(values.tobytes())
                outs["offsets.i64"].write((tokens + np.cumsum(lengths)).tobytes())
                n, tokens = n + len(lengths), tokens + int(lengths.sum())
                supervised = supervised + int(mask.sum())
                report.merge(part)
                if time.monotonic() - last >= PROGRESS_S:
                    last = time.monotonic()
                    done = report.conversations
                    say(f"data: tokenizing {source.describe()}: {done} conversations, "
                        f"{done / (last - t0):.0f}/s, {workers} worker(s)")  # fmt: skip
            for f in outs.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in outs.values():
                f.close()
        if n == 0:
            raise DataError(f"{source.path}: no usable conversations")
        header = {
            "format": STORE_FORMAT,
            "key": key,
            "source": {
                "path": str(source.path),
                "kind": source.kind,
                "files": names,
                "sha256": digests["source"],
            },
            "tokenizer_sha256": digests["tokenizer"],
            "chat_template_sha256": template_digest(tokenizer, settings),
            "chat_template_kwargs": settings.template_kwargs,
            "max_length": settings.max_length,
            "conversations": n,  # rows (the name of format 1, kept for readers)
            "tokens": tokens,
            "supervised": supervised,
            **report.fields(),
            "workers": workers,
            "seconds": round(time.monotonic() - t0, 2),
            "built": time.time(),
        }
        write_json_atomic(tmp / HEADER, header)
        if dest.exists():  # a directory without a header is no store: nobody reads it
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _JOB.clear()
    return header
