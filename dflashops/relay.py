"""One target's output into another target's input, through this process, with no copy on any
disk (pull-ckpt: a `tar -c` in one container feeds the receiver in another)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from dflashops.errors import NoAnswerError
from dflashops.targets.base import Machine, Result
from dflashops.transfer import Progress, stream


@dataclass
class Relayed:
    received: Result  # the destination's result
    sent: Result | None  # the source's; None when it was stopped because the destination ended
    error: BaseException | None  # raised while running the source (its connection failed)


def relay(
    src: Machine,
    src_argv: list[str],
    dst: Machine,
    dst_argv: list[str],
    *,
    head: bytes = b"",
    progress: Progress | None = None,
) -> Relayed:
    """`head`, then `src_argv`'s stdout, into `dst_argv`'s stdin. When the destination ends
    first (it refused the stream, or had nothing to take), the source is stopped."""
    pipe = _Pipe(progress)
    produced: dict = {}

    def produce() -> None:
        try:  # its deadline holds too: a source that goes silent (frozen, its disk hung) fails
            produced["result"] = stream(src, src_argv, stdout=pipe.put, watch_sink=True)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            produced["error"] = exc
        finally:
            pipe.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        received = stream(dst, dst_argv, stdin=pipe.chunks(head))
    except NoAnswerError:
        pipe.abandon()
        thread.join()
        silent = produced.get("error")
        if isinstance(silent, NoAnswerError):  # the destination waited on a silent source
            raise silent from None
        raise
    finally:
        pipe.abandon()
        thread.join()
    return Relayed(received, produced.get("result"), produced.get("error"))


class _Stopped(Exception):
    """The destination is gone: the source is stopped."""


class _Pipe:
    """A bounded queue from the source's stdout to the destination's stdin."""

    END = object()

    def __init__(self, progress: Progress | None) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=16)
        self.progress = progress
        self.gone = threading.Event()

    def put(self, chunk: bytes) -> None:
        if self.progress:
            self.progress(len(chunk))
        if not self._put(chunk):
            raise _Stopped

    def _put(self, item: object) -> bool:
        while not self.gone.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._put(self.END)

    def abandon(self) -> None:
        self.gone.set()

    def chunks(self, head: bytes) -> Iterator[bytes]:
        if head:
            yield head
        while (item := self.queue.get()) is not self.END:
            yield item
