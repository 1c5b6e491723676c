"""The operator's commands against the `local` target: real subprocesses, real files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashops.inventory import load_inventory
from dflashops.ssh.session import Session
from tests.operator.cli import dflashops
from tests.operator.trees import fingerprint, make_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inventory(tmp_path) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "version: 1\ntargets:\n  local: {kind: local, workspace: ws, python: "
        + sys.executable
        + "}\n"
    )
    return path


def test_help_is_light_and_never_imports_torch():
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dflashops.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "Usage:" in proc.stdout
    assert not {"torch", "transformers", "paramiko"} & imported


ARG = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(argv=st.lists(ARG, min_size=1, max_size=6))
def test_any_argv_arrives_byte_for_byte_locally(inventory, argv):
    with Session(load_inventory(inventory)) as session:
        machine = session.machine("local")
        script = "import json, sys; sys.stdout.write(json.dumps(sys.argv[1:]))"
        result = machine.run([sys.executable, "-c", script, *argv])
    import json

    assert result.ok, result.stderr
    assert json.loads(result.stdout) == argv


def test_exec_streams_and_returns_the_exit_code(inventory):
    ran = dflashops(
        "exec",
        "local",
        "--",
        "sh",
        "-c",
        'cat; echo "err $1" >&2; exit 7',
        "sh",
        "x y",
        inventory=inventory,
        stdin=b"from stdin\n",
    )
    assert ran.code == 7
    assert ran.out == "from stdin\n" and ran.err == "err x y\n"


def test_exec_runs_in_the_workspace_with_target_env(tmp_path):
    inv = tmp_path / "hosts.yaml"
    inv.write_text(
        "targets:\n  local: {kind: local, workspace: ws, python: python3, env: {RUN_FLAG: 'a b'}}\n"
    )
    ran = dflashops("exec", "local", "--", "sh", "-c", 'pwd; echo "$RUN_FLAG"', inventory=inv)
    assert ran.code == 0 and ran.out.splitlines() == [str((tmp_path / "ws").resolve()), "a b"]


def test_missing_command_is_127(inventory):
    ran = dflashops("exec", "local", "--", "no-such-command-here", inventory=inventory)
    assert ran.code == 127 and "no-such-command-here" in ran.err


def test_push_tree_arrives_identical(tmp_path, inventory):
    src = make_tree(tmp_path / "src")
    ran = dflashops("push", "local", str(src), "data/copy", inventory=inventory)
    assert ran.code == 0, ran.err
    assert "crc32 verified" in ran.out
    assert fingerprint(tmp_path / "ws" / "data" / "copy") == fingerprint(src)


def test_push_single_file_into_directory_and_as_name(tmp_path, inventory):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00\x01" * 1000)
    assert (
        dflashops(
            "push", "local", str(f), str(tmp_path / "ws" / "x") + "/", inventory=inventory
        ).code
        == 0
    )
    assert (tmp_path / "ws/x/weights.bin").read_bytes() == f.read_bytes()
    assert dflashops("push", "local", str(f), "y/renamed.bin", inventory=inventory).code == 0
    assert (tmp_path / "ws/y/renamed.bin").read_bytes() == f.read_bytes()


def test_push_json_reports_counts(tmp_path, inventory):
    import json

    src = make_tree(tmp_path / "src", big=1000)
    ran = dflashops("--json", "push", "local", str(src), "d", inventory=inventory)
    doc = json.loads(ran.out)
    assert doc["files"] == 6 and doc["verified"] == "crc32"
    again = dflashops("--json", "push", "local", str(src), "e", "--checksum", inventory=inventory)
    assert json.loads(again.out)["verified"] == "sha256", again.err


def test_dry_run_prints_argv_and_changes_nothing(tmp_path, inventory):
    src = make_tree(tmp_path / "src", big=10)
    ran = dflashops("--dry-run", "push", "local", str(src), "d", inventory=inventory)
    assert ran.code == 0
    assert ran.out.startswith("local: env -C ") and "python3 -c '<program: " in ran.out
    assert ran.out.split()[-2:] == [str(tmp_path / "ws" / "d"), "--offer"]
    assert not (tmp_path / "ws" / "d").exists()


def test_run_script_with_quotes_and_heredoc_returns_its_exit_code(tmp_path, inventory):
    script = tmp_path / "job.py"
    script.write_text(
        "import subprocess, sys\n"
        'text = """it\'s "quoted" $(not run) `nor this` \\\\n"""\n'
        'out = subprocess.run(["sh", "-c", "cat <<\'EOF\'\\n$HOME `x`\\nEOF"], capture_output=True, text=True)\n'
        'print(text)\nprint(out.stdout, end="")\nprint("args", sys.argv[1:])\nsys.exit(5)\n'
    )
    ran = dflashops(
        "run-script", "local", str(script), "--", "--flag", "two words", inventory=inventory
    )
    assert ran.code == 5, ran.err
    lines = ran.out.splitlines()
    assert lines[0] == 'it\'s "quoted" $(not run) `nor this` \\n'
    assert lines[1] == "$HOME `x`"
    assert lines[2] == "args ['--flag', 'two words']"


def test_setup_syncs_only_changed_files(tmp_path, inventory):
    first = dflashops("--json", "setup", "local", "--no-install", inventory=inventory)
    assert first.code == 0, first.err
    import json

    doc = json.loads(first.out)
    assert doc["sync"]["sent"] > 5 and doc["sync"]["unchanged"] == 0
    synced = tmp_path / "ws" / "dflashops" / "workload"
    assert (synced / "__init__.py").read_text() == (ROOT / "workload" / "__init__.py").read_text()
    (synced / "stale.py").write_text("old\n")
    (synced / "__init__.py").write_text("tampered\n")
    second = json.loads(
        dflashops("--json", "setup", "local", "--no-install", inventory=inventory).out
    )
    assert second["sync"] == {"sent": 1, "unchanged": doc["sync"]["sent"] - 1, "deleted": 1}
    assert not (synced / "stale.py").exists()
    assert (synced / "__init__.py").read_text() == (ROOT / "workload" / "__init__.py").read_text()


def test_missing_cwd_is_named_like_env_does(inventory):
    ran = dflashops("exec", "local", "--cwd", "/nonexistent-dir", "--", "true", inventory=inventory)
    assert ran.code == 125 and "cannot change directory to '/nonexistent-dir'" in ran.err


def test_closed_stdout_ends_quietly_without_hanging(inventory):
    import subprocess

    cmd = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), "exec", "local",
           "--", "yes"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    assert proc.stdout.read(4) == b"y\ny\n"
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""


def test_push_never_writes_through_a_link_already_at_the_destination(tmp_path, inventory):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    dst = tmp_path / "ws" / "dst"
    dst.mkdir(parents=True)
    (dst / "a").symlink_to(outside)
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a").chmod(0o700)
    (src / "a" / "evil.txt").write_text("x\n")
    ran = dflashops("push", "local", str(src), "dst", inventory=inventory)
    assert ran.code == 0, ran.err
    assert list(outside.iterdir()) == [] and outside.stat().st_mode & 0o777 == 0o755
    assert not (dst / "a").is_symlink() and (dst / "a" / "evil.txt").read_text() == "x\n"


def test_push_follows_links_that_leave_the_tree_like_a_hugging_face_snapshot(tmp_path, inventory):
    hub = tmp_path / "hub"
    (hub / "blobs").mkdir(parents=True)
    (hub / "blobs" / "abc").write_bytes(b"weights" * 1000)
    snap = hub / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "model.bin").symlink_to("../../blobs/abc")
    (snap / "alias.bin").symlink_to("model.bin")  # inside the tree: stays a link
    ran = dflashops("push", "local", str(snap), "model", inventory=inventory)
    assert ran.code == 0, ran.err
    copy = tmp_path / "ws" / "model"
    assert not (copy / "model.bin").is_symlink()
    assert (copy / "model.bin").read_bytes() == b"weights" * 1000
    assert (copy / "alias.bin").is_symlink() and (
        copy / "alias.bin"
    ).read_bytes() == b"weights" * 1000
    ran = dflashops("push", "local", str(snap / "model.bin"), "one.bin", inventory=inventory)
    assert ran.code == 0 and "1 files" in ran.out
    assert (tmp_path / "ws" / "one.bin").read_bytes() == b"weights" * 1000


def test_push_a_file_onto_a_directory_says_how_and_leaves_nothing(tmp_path, inventory):
    f = tmp_path / "f.txt"
    f.write_text("x")
    (tmp_path / "ws" / "existing").mkdir(parents=True)
    ran = dflashops("push", "local", str(f), "existing", inventory=inventory)
    assert ran.code == 1 and "end the destination with /" in ran.err
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == ["existing"]
    assert dflashops("push", "local", str(f), "existing/", inventory=inventory).code == 0
    assert (tmp_path / "ws" / "existing" / "f.txt").read_text() == "x"


def test_sync_follows_a_path_that_changed_between_file_and_directory(tmp_path, inventory):
    from dflashops.transfer import sync

    src = tmp_path / "tree"
    src.mkdir()
    (src / "x").write_text("file\n")
    with Session(load_inventory(inventory)) as session:
        machine = session.machine("local")
        sync(machine, src, "synced")
        (src / "x").unlink()
        (src / "x").mkdir()
        (src / "x" / "y").write_text("now a dir\n")
        sync(machine, src, "synced")
        assert (tmp_path / "ws" / "synced" / "x" / "y").read_text() == "now a dir\n"
        (src / "x" / "y").unlink()
        (src / "x").rmdir()
        (src / "x").write_text("a file again\n")
        done = sync(machine, src, "synced")
    assert (tmp_path / "ws" / "synced" / "x").read_text() == "a file again\n"
    assert done.deleted == ["x"] and [e.rel for e in done.sent] == ["x"]


def test_get_file_follows_a_link_and_verifies(tmp_path, inventory):
    from dflashops.transfer import get_file

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "real.bin").write_bytes(b"\x00\xff" * 50_000)
    (ws / "link.bin").symlink_to("real.bin")
    with Session(load_inventory(inventory)) as session:
        size = get_file(session.machine("local"), "link.bin", tmp_path / "out" / "got.bin")
    assert size == 100_000 and (tmp_path / "out" / "got.bin").read_bytes() == b"\x00\xff" * 50_000
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["got.bin"]


def test_slow_work_shows_progress_on_stderr(tmp_path, inventory, monkeypatch, capsys):
    from dflashops import render
    from dflashops.transfer import put

    monkeypatch.setattr(render, "SHOW_AFTER_S", 0.0)
    f = tmp_path / "big.bin"
    f.write_bytes(b"x" * (3 << 20))
    with Session(load_inventory(inventory)) as session, render.progress("push big", 3 << 20) as adv:
        put(session.machine("local"), f, "big.bin", progress=adv)
    assert "push big: 1.0 MiB of 3.0 MiB (33%)" in capsys.readouterr().err


def test_a_file_cut_short_while_it_is_pushed_is_named_and_nothing_lands(tmp_path, inventory):
    from dflashops.errors import TransferError
    from dflashops.transfer import put

    src = tmp_path / "src"
    src.mkdir()
    blob = src / "weights.bin"
    blob.write_bytes(b"\x01" * (3 << 20))

    def cut(_n: int) -> None:  # a first chunk has been read: the rest of the file goes away
        os.truncate(blob, 1000)

    shrank = r"weights\.bin: file shrank while being sent"
    with Session(load_inventory(inventory)) as session, pytest.raises(TransferError, match=shrank):
        put(session.machine("local"), src, "copy", progress=cut)
    landed = [p.name for p in (tmp_path / "ws" / "copy").rglob("*")]
    assert landed == []


def test_push_where_sendfile_cannot_write_into_a_pipe_writes_the_bytes(
    tmp_path, inventory, monkeypatch
):
    # A mock for what this machine cannot be: a system whose sendfile takes only sockets
    # (macOS); the bytes must still all arrive, verified.
    import errno

    from dflashops.transfer import put

    def no_pipes(*_args):  # noqa: ANN002, ANN202
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")

    monkeypatch.setattr(os, "sendfile", no_pipes)
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(3 << 20) + b"tail")
    with Session(load_inventory(inventory)) as session:
        put(session.machine("local"), src, "copy")
    assert (tmp_path / "ws" / "copy" / "weights.bin").read_bytes() == (
        src / "weights.bin"
    ).read_bytes()
