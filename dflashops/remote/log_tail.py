"""Runs inside a target with its python3 (stdlib only): print a log file, optionally following it.

argv: PATH SESSION RUN_DIR OFFSET TAIL FOLLOW. Starts at byte OFFSET when it is >= 0, else
at the start of the TAIL-th last line (TAIL 0: the whole file). Writes "offset=N" on stderr
first (where the bytes on stdout start, so a dropped connection can resume exactly there),
then the file's bytes on stdout. With FOLLOW=1 it keeps reading until the run's node is over
(no tmux session SESSION on our tmux server, and neither the launcher of RUN_DIR/node.json nor
the trainer of RUN_DIR/state.json still the process recorded, by pid and start time), drains
the file and exits 0; it also exits when its stdin closes (the operator went away). A file cut
shorter starts over from 0.
"""

import os
import sys
import threading
import time

from dflashops.remote.layout import STATE_FILE
from dflashops.remote.shared import job_alive

CHUNK = 1 << 16


def tail_offset(path, lines):
    """Offset of the start of the `lines`-th line from the end (0 when the file is shorter)."""
    size = os.path.getsize(path)
    if lines <= 0:
        return 0
    with open(path, "rb") as f:
        pos, seen = size, 0
        if size and _byte_at(f, size - 1) == b"\n":
            pos -= 1  # the final newline ends the last line; it does not start one
        while pos > 0:
            start = max(0, pos - CHUNK)
            f.seek(start)
            block = f.read(pos - start)
            for i in range(len(block) - 1, -1, -1):
                if block[i] == 10:
                    seen += 1
                    if seen == lines:
                        return start + i + 1
            pos = start
    return 0


def _byte_at(f, pos):
    f.seek(pos)
    return f.read(1)


def watch_stdin(done):
    # os.read, not sys.stdin: a thread blocked in a buffered read holds a lock at exit
    try:
        while os.read(0, CHUNK):
            pass
    except OSError:
        pass
    done.set()


def copy(f, out):
    moved = 0
    while True:
        chunk = f.read(CHUNK)
        if not chunk:
            return moved
        out.write(chunk)
        moved += len(chunk)


def main():
    path, session, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    offset, lines, follow = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    gone = threading.Event()
    if follow:
        threading.Thread(target=watch_stdin, args=(gone,), daemon=True).start()
    while not os.path.exists(path):
        if not follow or not job_alive(session, run_dir, STATE_FILE) or gone.is_set():
            sys.stderr.write(f"follow: {path}: no such file\n")
            sys.exit(4)
        time.sleep(0.5)
    if offset < 0:
        offset = tail_offset(path, lines)
    sys.stderr.write(f"offset={offset}\n")
    sys.stderr.flush()
    out = sys.stdout.buffer
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            moved = copy(f, out)
            out.flush()
            if not follow or gone.is_set():
                return
            if moved:
                continue
            if os.path.getsize(path) < f.tell():
                sys.stderr.write("follow: the file was cut short; starting over\noffset=0\n")
                sys.stderr.flush()
                f.seek(0)
                continue
            if not job_alive(session, run_dir, STATE_FILE):
                time.sleep(0.3)
                copy(f, out)
                out.flush()
                return
            time.sleep(0.5)


main()
