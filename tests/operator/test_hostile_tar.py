"""Hostile tar streams (issue 9, item 8): the receiver as the remote side runs it (`python3 -c`
inside a container of the test bed), and through the command line (`push`, and `pull-ckpt`
from a container whose `tar` is an attacker's)."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest

from dflashops.remote import source
from tests.operator.cli import dflashops
from tests.operator.hostile_tars import (
    EVIL_TAR,
    HOSTILE,
    copy_tar_of,
    member,
    special_files,
    tar_of,
)
from tests.operator.rundirs import make_run

pytestmark = pytest.mark.testbed

DST = "/workspace/dst"


@pytest.fixture
def ct(make_container):
    return make_container("pve1")


def receive(ct, stream: bytes, *args: str):
    """The receiver exactly as a copy runs it in a target: `python3 -c SOURCE BASE ...`."""
    return ct.run(["python3", "-c", source("receive.py"), DST, *args], input=stream)


def pwned_anywhere(ct) -> list[str]:
    roots = [ct.host_path(p) for p in ("/tmp", "/root", "/workspace")]
    return [str(p) for r in roots for p in r.rglob("pwned*")]


@pytest.mark.parametrize("case,stream,refusal", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_the_receiver_refuses_a_hostile_stream_and_nothing_lands_outside(ct, case, stream, refusal):
    ran = receive(ct, stream)
    err = ran.stderr.decode()
    assert ran.returncode == 1, (case, err)
    assert "receive: refused: " in err and refusal in err, (case, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert pwned_anywhere(ct) == [] and not Path("/tmp/pwned").exists()
    assert special_files(ct.host_path(DST)) == []
    assert not [p for p in ct.host_path(DST).rglob("*") if p.name.endswith(".part")]


def test_an_offer_is_answered_with_what_is_there_then_the_tar_lands(ct):
    """push's one call: the receiver says what it holds of each offered path, then unpacks."""
    (ct.host_path(DST)).mkdir(parents=True)
    (ct.host_path(DST) / "kept").write_bytes(b"12345")
    offer = json.dumps({"offer": ["kept", "new"], "checksum": False}).encode() + b"\n"
    ran = receive(ct, offer + copy_tar_of(member("new", data=b"fresh")), "--offer")
    assert ran.returncode == 0, ran.stderr
    held, report = ran.stdout.decode().splitlines()
    held = json.loads(held)
    assert held["kept"]["t"] == "f" and held["kept"]["size"] == 5 and "sha256" not in held["kept"]
    assert held["new"] == {"t": "-"}
    assert set(json.loads(report)) == {"new"}
    assert (ct.host_path(DST) / "new").read_bytes() == b"fresh"
    with_sums = json.dumps({"offer": ["kept"], "checksum": True}).encode() + b"\n"
    ran = receive(ct, with_sums + tar_of(), "--offer")
    assert json.loads(ran.stdout.decode().splitlines()[0])["kept"]["sha256"] == (
        "5994471abb01112afcc18159f6cc74b4f511b99806da59b3caf5a9c173cacfc5"
    )  # sha256 of b"12345"


@pytest.mark.parametrize("name", ["../../root/pwned", "/etc/hostname"])
def test_an_offer_naming_a_path_outside_is_refused_before_anything_is_read(ct, name):
    offer = json.dumps({"offer": [name], "checksum": True}).encode() + b"\n"
    ran = receive(ct, offer + tar_of(member("pwned", data=b"x")), "--offer")
    assert ran.returncode == 1 and ran.stdout == b""
    assert "receive: refused: " in ran.stderr.decode()
    assert pwned_anywhere(ct) == []


def test_setuid_setgid_and_sticky_bits_are_dropped_with_a_warning(ct):
    stream = copy_tar_of(
        member("suid", data=b"#!/bin/sh\n", mode=0o4755),
        member("sgid", data=b"x", mode=0o2750),
        member("sticky", tarfile.DIRTYPE, mode=0o1777),
        member("plain", data=b"y", mode=0o640),
    )
    ran = receive(ct, stream)
    assert ran.returncode == 0, ran.stderr
    got = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in ct.host_path(DST).iterdir()}
    assert got == {"suid": 0o755, "sgid": 0o750, "sticky": 0o777, "plain": 0o640}
    warnings = ran.stderr.decode().splitlines()
    assert [w.split(":")[2].strip() for w in warnings] == ["suid", "sgid", "sticky"]
    assert all("setuid, setgid and sticky bits dropped" in w for w in warnings)
    report = json.loads(ran.stdout)
    assert report["suid"]["mode"] == 0o755 and report["plain"]["t"] == "f"


def test_an_existing_link_at_the_destination_is_replaced_not_followed(ct):
    outside = ct.host_path("/workspace/outside")
    outside.mkdir()
    ct.host_path(DST).mkdir()
    (ct.host_path(DST) / "sub").symlink_to("/workspace/outside")
    (ct.host_path(DST) / "file").symlink_to("/workspace/outside/target")
    ran = receive(ct, copy_tar_of(member("sub/x", data=b"x"), member("file", data=b"y")))
    assert ran.returncode == 0, ran.stderr
    assert list(outside.iterdir()) == []
    assert not (ct.host_path(DST) / "sub").is_symlink()
    assert (ct.host_path(DST) / "file").read_bytes() == b"y"


def test_a_copied_file_reaches_its_name_only_when_its_seal_agrees(ct):
    """The sender's digest comes after a file's data: a file whose seal disagrees (bytes
    changed on the way) or never came (the stream cut, an unsealed tar) is not placed."""
    ct.host_path(DST).mkdir(parents=True)
    (ct.host_path(DST) / "bad").write_bytes(b"before")
    stream = copy_tar_of(
        member("good", data=b"good"),
        member("bad", data=b"corrupted"),
        member("short", data=b"abc"),
        seals={"bad": ("00000000", 9), "short": ("352441c2", 4)},  # right CRC, wrong size
    )
    ran = receive(ct, stream)
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["good"]["crc32"] == "6c844e92" and "placed" not in report["good"]
    assert report["bad"]["placed"] is False and report["short"]["placed"] is False
    assert sorted(p.name for p in ct.host_path(DST).iterdir()) == ["bad", "good"]
    assert (ct.host_path(DST) / "bad").read_bytes() == b"before"
    unsealed = receive(ct, tar_of(member("unsealed", data=b"u")))
    assert json.loads(unsealed.stdout)["unsealed"]["placed"] is False
    assert sorted(p.name for p in ct.host_path(DST).iterdir()) == ["bad", "good"]


def checkpoint_head(files: dict[str, bytes]) -> bytes:
    import hashlib

    text = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items())
    return json.dumps({"manifest": text}).encode() + b"\n"


@pytest.mark.parametrize(
    "case,stream,refusal",
    [
        ("a symlink", tar_of(member("model.bin", tarfile.SYMTYPE, linkname="/etc/passwd")),
         "model.bin: a symlink in a checkpoint"),
        ("a name the manifest does not list", tar_of(member("extra.py", data=b"x")),
         "extra.py: not in the checkpoint's MANIFEST.sha256"),
        ("a directory", tar_of(member("model.bin", tarfile.DIRTYPE)),
         "model.bin: a directory in a checkpoint"),
    ],
    ids=["symlink", "unlisted", "directory"],
)  # fmt: skip
def test_a_checkpoint_stream_takes_only_the_files_its_manifest_lists(ct, case, stream, refusal):
    head = checkpoint_head({"model.bin": b"weights"})
    final = "/workspace/ckpts/r/step_1"
    ran = ct.run(
        ["python3", "-c", source("receive.py"), "/workspace/ckpts/r/.partial-step_1",
         "--checkpoint", final],
        input=head + stream,
    )  # fmt: skip
    assert ran.returncode == 1 and refusal in ran.stderr.decode(), ran.stderr
    assert not ct.host_path(final).exists()


def test_a_manifest_naming_paths_outside_is_refused(ct):
    head = json.dumps({"manifest": f"{'0' * 64}  ../../etc/passwd\n"}).encode() + b"\n"
    ran = ct.run(
        ["python3", "-c", source("receive.py"), "/workspace/ckpts/r/.partial-step_1",
         "--checkpoint", "/workspace/ckpts/r/step_1"],
        input=head + tar_of(),
    )  # fmt: skip
    assert ran.returncode == 1 and "a '..' in a name" in ran.stderr.decode(), ran.stderr


# ---------------------------------------------------------------- through the command line


def test_push_of_a_setuid_file_arrives_without_the_bit(testbed, ct, tmp_path):
    inv = testbed.write_inventory(tmp_path / "hosts.yaml", {"ct": ct})
    f = tmp_path / "tool"
    f.write_bytes(b"#!/bin/sh\necho hi\n")
    f.chmod(0o4755)
    ran = dflashops("push", "ct", str(f), "/workspace/tool", inventory=inv, home=tmp_path)
    assert ran.code == 0, ran.err
    assert stat.S_IMODE(ct.host_path("/workspace/tool").stat().st_mode) == 0o755


def test_pull_ckpt_from_a_container_whose_tar_is_hostile(testbed, make_container, tmp_path):
    """The source container is compromised: its `tar` sends a link and a file through it. The
    destination refuses the stream; nothing lands outside, nothing looks complete."""
    src, dst = make_container("pve1"), make_container("pve2")
    make_run(src.host_path("/workspace"), "victim", ckpts=(10,))
    evil = src.host_path("/workspace/evil")
    evil.mkdir()
    (evil / "tar").write_text(EVIL_TAR)
    (evil / "tar").chmod(0o755)
    path = "/workspace/evil:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml",
        {"src": (src.host.name, src.vmid, {"path": path}), "dst": dst},
        extra_defaults={"python": "/usr/bin/python3"},
    )
    ran = dflashops("pull-ckpt", "10", "--to", "dst", "--run", "victim", inventory=inv,
                    home=tmp_path)  # fmt: skip
    assert ran.code == 1, ran.err
    assert "refused" in ran.err and "config.json" in ran.err, ran.err
    assert len(ran.err.strip().splitlines()) == 1
    assert pwned_anywhere(dst) == []
    run_dir = dst.host_path("/workspace/ckpts/victim")
    assert not (run_dir / "step_10").exists()
    assert not list(run_dir.rglob("MANIFEST.sha256"))
    assert special_files(dst.host_path("/workspace")) == []
