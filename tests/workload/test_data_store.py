"""The trainer's data at scale: one token store per data set (reused, never rebuilt), shards and
datagen datasets as sources, the held-out split and its val_* metrics, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.workload.test_train import (  # noqa: F401 - group is a fixture
    REPO,
    SMALL,
    TEMPLATE,
    build_settings,
    config,
    group,
    read_log,
)
from workload.common.provenance import target_digest
from workload.config import audit_json
from workload.data.token_store import HEADER, length_line, lost_share
from workload.train import loop as T

pytestmark = pytest.mark.usefixtures("group")  # in-process runs share one process group


def _conversation(i: int) -> dict:
    """A short conversation no other index has (its number is in both turns)."""
    return {"messages": [{"role": "user", "content": f"Say {i} twice."},
                         {"role": "assistant", "content": f"Here it is: {i} {i}."}]}  # fmt: skip


def _write(path: Path, conversations) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for c in conversations:
            f.write(json.dumps(c) + "\n")
    return path


def _stores(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob(f"*/{HEADER}"))


def _manifest(made_by: Path, n: int, **changes) -> dict:
    manifest = {
        "input": n, "done": n, "failed": 0, "skipped": 0, "complete": True,
        "target": {"path": str(made_by), "digest": target_digest(made_by)},
        "engine": {"name": "transformers", "version": "test"},
        "sampling": {"temperature": 0, "max_new_tokens": 64}, "chat_template_kwargs": {},
        "source": {"path": "prompts.jsonl", "sha256": "0" * 64}, "failures": [],
    }  # fmt: skip
    manifest.update(changes)
    return manifest


def _datagen_dir(path: Path, made_by: Path, n: int, **changes) -> Path:
    for k in range(2):
        _write(path / f"shard-{k:05d}.jsonl",
               ({**_conversation(i), "source": f"prompts.jsonl:{i + 1}"}
                for i in range(k * n // 2, (k + 1) * n // 2)))  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(_manifest(made_by, n, **changes)))
    return path


def _row_docs(batch) -> list[tuple[int, ...]]:
    """Every document of a batch as its token ids (rows split at doc_ids)."""
    out = []
    for ids, docs in zip(batch.input_ids.tolist(), batch.doc_ids.tolist(), strict=True):
        for d in sorted(set(docs) - {-1}):
            out.append(tuple(t for t, k in zip(ids, docs, strict=True) if k == d))
    return out


# ---------------------------------------------------------------- the held-out split


@pytest.mark.parametrize("pack", [False, True])
def test_the_holdout_never_appears_in_training_batches(tiny_dense, tmp_path, pack):
    data = _write(tmp_path / "chat.jsonl", (_conversation(i) for i in range(120)))
    cfg = config(tiny_dense, f"data.path={data}", "data.holdout=0.2", f"data.pack={pack}".lower())
    run, _ = T.setup(cfg, T.init_distributed(), say=lambda m: None, run_dir=tmp_path / "run")
    store = run.holdout.arrays
    held = {tuple(store.ids[store.offsets[d] : store.offsets[d + 1]].tolist())
            for d in run.holdout.mine}  # fmt: skip
    assert len(held) == 24 == run.holdout.total
    trained: list[tuple[int, ...]] = []
    for _ in range(2 * run.stream.rows_per_epoch // cfg.optim.batch_size + 1):  # two epochs
        trained += _row_docs(run.stream.next_batch())
    assert not held & set(trained)
    assert len(set(trained)) == 96  # every other conversation trains
    val = [doc for batch in run.holdout for doc in _row_docs(batch)]
    assert set(val) == held and len(val) == 24  # the val pass reads each held-out one once


def test_val_metrics_at_val_every_and_kept_on_every_line(tiny_dense, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(tiny_dense, "log.val_every=3", "data.holdout=8")
    assert T.train(cfg, run_dir) == 0
    lines = read_log(run_dir)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 6, 8]  # 3 and 6 are lines of their own
    val_keys = {"val_loss", "val_acc", "val_streak", "val_dds8"}
    for r in lines:
        assert (val_keys <= set(r)) == (r["step"] % 3 == 0), r
        assert 0.0 <= r["kept"] <= 1.0
    for r in (r for r in lines if r["step"] % 3 == 0):
        assert r["val_loss"] > 0 and 0 <= r["val_acc"] <= 1 and 0 <= r["val_streak"] <= 3
    # the drafter trains between the two passes over the same held-out rows: the loss moves
    assert lines[2]["val_loss"] != lines[4]["val_loss"]


# ---------------------------------------------------------------- the store


def test_a_second_start_does_not_tokenize_again(tiny_dense, tmp_path, capsys):
    data = _write(tmp_path / "data" / "chat.jsonl", (_conversation(i) for i in range(200)))
    cfg = config(tiny_dense, f"data.path={data}")
    T.setup(cfg, T.init_distributed(), run_dir=tmp_path / "run1")
    first = capsys.readouterr().out
    assert "data: tokenized" in first and "data: reusing" not in first
    (store,) = _stores(tmp_path / "data" / ".tokens")  # beside the data: it is writable
    stamps = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    time.sleep(0.05)
    T.setup(config(tiny_dense, f"data.path={data}"), T.init_distributed(), run_dir=tmp_path / "r2")
    second = capsys.readouterr().out
    assert "data: reusing" in second and "data: tokenized" not in second
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == stamps
    assert json.loads((store / HEADER).read_text())["conversations"] == 200
    # other chat template settings are another store
    T.setup(config(tiny_dense, f"data.path={data}", "data.chat_template_kwargs={greeting: hi}"),
            T.init_distributed(), run_dir=tmp_path / "r3")  # fmt: skip
    assert "data: tokenized" in capsys.readouterr().out
    assert len(_stores(tmp_path / "data" / ".tokens")) == 2


def test_the_store_goes_to_the_workspace_when_the_data_dir_is_read_only(tiny_dense, tmp_path):
    data = _write(tmp_path / "ro" / "chat.jsonl", (_conversation(i) for i in range(50)))
    os.chmod(tmp_path / "ro", 0o555)
    run_dir = tmp_path / "ws" / "runs" / "r1"
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root may write anyway: make .tokens a file
            os.chmod(tmp_path / "ro", 0o755)
            (tmp_path / "ro" / ".tokens").write_text("not a directory")
        T.setup(config(tiny_dense, f"data.path={data}"), T.init_distributed(), run_dir=run_dir)
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    assert len(_stores(tmp_path / "ws" / "cache" / "tokens")) == 1
    cache = tmp_path / "elsewhere"
    T.setup(config(tiny_dense, f"data.path={data}", f"data.cache_dir={cache}"),
            T.init_distributed(), run_dir=run_dir)  # fmt: skip
    assert len(_stores(cache)) == 1


def test_a_directory_of_shards_and_a_datagen_dataset_train(tiny_dense, tmp_path):
    shards = tmp_path / "shards"
    for k in range(3):
        _write(shards / f"part-{k}.jsonl", (_conversation(i) for i in range(k * 40, k * 40 + 40)))
    target = Path(build_settings(tiny_dense)[0].split("=", 1)[1])
    made = _datagen_dir(tmp_path / "data" / "made", target, 100)
    for data, kind, n in ((shards, "shards", 120), (made, "datagen", 100)):
        run_dir = tmp_path / f"run-{kind}"
        assert T.train(config(tiny_dense, f"data.path={data}", "optim.max_steps=2"), run_dir) == 0
        assert [r["step"] for r in read_log(run_dir)] == [1, 2]
        (store,) = _stores(data.parent / ".tokens")
        header = json.loads((store / HEADER).read_text())
        assert (header["source"]["kind"], header["conversations"]) == (kind, n)
        items = json.loads((run_dir / "audit.json").read_text())
        audit = {i["key"]: i for i in items if i["level"] != "peer"}  # not the recipe's own
        lost = audit["dataset.lost"]  # what max_length cost the store: said, for `diff`
        assert lost["value"] == f"{lost_share(header):.1%}" and lost["note"] == length_line(header)
        if kind == "datagen":  # made by this target at temperature 0: nothing to say
            assert "data.path" not in audit and "loss.on_trajectory" not in audit, audit
        else:  # nothing says who wrote the replies
            assert audit["loss.on_trajectory"]["level"] == "info"


def test_the_audit_warns_about_data_not_made_by_this_target(tiny_dense, tmp_path):
    target = Path(build_settings(tiny_dense)[0].split("=", 1)[1])
    other = _datagen_dir(tmp_path / "other", target, 40, target={"path": "/models/other",
                         "digest": "f" * 64}, sampling={"temperature": 0.7, "max_new_tokens": 9},
                         chat_template_kwargs={"enable_thinking": True})  # fmt: skip
    _, items = T.setup(config(tiny_dense, f"data.path={other}",
                              "data.chat_template_kwargs={enable_thinking: false}"),
                       T.init_distributed(), say=lambda m: None, run_dir=tmp_path / "run")  # fmt: skip
    warned = {i["key"]: i["note"] for i in audit_json(items) if i["level"] == "warn"}
    assert "/models/other" in warned["data.path"] and "temperature 0.7" in warned["data.path"]
    assert "not made by this target" in warned["loss.on_trajectory"]
    assert "enable_thinking" in warned["data.chat_template_kwargs"]


def test_an_incomplete_datagen_dataset_is_refused_in_one_line(tiny_dense, tmp_path, capsys):
    target = Path(build_settings(tiny_dense)[0].split("=", 1)[1])
    half = _datagen_dir(tmp_path / "half", target, 40, complete=False, done=20)
    sets = [a for item in (*build_settings(tiny_dense), *SMALL) for a in ("--set", item)]
    argv = ["--config", str(TEMPLATE), "--run-dir", str(tmp_path / "run"), *sets,
            "--set", f"data.path={half}"]  # fmt: skip
    assert T.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: data.path: {half} is a datagen"), err
    assert "not complete" in err[0] and "done 20" in err[0]
    assert not (half.parent / ".tokens").exists() or not _stores(half.parent / ".tokens")


def test_tokenizer_workers_build_the_same_store(chat_tokenizer, tmp_path):
    from workload.data.source import open_source
    from workload.data.token_store import RenderSettings, TokenStore, build

    data = _write(tmp_path / "chat.jsonl", (_conversation(i) for i in range(3000)))
    stores = []
    for workers in (1, 2):
        dest = tmp_path / f"w{workers}"
        build(open_source(data), chat_tokenizer, RenderSettings(64), dest, key="k",
              digests={"source": "s", "tokenizer": "t"}, workers=workers, say=print)  # fmt: skip
        stores.append(TokenStore(dest))
    one, two = stores
    for name in ("ids", "mask", "offsets"):
        assert np.array_equal(getattr(one.arrays, name), getattr(two.arrays, name)), name
    assert len(one) == 3000 and one.source_of(2999) == f"{data}:3000" == two.source_of(2999)
    assert one.example(5) == two.example(5)


# ---------------------------------------------------------------- memory


def _trainer_peak(build: Path, data: Path, run_dir: Path) -> tuple[int, float]:
    """(peak RSS in bytes of the trainer process and what it waited for, seconds to the first
    log line) of a two-step run."""
    sets = [a for item in (*build_settings(build), *SMALL, f"data.path={data}",
                           "optim.max_steps=2", "data.holdout=16") for a in ("--set", item)]  # fmt: skip
    cmd = [sys.executable, "-m", "workload.train", "--config", str(TEMPLATE),
           "--run-dir", str(run_dir), *sets]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    t0 = time.time()
    with open(run_dir.parent / f"{run_dir.name}.err", "w+b") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        assert proc.returncode == 0, err.read().decode()[-2000:]
    first = read_log(run_dir)[0]["time"]
    return usage.ru_maxrss * 1024, first - t0


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tiny_dense, tmp_path):
    """200k conversations and 2k: the same peak resident memory within 1.3x."""
    small = _write(tmp_path / "small" / "chat.jsonl", (_conversation(i) for i in range(2_000)))
    big = _write(tmp_path / "big" / "chat.jsonl", (_conversation(i) for i in range(200_000)))
    rss_small, _ = _trainer_peak(tiny_dense, small, tmp_path / "run-small")
    rss_big, first_step = _trainer_peak(tiny_dense, big, tmp_path / "run-big")
    print(f"\npeak RSS: 2k {rss_small / 2**20:.0f} MiB, 200k {rss_big / 2**20:.0f} MiB "
          f"(first step after {first_step:.0f}s)")  # fmt: skip
    assert rss_big <= 1.3 * rss_small, (rss_small, rss_big)
    (store,) = _stores(tmp_path / "big" / ".tokens")
    assert json.loads((store / HEADER).read_text())["conversations"] == 200_000
    ids = np.memmap(store / "ids.i32", dtype=np.int32, mode="r")
    assert len(ids) == json.loads((store / HEADER).read_text())["tokens"]
