"""Atomic checkpoints: a directory is complete only with a manifest that matches its files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workload.drafter import checkpoint as ck
from workload.train import save_restore


def payload(text: str):
    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_text(text)
        (directory / "config.json").write_text("{}")
        (directory / "sub").mkdir()
        (directory / "sub" / "x.bin").write_bytes(b"\0" * 10)

    return write


def test_save_writes_a_sha256sum_manifest_of_every_other_file(tmp_path):
    final = ck.save(tmp_path, 10, payload("weights"))
    assert final == tmp_path / "checkpoints" / "step_10"
    lines = (final / ck.MANIFEST).read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in lines) == [
        "config.json",
        "model.safetensors",
        "sub/x.bin",
    ]
    assert ck.verify(final)
    assert ck.latest_complete(tmp_path) == final
    # the manifest is readable by `sha256sum -c`
    done = subprocess.run(["sha256sum", "-c", ck.MANIFEST], cwd=final, capture_output=True)
    assert done.returncode == 0, done.stdout


def test_manifest_mismatch_is_incomplete(tmp_path):
    good = ck.save(tmp_path, 1, payload("a"))
    newer = ck.save(tmp_path, 2, payload("b"))
    (newer / "model.safetensors").write_text("c")  # corrupted after the fact
    assert not ck.verify(newer)
    assert ck.latest_complete(tmp_path) == good
    (newer / "model.safetensors").write_text("b")
    assert ck.verify(newer)
    (newer / "extra.txt").write_text("not listed")
    assert not ck.verify(newer)
    (newer / "extra.txt").unlink()
    (newer / "config.json").unlink()
    assert not ck.verify(newer)
    assert ck.latest_complete(tmp_path) == good


def test_directory_without_manifest_is_never_complete(tmp_path):
    good = ck.save(tmp_path, 5, payload("a"))
    bare = tmp_path / "checkpoints" / "step_9"
    bare.mkdir()
    payload("b")(bare)
    infos = ck.list_checkpoints(tmp_path)
    assert [(c.step, c.has_manifest) for c in infos] == [(5, True), (9, False)]
    assert ck.latest_complete(tmp_path) == good


def test_writer_killed_mid_save_leaves_no_complete_checkpoint(tmp_path):
    good = ck.save(tmp_path, 100, payload("a"))
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from workload.drafter import checkpoint as ck
        def slow(d: Path):
            (d / "model.safetensors").write_text("half")
            (d / "started").write_text("")
            time.sleep(60)
        ck.save({str(tmp_path)!r}, 200, slow)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    root = tmp_path / "checkpoints"
    deadline = time.time() + 30
    while not list(root.glob(".tmp-step_200-*/started")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [100]
    assert ck.latest_complete(tmp_path) == good
    # the temp dir is left behind by the dead writer; cleanup removes it
    removed = ck.remove_stale_temps(tmp_path)
    assert len(removed) == 1 and not removed[0].exists()


def test_stale_temp_cleanup_spares_live_writers(tmp_path):
    root = tmp_path / "checkpoints"
    live = root / f".tmp-step_3-{os.getpid()}-abcdef12"
    live.mkdir(parents=True)
    assert ck.remove_stale_temps(tmp_path) == []
    assert live.exists()


def test_cleanup_removes_a_replaced_checkpoint_left_half_deleted(tmp_path):
    root = tmp_path / "checkpoints"
    old = root / ".old-step_4-0123abcd"  # save() renamed step_4 away, then was killed
    (old / "sub").mkdir(parents=True)
    (old / "model.safetensors").write_text("x")
    assert ck.remove_stale_temps(tmp_path) == [old]
    assert not old.exists()


def test_failed_write_leaves_nothing(tmp_path):
    def broken(d: Path) -> None:
        (d / "model.safetensors").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ck.save(tmp_path, 7, broken)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_keep_policy_pure():
    steps = list(range(100, 1100, 100))
    assert ck.to_delete(steps, keep_last=3, keep_every=500) == [100, 200, 300, 400, 600, 700]
    assert ck.to_delete(steps, keep_last=3, keep_every=None) == steps[:-3]
    assert ck.to_delete([5], keep_last=3, keep_every=None) == []


def test_keep_policy_never_deletes_incomplete(tmp_path):
    for s in range(100, 700, 100):
        ck.save(tmp_path, s, payload(str(s)), keep_last=2, keep_every=300)
    in_progress = tmp_path / "checkpoints" / "step_50"
    in_progress.mkdir()
    temp = tmp_path / "checkpoints" / f".tmp-step_700-{os.getpid()}-00000000"
    temp.mkdir()
    ck.apply_keep_policy(tmp_path, keep_last=2, keep_every=300)
    left = [(c.step, c.has_manifest) for c in ck.list_checkpoints(tmp_path)]
    assert left == [(50, False), (300, True), (500, True), (600, True)]
    assert temp.exists()


def test_resaving_a_step_replaces_it(tmp_path):
    ck.save(tmp_path, 4, payload("old"))
    final = ck.save(tmp_path, 4, payload("new"))
    assert (final / "model.safetensors").read_text() == "new"
    assert ck.verify(final)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_4"]


def test_a_checkpoint_started_in_parts_lists_every_file(tmp_path):
    """Files written into the temporary directory first (optimizer shards as they arrive),
    the rest later: one manifest lists them all; nothing is complete before `complete`."""
    tmp = ck.begin(tmp_path, 6)
    (tmp / "optimizer").mkdir()
    (tmp / "optimizer" / "rank_1.pt").write_bytes(b"shard 1")
    assert ck.list_checkpoints(tmp_path) == []
    final = ck.complete(tmp_path, 6, tmp, payload("w"), keep_last=1)
    names = sorted(line.split("  ")[1] for line in (final / ck.MANIFEST).read_text().splitlines())
    assert names == ["config.json", "model.safetensors", "optimizer/rank_1.pt", "sub/x.bin"]
    assert ck.verify(final) and not tmp.exists()


def test_background_writer_keeps_a_failure_for_the_next_join(tmp_path):
    import threading

    writer = save_restore.BackgroundWriter()
    release = threading.Event()

    def slow() -> None:
        release.wait(30)
        ck.save(tmp_path, 1, payload("a"))

    writer.start("step_1", slow)
    assert writer.busy and not writer.failed
    assert writer.join(timeout=0.05) is False  # still writing
    release.set()
    assert writer.join() is True and ck.latest_complete(tmp_path) is not None

    def broken() -> None:
        raise OSError(28, "No space left on device")

    writer.start("step_2", broken)
    while writer.busy:
        time.sleep(0.01)
    assert writer.failed
    with pytest.raises(
        save_restore.CheckpointWriteError, match="step_2: writing failed: .*No space left"
    ):
        writer.join()
    assert writer.join() is True  # raised once, then the writer is idle again
    writer.start("step_3", broken)
    with pytest.raises(save_restore.CheckpointWriteError):  # starting the next write joins the last
        writer.start("step_4", lambda: None)
