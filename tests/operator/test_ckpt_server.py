"""Issue 35 (items 5, 6, 7, 9): a continuous eval's checkpoint server and its follower against a
neighbour on the bridge, on loopback. The real programs (remote/ckpt_server.py,
remote/follow_eval.py); between them a real relay process that passes the signed requests on
and rewrites the answers (tests/operator/relay.py); idle and slow connections; requests held
back and sent again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dflashops.remote.ckpt_proof import WINDOW_S, answer_mac
from tests.operator.ckpt_serving import (
    TOKEN,
    follow,
    follower_job,
    serving,
    signed,
    start_follower,
    status_of,
    wait_for,
)
from tests.operator.rundirs import make_run

RUN = "b-run"
RELAY = Path(__file__).with_name("relay.py")
FORGED = b"forged weights "
HEAD_S = 10  # remote/ckpt_server.py's: the time a connection has to prove the token
LORIS_S = 30  # how long the slow loris tries to hold its connection


@contextlib.contextmanager
def relayed(upstream: int, rules: list[dict], where: Path) -> Iterator[tuple[int, Path]]:
    """The relay process in front of port `upstream`; (its port, its log of rules used)."""
    port_file, log = where / "relay.port", where / "relay.log"
    log.touch()
    proc = subprocess.Popen([sys.executable, str(RELAY), str(upstream), json.dumps(rules),
                             str(port_file), str(log)])  # fmt: skip
    try:
        wait_for("the relay's port", port_file.exists, 20)
        yield int(port_file.read_text()), log
    finally:
        proc.kill()
        proc.wait(timeout=20)


def state_of(job: Path) -> dict:
    return json.loads((job / "state.json").read_text())


def read_state(job: Path) -> dict:
    """state.json, or {} while there is none."""
    try:
        return state_of(job)
    except (OSError, ValueError):
        return {}


def test_a_relay_that_rewrites_answers_is_refused_and_nothing_it_sent_is_kept(tmp_path):
    ws = tmp_path / "ws"
    step_dir = make_run(ws, RUN, ckpts=(10,)) / "checkpoints" / "step_10"
    rules = [
        {"path": "/list", "do": "proof"},  # item 9: a non-ASCII proof
        {"path": "/manifest", "do": "drop"},  # item 7: a dropped /manifest
        {"path": "/manifest", "do": "manifest", "forge": "model.safetensors"},
        {"path": "/manifest", "do": "sizes"},  # sizes to fill the disk
        {"path": "/file", "name": "model.safetensors", "do": "status"},  # 200 -> 404: a skip
        {"path": "/file", "name": "model.safetensors", "do": "file"},  # forged weights
    ]
    with serving(step_dir.parents[1], tmp_path, linger=60) as (base, _serve, _proc):
        upstream = int(base.rsplit(":", 1)[1])
        with relayed(upstream, rules, tmp_path) as (port, log):
            job = follower_job(ws, tmp_path, RUN, port)
            ran = follow(job, timeout=120)
    used = [line.split()[0] for line in log.read_text().splitlines()]
    out = ran.stdout
    assert used == [r["do"] for r in rules], (used, out[-3000:])
    assert ran.returncode == 0, out[-3000:] + ran.stderr[-2000:]
    state = state_of(job)
    assert state["done"] == [10] and not state.get("skipped"), state  # the 404 made no skip
    kept = ws / "ckpts" / RUN / "step_10"
    for name in ("model.safetensors", "config.json"):
        assert (kept / name).read_bytes() == (step_dir / name).read_bytes(), name
    copies = [p for p in (ws / "ckpts").rglob("*") if p.is_file()]
    assert not [p for p in copies if p.suffix == ".part" or FORGED in p.read_bytes()], copies
    assert out.count("without proving it holds the token") == 4, out  # proof, manifest x2, 404
    assert out.count("its sha256 differs from MANIFEST.sha256; not kept; trying again") == 1, out
    assert "step 10: its manifest: the checkpoint server" in out  # the dropped one, asked again
    assert "Traceback" not in out + ran.stderr, ran.stderr
    assert all(line.startswith("[follow] ") for line in out.splitlines()), out  # one line each
    print(out)


def hold_connections(port: int, count: int, stop: threading.Event) -> None:
    """`count` idle connections to the server, each opened again once it is closed."""
    held: list[socket.socket] = []
    while not stop.is_set():
        held = [s for s in held if not closed(s)]
        while len(held) < count:
            try:
                held.append(socket.create_connection(("127.0.0.1", port)))
            except ConnectionRefusedError:
                return  # the server has ended (told goodbye)
        time.sleep(0.2)
    for sock in held:
        sock.close()


def closed(sock: socket.socket, wait: float = 0) -> bool:
    """Whether the server closed the connection (a reset included); then it is closed here."""
    readable, _, _ = select.select([sock], [], [], wait)
    try:
        if not readable or sock.recv(1):
            return False
    except OSError:
        pass
    sock.close()
    return True


def slow_loris(port: int, lasted: list[float]) -> None:
    """A request sent a byte every 2 s (each read well within any per-read deadline), for up
    to LORIS_S; how long the server let it hold its connection, in `lasted`."""
    started = time.monotonic()
    text = b"GET /list HTTP/1.0\r\n" + b"X-Pad: " + b"a" * 100
    sock = socket.create_connection(("127.0.0.1", port))
    for byte in text:
        if time.monotonic() - started > LORIS_S:
            break
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        if closed(sock, wait=2):
            break
    sock.close()
    lasted.append(time.monotonic() - started)


def test_idle_connections_do_not_stop_the_follower_and_a_slow_loris_is_cut(tmp_path):
    ws = tmp_path / "ws"
    run = make_run(ws, RUN, ckpts=(10,), status="running")  # no goodbye: the server stays up
    lasted: list[float] = []
    with serving(run, tmp_path, linger=60) as (base, _serve, proc):
        port = int(base.rsplit(":", 1)[1])
        loris = threading.Thread(target=slow_loris, args=(port, lasted))
        loris.start()
        stop = threading.Event()
        holder = threading.Thread(target=hold_connections, args=(port, 20, stop))
        holder.start()
        follower = None
        try:
            wait_for("the idle connections held (a thread each)",
                     lambda: len(os.listdir(f"/proc/{proc.pid}/task")) >= 15, 30)  # fmt: skip
            follower = start_follower(follower_job(ws, tmp_path, RUN, port))
            job = tmp_path / "job"
            wait_for("step 10 scored with 20 idle connections held",
                     lambda: 10 in (read_state(job).get("done") or []), 60)  # fmt: skip
            loris.join(timeout=LORIS_S + 5)
        finally:
            if follower is not None:
                follower.terminate()
                out, _err = follower.communicate(timeout=30)
            stop.set()
            holder.join()
            loris.join()
    assert follower.returncode == 0 and read_state(job)["status"] == "stopped", out[-3000:]
    assert lasted and lasted[0] <= HEAD_S + 3, lasted  # its bytes would take ~250 s


def test_a_request_is_taken_once_and_only_within_its_time_window(tmp_path):
    run = make_run(tmp_path / "ws", RUN, ckpts=(10,))
    with serving(run, tmp_path, linger=60) as (base, serve, proc):
        again = signed(f"{base}/list")  # one signed request, sent by 8 threads at once
        gate, codes = threading.Barrier(8), []

        def send() -> None:
            gate.wait()
            codes.append(status_of(again))

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(codes) == [200] + [403] * 7, codes

        held = signed(f"{base}/bye", method="POST", stamp=int(time.time()) - WINDOW_S - 60)
        assert status_of(held) == 403  # a goodbye held back past the window
        time.sleep(1)
        assert proc.poll() is None, "a replayed goodbye ended the server"

        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as sock:
            sock.sendall("GET /list HTTP/1.0\r\nX-Nonce: é\r\nAuthorization: DFO ü\r\n\r\n"
                         .encode())  # fmt: skip
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.0 403"), answer
        assert "Traceback" not in (serve / "console.log").read_text()


def test_the_answer_to_a_request_out_of_its_window_tells_the_servers_time_signed(tmp_path):
    """The follower asks again at the server's time (a clock off by more than the window does
    not stop it): the refusal is signed, so that a neighbour cannot set the follower's clock."""
    run = make_run(tmp_path / "ws", RUN, ckpts=(10,))
    with serving(run, tmp_path, linger=60) as (base, _serve, _proc):
        late = signed(f"{base}/list", stamp=int(time.time()) - WINDOW_S - 60)
        try:
            urllib.request.urlopen(late, timeout=10)
            raise AssertionError("a request out of the window was answered")
        except urllib.error.HTTPError as exc:
            code, headers, body = exc.code, exc.headers, exc.read()
    assert code == 403 and b"time window" in body
    nonce, stamp = late.get_header("X-nonce"), headers["X-Time"]
    assert abs(int(stamp) - time.time()) < 5
    digest = hashlib.sha256(body).hexdigest()
    assert headers["X-Proof"] == answer_mac(TOKEN, nonce, 403, stamp, digest)


def test_a_follower_whose_clock_is_off_asks_again_at_the_servers_time(tmp_path):
    ws = tmp_path / "ws"
    run = make_run(ws, RUN, ckpts=(10,))
    with serving(run, tmp_path, linger=60, skew=WINDOW_S + 600) as (base, _serve, _proc):
        ran = follow(follower_job(ws, tmp_path, RUN, int(base.rsplit(":", 1)[1])), timeout=60)
    assert ran.returncode == 0 and state_of(tmp_path / "job")["done"] == [10], ran.stdout[-3000:]
    assert ran.stdout.count("out of the time window") == 1, ran.stdout  # once, then in it
