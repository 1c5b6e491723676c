"""Put in front of the eval programs (stdlib only): one evaluation at a time on a target, by
an exclusive lock on <ws>/evals/.evaluating held while an evaluator runs (released by the
kernel when its holder dies, whatever the way). The GPU is free when an evaluation starts: the
engines an ended evaluation left behind are ended (engine_groups.py) when the lock is taken,
before the evaluator starts, and again before it is let go."""

import contextlib
import fcntl
import os
import time

from dflashops.remote.engine_groups import GONE_WAIT_S, settle


@contextlib.contextmanager
def one_evaluation(path, stopping, say):
    """Hold the target's evaluation lock; wait for it while another job holds it (`say` once),
    give up (yield False) when `stopping` becomes true meanwhile."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    evals = os.path.dirname(path)
    try:
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stopping:
                    yield False
                    return
                if not waited:
                    say("another evaluation runs on this target; waiting for it to end")
                    waited = True
                time.sleep(1)
        if not settle(evals, stopping, say):
            yield False
            return
        try:
            yield True
        finally:
            settle(evals, (), say, patience_s=GONE_WAIT_S)
    finally:
        os.close(fd)
