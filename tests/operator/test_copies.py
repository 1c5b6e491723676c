"""Copies that do not collide, resume, clean up and fail clearly (issue 9, items 3 and 6), on
the fake Proxmox bed: real sshd, a faithful pct, ns containers, the real command line."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.operator.ckpt_copies import (
    BIG,
    SHARDS,
    big_checkpoint,
    checkpoint,
    cut_link,
    hashes,
    left_on_disk,
    sha,
    stop_mid_transfer,
    verified_names,
    wait_for,
)
from tests.operator.cli import dflashops, finished, start

pytestmark = pytest.mark.testbed


@pytest.fixture
def home(tmp_path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def inventory(testbed, tmp_path, home) -> Path:
    return testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct201": ("pve1", 201), "ct301": ("pve2", 301)}
    )


# ---------------------------------------------------------------- item 3: no collisions


def test_two_pushes_into_one_directory_at_once_both_succeed_with_whole_files(
    inventory, home, testbed, tmp_path
):
    trees = {}
    for who in ("a", "b"):
        tree = tmp_path / who
        tree.mkdir()
        for i in range(12):
            (tree / f"f{i}.bin").write_bytes(os.urandom(256 << 10))
        (tree / "big.bin").write_bytes(os.urandom(8 << 20))
        trees[who] = {p.name: sha(p) for p in tree.iterdir()}
    procs = [
        start("push", "ct201", str(tmp_path / who), "/workspace/shared", inventory=inventory,
              home=home)
        for who in ("a", "b")
    ]  # fmt: skip
    results = [finished(p) for p in procs]
    for code, _out, err in results:
        assert code == 0, err
    landed = testbed["pve1"][201].host_path("/workspace/shared")
    names = sorted(p.name for p in landed.iterdir())
    assert names == sorted(trees["a"]), names  # no temporary file left behind
    for name in names:  # each file whole: one push's version or the other's, never a mix
        assert sha(landed / name) in (trees["a"][name], trees["b"][name]), name


# ---------------------------------------------------------------- item 6: pull-ckpt


@pytest.fixture
def pair(testbed, make_container, tmp_path):
    """A source container (pve1) and a destination container (pve2), and their inventory."""
    src, dst = make_container("pve1"), make_container("pve2")
    inv = testbed.write_inventory(tmp_path / "pair.yaml", {"src": src, "dst": dst})
    return src, dst, inv


@pytest.mark.parametrize("fault", ["ctrl-c", "kill -9", "link cut"])
def test_pull_ckpt_cut_short_resumes_without_sending_verified_files_again(pair, home, fault):
    src, dst, inv = pair
    source = big_checkpoint(src)
    ckpts = dst.host_path("/workspace/ckpts/big")
    partial = ckpts / ".partial-step_4"
    dst.host.set_faults(slow_exec_stdin_after=12 << 20)  # the big file takes 12 s or more
    try:
        proc = start("pull-ckpt", "4", "--to", "dst", "--run", "big", inventory=inv, home=home)
        stop = {
            "ctrl-c": lambda: proc.send_signal(signal.SIGINT),
            "kill -9": proc.kill,
            "link cut": lambda: cut_link(dst.host),
        }[fault]
        code, err, seconds = stop_mid_transfer(proc, partial, stop)
    finally:
        dst.host.set_faults()
    # a cut link: 3 where paramiko carries the bytes, 1 or 3 with the OpenSSH client (its
    # own words: "Connection reset", "client_loop: send disconnect: Broken pipe"...)
    expected = {"ctrl-c": [130], "kill -9": [-9], "link cut": [1, 3]}[fault]
    assert code in expected, err
    if fault == "link cut":
        assert err.strip().splitlines()[-1].startswith("dflashops: error: dst: "), err
    if fault != "kill -9":
        assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err, err
    left = left_on_disk(ckpts)
    print(f"\n{fault}: exit {code} after {seconds:.2f}s; left: {left}; said: {err.strip()}")
    # nothing complete-looking: no step_4, no manifest; only the files that verified
    assert left == [".partial-step_4", *(f".partial-step_4/{n}" for n in
                    sorted([".dflashops-verified", "config.json", *SHARDS]))]  # fmt: skip
    again = dflashops("--json", "pull-ckpt", "4", "--to", "dst", "--run", "big", inventory=inv,
                      home=home)  # fmt: skip
    assert again.code == 0, again.err
    doc = json.loads(again.out)
    assert doc["copied"] and doc["kept_files"] == 3 and doc["files"] == 4
    assert 96 << 20 <= doc["sent_bytes"] < (96 << 20) + (64 << 10)  # the big file only
    assert hashes(ckpts / "step_4") == hashes(source)
    assert sorted(p.name for p in ckpts.iterdir()) == ["run.yaml", "step_4"]


def test_pull_ckpt_from_a_source_that_freezes_fails_within_its_deadline(pair, home):
    """The source container frozen mid-copy (its tar stops; its host's sshd still answers
    keepalives): every side of the relay has the deadline, so the pull ends in about --timeout
    seconds, naming the source, and leaves nothing complete-looking (issue 16 item 2)."""
    src, dst, inv = pair
    big_checkpoint(src)
    ckpts = dst.host_path("/workspace/ckpts/big")
    partial = ckpts / ".partial-step_4"
    dst.host.set_faults(slow_exec_stdin_after=12 << 20)  # the big file takes 12 s or more
    proc = start("--timeout", "5", "pull-ckpt", "4", "--to", "dst", "--run", "big",
                 inventory=inv, home=home)  # fmt: skip
    try:
        code, err, seconds = stop_mid_transfer(proc, partial, src.freeze)
    finally:
        proc.kill()
        src.thaw()
        dst.host.set_faults()
    print(f"\nfrozen source: exit {code} after {seconds:.2f}s; said: {err.strip()}")
    assert code == 3, err
    assert err.strip().splitlines()[-1] == "dflashops: error: src: no answer in 5 s", err
    assert seconds < 30, seconds
    assert not (ckpts / "step_4").exists()
    assert BIG not in verified_names(partial)


def test_two_pulls_of_one_step_at_once_end_with_one_copy_not_nested(pair, home):
    src, dst, inv = pair
    source = checkpoint(src, "twice", 2, {"config.json": 200, "model.safetensors": 1 << 20})
    for _attempt in range(3):
        procs = [start("--json", "pull-ckpt", "2", "--to", "dst", "--run", "twice",
                       inventory=inv, home=home) for _ in range(2)]  # fmt: skip
        results = [finished(p) for p in procs]
        for code, _out, err in results:
            assert code == 0, err
        final = dst.host_path("/workspace/ckpts/twice/step_2")
        assert hashes(final) == hashes(source)  # exactly the checkpoint: nothing nested in it
        assert sorted(p.name for p in final.parent.iterdir()) == ["run.yaml", "step_2"]
        copied = [json.loads(out)["copied"] for _code, out, _err in results]
        assert copied.count(True) >= 1, copied
        # next round: a copy there that does not verify, which both pulls replace at once
        (final / "model.safetensors").write_bytes(b"damaged")


def test_a_second_receiver_waits_for_the_first_then_neither_nests(fresh_ct):
    """Two receivers of one checkpoint, run as pull-ckpt runs them, with the first held
    mid-stream: the second waits (writes nothing), and once the first has swapped out the bad
    copy at FINAL, the second finds it in place. FINAL is never a directory inside FINAL."""
    import io
    import tarfile
    import threading

    from dflashops.remote import source

    files = {"a.bin": os.urandom(1 << 20), "b.bin": os.urandom(1 << 20)}
    text = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items())
    head = json.dumps({"manifest": text}).encode() + b"\n"
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    stream = out.getvalue()
    partial, final = "/workspace/ckpts/r/.partial-step_5", "/workspace/ckpts/r/step_5"
    old = fresh_ct.host_path(final)
    old.mkdir(parents=True)
    (old / "a.bin").write_bytes(b"a bad copy")
    argv = fresh_ct.command(["python3", "-c", source("receive.py"), partial, "--checkpoint", final])

    def receiver() -> subprocess.Popen:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return subprocess.Popen(argv, **pipes)

    def feed(proc: subprocess.Popen, data: bytes, close: bool) -> None:
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
            if close:
                proc.stdin.close()
        except BrokenPipeError:
            pass

    first = receiver()
    feed(first, head + stream[: 1 << 20], close=False)  # a.bin not even complete: held there
    marker = fresh_ct.host_path(partial) / ".dflashops-verified"
    wait_for(lambda: list(fresh_ct.host_path(partial).glob(".dfo-*.part")))
    second = receiver()
    writer = threading.Thread(target=feed, args=(second, head + stream, True), daemon=True)
    writer.start()
    time.sleep(1.5)
    assert second.poll() is None  # it waits for the lock, writing nothing meanwhile:
    assert len(list(fresh_ct.host_path(partial).glob(".dfo-*.part"))) == 1
    assert marker.read_text() == ""
    feed(first, stream[1 << 20 :], close=True)
    one, two = (json.loads(p.stdout.read()) for p in (first, second))
    assert first.wait(60) == 0 and second.wait(60) == 0
    writer.join(timeout=10)
    assert (one["placed"], one["received"]) == (True, ["a.bin", "b.bin"])
    assert two["placed"] == "already"
    got = {p.name: p.read_bytes() for p in old.iterdir()}
    assert got == {**files, "MANIFEST.sha256": text.encode()}
    assert sorted(p.name for p in old.parent.iterdir()) == ["step_5"]  # no partial, no old copy


def test_pull_ckpt_onto_a_full_disk_is_one_clear_error_and_leaves_nothing(pair, home):
    src, dst, inv = pair
    checkpoint(src, "full", 6, {"config.json": 200, "model.safetensors": 12 << 20})
    dst.run(["mkdir", "-p", "/workspace/ckpts"], check=True)
    dst.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", "/workspace/ckpts"], check=True)
    try:
        started = time.monotonic()
        ran = dflashops("pull-ckpt", "6", "--to", "dst", "--run", "full", inventory=inv,
                        home=home)  # fmt: skip
        seconds = time.monotonic() - started
        listing = dst.run(["find", "/workspace/ckpts"], check=True).stdout.decode().split()
    finally:
        dst.run(["umount", "/workspace/ckpts"], check=True)
    print(f"\nfull disk: exit {ran.code} after {seconds:.2f}s; left: {listing}; said: {ran.err}")
    assert ran.code == 1
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in ran.err, ran.err
    assert lines[0].startswith("dflashops: error: dst: no space left on the device of ")
    assert "/workspace/ckpts/full/.partial-step_6" in lines[0]
    assert listing == ["/workspace/ckpts", "/workspace/ckpts/full"]


def test_stale_partial_copies_are_removed_unless_held_or_recent(pair, home):
    import fcntl

    src, dst, inv = pair
    checkpoint(src, "st", 4, {"config.json": 200, "model.safetensors": 1 << 20})
    ckpts = dst.host_path("/workspace/ckpts")
    old = time.time() - 2 * 86400
    made = {}
    for rel in ("st/.partial-step_2", "other/.tmp-step_7-deadbeef", "st/.partial-step_3",
                "st/.partial-step_1", "st/.old-step_9-0a0b0c0d"):  # fmt: skip
        path = ckpts / rel
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(os.urandom(1 << 20))
        made[rel] = path
    for rel in ("st/.partial-step_2", "other/.tmp-step_7-deadbeef", "st/.partial-step_1",
                "st/.old-step_9-0a0b0c0d"):  # fmt: skip
        for p in (made[rel] / "model.safetensors", made[rel]):
            os.utime(p, (old, old))
    held = os.open(made["st/.partial-step_1"], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a copy still writing there (on this machine, same inode)
    try:
        ran = dflashops("pull-ckpt", "4", "--to", "dst", "--run", "st", inventory=inv, home=home)
    finally:
        os.close(held)
    assert ran.code == 0, ran.err
    assert (
        not made["st/.partial-step_2"].exists() and not made["other/.tmp-step_7-deadbeef"].exists()
    )
    assert not made["st/.old-step_9-0a0b0c0d"].exists()
    assert made["st/.partial-step_3"].exists()  # touched recently: may still resume
    assert made["st/.partial-step_1"].exists()  # old, but someone holds it
    assert ran.err.count("a partial copy nobody had touched for a day") == 3, ran.err
    assert "/workspace/ckpts/st/.partial-step_2 (1.0 MiB)" in ran.err


def test_push_sends_only_what_changed(inventory, home, testbed, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(5):
        (tree / f"f{i}.bin").write_bytes(os.urandom(64 << 10))
    first = dflashops("--json", "push", "ct201", str(tree), "/workspace/inc", inventory=inventory,
                      home=home)  # fmt: skip
    assert first.code == 0, first.err
    assert json.loads(first.out)["files"] == 5
    (tree / "f1.bin").write_bytes(os.urandom(64 << 10))
    # the quick check sees whole seconds, as rsync's does: the edit is a second later
    later = (tree / "f1.bin").stat().st_mtime + 1
    os.utime(tree / "f1.bin", (later, later))
    (tree / "f2.bin").chmod(0o600)
    again = dflashops("--json", "push", "ct201", str(tree), "/workspace/inc", inventory=inventory,
                      home=home)  # fmt: skip
    doc = json.loads(again.out)
    assert (doc["files"], doc["unchanged"]) == (2, 3), doc
    landed = testbed["pve1"][201].host_path("/workspace/inc")
    assert sha(landed / "f1.bin") == sha(tree / "f1.bin")
    assert (landed / "f2.bin").stat().st_mode & 0o777 == 0o600
    # a change there that keeps size and mtime: only --checksum sees it
    there = landed / "f3.bin"
    st = there.stat()
    there.write_bytes(os.urandom(64 << 10))
    os.utime(there, ns=(st.st_atime_ns, st.st_mtime_ns))
    quick = json.loads(dflashops("--json", "push", "ct201", str(tree), "/workspace/inc",
                                 inventory=inventory, home=home).out)  # fmt: skip
    assert quick["files"] == 0
    full = dflashops("--json", "push", "ct201", str(tree), "/workspace/inc", "--checksum",
                     inventory=inventory, home=home)  # fmt: skip
    assert json.loads(full.out)["files"] == 1 and sha(there) == sha(tree / "f3.bin")


def test_leftovers_of_a_killed_receiver_are_swept_by_the_next_copy(
    inventory, home, testbed, tmp_path
):
    folder = testbed["pve1"][201].host_path("/workspace/sweep")
    folder.mkdir()
    hour_ago = time.time() - 3600
    dead_old, dead_new, alive_old = (folder / n for n in (
        ".dfo-4194000-0a0b0c0d0e0f.part", ".dfo-4194001-0a0b0c0d0e0f.part", ".dfo-1-0a0b0c0d0e0f.part"
    ))  # fmt: skip
    for path in (dead_old, dead_new, alive_old):
        path.write_bytes(b"half a file")
    for path in (dead_old, alive_old):
        os.utime(path, (hour_ago, hour_ago))
    f = tmp_path / "new.bin"
    f.write_bytes(b"x")
    ran = dflashops("push", "ct201", str(f), "/workspace/sweep/", inventory=inventory, home=home)
    assert ran.code == 0, ran.err
    # gone: a dead receiver's, untouched for an hour; kept: a young one, and one whose pid lives
    assert sorted(p.name for p in folder.iterdir()) == sorted([dead_new.name, alive_old.name,
                                                               "new.bin"])  # fmt: skip


def test_two_copies_out_into_one_local_path_at_once(
    inventory, home, testbed, tmp_path, monkeypatch
):
    import threading

    from dflashops.inventory import load_inventory
    from dflashops.ssh.session import Session
    from dflashops.transfer import get_file

    data = os.urandom(8 << 20)
    testbed["pve1"][201].host_path("/workspace/out.bin").write_bytes(data)
    monkeypatch.setenv("HOME", str(home))
    local = tmp_path / "got" / "out.bin"
    sizes, errors = [], []

    def copy() -> None:
        try:
            with Session(load_inventory(inventory)) as session:
                sizes.append(get_file(session.machine("ct201"), "/workspace/out.bin", local))
        except Exception as exc:  # noqa: BLE001 (asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=copy) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and sizes == [8 << 20, 8 << 20]
    assert local.read_bytes() == data and [p.name for p in local.parent.iterdir()] == ["out.bin"]
