"""Put in front of the eval programs (stdlib only): one evaluation at a time on a target, by
an exclusive lock on <ws>/evals/.evaluating held while an evaluator runs (released by the
kernel when its holder dies, whatever the way)."""

import contextlib
import fcntl
import os
import time


@contextlib.contextmanager
def one_evaluation(path, stopping, say):
    """Hold the target's evaluation lock; wait for it while another job holds it (`say` once),
    give up (yield False) when `stopping` becomes true meanwhile."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
        yield True
    finally:
        os.close(fd)
