"""The output directory of `workload.datagen` (CONTRACTS §7): chunks, their records, the manifest.

```
DIR/chunk_<K>.jsonl        chunk K's finished conversations, {"messages", "source": "FILE:LINE",
                           "turns": [{"prompt_ids", "reply_ids", "finish_reason"}, ...]}
DIR/chunks/chunk_<K>.json  chunk K's record: counts, failures and skips with source and reason,
                           the jsonl's size and sha256, the job's settings digest; written last
DIR/job.json               the settings every chunk was made with (a rerun must match them)
DIR/manifest.json          the reconciled dataset (written by reconcile)
DIR/ranks/rank_<R>.json    each rank's heartbeat; DIR/state.json: rank 0's job state
```

A chunk is finished when its record exists: the jsonl is renamed into place first, then the
record, each from a temporary file, so a process killed at any moment leaves either a finished
chunk or one that a rerun makes again from the start. K is zero-padded to 6 digits, so the
files sort in input order.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import DATASET_MANIFEST as MANIFEST
from workload.common.processes import pid_alive

CHUNKS_DIR = "chunks"
JOB = "job.json"
LOCK = ".lock"
_RECORD_RE = re.compile(r"^chunk_(\d{6,})\.json$")
_TMP_RE = re.compile(r"^\..+\.(\d+)\.tmp$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class OutputError(Exception):
    """DIR cannot take this job (other settings, a foreign chunk): the message names it."""


def chunk_name(k: int) -> str:
    return f"chunk_{k:06d}.jsonl"


def record_path(out: Path, k: int) -> Path:
    return out / CHUNKS_DIR / f"chunk_{k:06d}.json"


@dataclass
class ChunkResult:
    """What one chunk made: the finished conversations and the fate of every other one."""

    chunk: int
    first_line: int
    count: int
    records: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    skips: list[dict[str, str]] = field(default_factory=list)
    truncated: int = 0  # replies cut at the length limit (the manifest's `cut`)
    replies: int = 0  # assistant turns written
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    @property
    def done(self) -> int:
        return len(self.records)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Exclusive lock of DIR among the ranks of this machine (job.json, the manifest)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_chunk(out: Path, result: ChunkResult, settings_digest: str, rank: int) -> dict:
    """Write chunk's jsonl, then its record; returns the record."""
    data = b"".join(
        json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in result.records
    )
    _write_atomic(out / chunk_name(result.chunk), data)
    record = {
        "chunk": result.chunk, "first_line": result.first_line, "count": result.count,
        "done": result.done, "failed": len(result.failures), "skipped": len(result.skips),
        "truncated": result.truncated, "replies": result.replies, "failures": result.failures, "skips": result.skips,
        "file": chunk_name(result.chunk), "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(), "settings": settings_digest,
        "prompt_tokens": result.prompt_tokens, "generated_tokens": result.generated_tokens,
        "seconds": round(result.seconds, 3), "rank": rank, "pid": os.getpid(),
        "time": time.time(),
    }  # fmt: skip
    write_json_atomic(record_path(out, result.chunk), record)
    return record


def read_records(out: Path) -> dict[int, dict]:
    """The records of finished chunks in DIR, by chunk number (unreadable ones are not)."""
    records: dict[int, dict] = {}
    root = out / CHUNKS_DIR
    if not root.is_dir():
        return records
    for entry in root.iterdir():
        m = _RECORD_RE.match(entry.name)
        if not m:
            continue
        try:
            records[int(m.group(1))] = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue  # cannot be half-written (renamed into place): a damaged copy, redo it
    return records


def remove_stale_temporaries(out: Path) -> int:
    """Delete temporary files whose writer (a pid on this machine) is gone."""
    removed = 0
    for root in (out, out / CHUNKS_DIR):
        if not root.is_dir():
            continue
        for entry in root.iterdir():
            m = _TMP_RE.match(entry.name)
            if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
                entry.unlink(missing_ok=True)
                removed += 1
    return removed


# ---------------------------------------------------------------- the job's settings


def settings_digest(settings: dict) -> str:
    """Digest of what makes the data what it is (paths excluded: a moved file is the same)."""
    keyed = {k: v for k, v in settings.items() if k not in ("source", "target")}
    keyed["source_sha256"] = settings["source"]["sha256"]
    keyed["target_digest"] = settings["target"]["digest"]
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()


def _differences(old: dict, new: dict) -> list[str]:
    out = []
    for key in ("source_sha256", "target_digest", "engine", "sampling", "chat_template_kwargs",
                "chat_template_sha256", "max_model_len", "chunk", "seed"):  # fmt: skip
        a, b = _flat(old).get(key), _flat(new).get(key)
        if a != b:
            out.append(f"{key} {json.dumps(a)} (this run: {json.dumps(b)})")
    return out


def _flat(settings: dict) -> dict:
    return {**settings, "source_sha256": settings.get("source", {}).get("sha256"),
            "target_digest": settings.get("target", {}).get("digest")}  # fmt: skip


def ensure_job(out: Path, settings: dict) -> str:
    """Record the job's settings in DIR/job.json, or check them against those recorded there;
    returns the settings digest. OutputError when DIR was made with other settings."""
    digest = settings_digest(settings)
    with locked(out):
        path = out / JOB
        if path.is_file():
            job = json.loads(path.read_text())
            if job.get("digest") != digest:
                diff = "; ".join(_differences(job.get("settings", {}), settings))
                raise OutputError(f"{out}: made by a datagen job with other settings ({diff}): "
                                  "run it with the same arguments, or use a new --out")  # fmt: skip
            return digest
        write_json_atomic(path, {"settings": settings, "digest": digest, "created": time.time()})
    return digest


def read_job(out: Path) -> dict:
    try:
        return json.loads((out / JOB).read_text())
    except FileNotFoundError:
        raise OutputError(f"{out}: no {JOB} here: not the output of workload.datagen") from None
    except (OSError, ValueError) as exc:
        raise OutputError(f"{out / JOB}: cannot read: {exc}") from None


# ---------------------------------------------------------------- the target's fingerprint


def target_digest(path: Path) -> str:
    """sha256 of config.json, the weights index (if any) and the weight files' names and sizes
    (not their bytes: a 27B target is 54 GB)."""
    h = hashlib.sha256()
    h.update(b"config.json\0" + (path / "config.json").read_bytes())
    for name in WEIGHT_INDEXES:
        if (path / name).is_file():
            h.update(f"\0{name}\0".encode() + (path / name).read_bytes())
    for entry in sorted(path.iterdir(), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith(WEIGHT_SUFFIXES):
            h.update(f"\0{entry.name}\0{entry.stat().st_size}".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the manifest


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _chunk_problem(out: Path, k: int, record: dict, expected: int, digest: str,
                   verify: bool) -> str | None:  # fmt: skip
    if record.get("settings") != digest:
        return f"chunk {k}: made with other settings than {out / JOB}"
    if record.get("count") != expected:
        return f"chunk {k}: holds {record.get('count')} conversations, the input {expected}"
    if record["done"] + record["failed"] + record["skipped"] != record["count"]:
        return f"chunk {k}: done + failed + skipped != {record['count']}"
    path = out / record["file"]
    if not path.is_file():
        return f"chunk {k}: {record['file']} is missing"
    if path.stat().st_size != record["bytes"]:
        return f"chunk {k}: {record['file']} has {path.stat().st_size} bytes, its record says {record['bytes']}"  # noqa: E501
    if verify and _file_sha256(path) != record["sha256"]:
        return f"chunk {k}: {record['file']} does not match its record's sha256"
    return None


def reconcile(out: Path, *, verify: bool = False) -> dict:
    """The manifest of what DIR holds now (complete only when every chunk of the input is
    finished and its file is there). `verify`: also check each file's sha256 (after a copy).
    Written atomically to DIR/manifest.json under the lock; returned."""
    with locked(out):
        job = read_job(out)
        settings, digest = job["settings"], job["digest"]
        chunk, total = settings["chunk"], settings["source"]["total"]
        expected_chunks = -(-total // chunk)
        records = read_records(out)
        problems, good = [], {}
        for k in range(expected_chunks):
            if k not in records:
                continue
            expected = min(chunk, total - k * chunk)
            problem = _chunk_problem(out, k, records[k], expected, digest, verify)
            if problem:
                problems.append(problem)
            else:
                good[k] = records[k]
        extra = sorted(k for k in records if k >= expected_chunks)
        problems += [f"chunk {k}: beyond the input's {expected_chunks} chunks" for k in extra]
        missing = [k for k in range(expected_chunks) if k not in good]
        counts = {key: sum(r.get(key, 0) for r in good.values())
                  for key in ("done", "failed", "skipped", "truncated", "replies",
                              "prompt_tokens", "generated_tokens")}  # fmt: skip
        finished = counts["done"] + counts["failed"] + counts["skipped"]
        manifest = {
            "input": total, "done": counts["done"], "failed": counts["failed"],
            "skipped": counts["skipped"], "complete": not missing and finished == total,
            "target": settings["target"], "engine": settings["engine"],
            "sampling": settings["sampling"],
            "chat_template_kwargs": settings["chat_template_kwargs"],
            "chat_template_sha256": settings["chat_template_sha256"],
            "source": {k: settings["source"][k] for k in ("path", "sha256")},
            "max_model_len": settings["max_model_len"], "chunk": chunk,
            "truncated": counts["truncated"], "cut": counts["truncated"],
            "replies": counts["replies"],
            "prompt_tokens": counts["prompt_tokens"],
            "generated_tokens": counts["generated_tokens"],
            "failures": [f for k in sorted(good) for f in good[k]["failures"]],
            "skips": [s for k in sorted(good) for s in good[k]["skips"]],
            "files": [good[k]["file"] for k in sorted(good)],
            "chunks": {"total": expected_chunks, "finished": len(good),
                       "missing": missing[:50], "problems": problems[:50]},
            "settings_digest": digest, "written": time.time(),
        }  # fmt: skip
        write_json_atomic(out / MANIFEST, manifest)
        return manifest
