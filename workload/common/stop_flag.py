"""The clean stop of a trainer or generator: SIGINT/SIGTERM set a flag the loop reads; a second
signal exits at once. Stdlib only, so a process can take stops before torch is imported."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any


class StopFlag:
    """SIGINT/SIGTERM ask for a clean stop at the end of the step; a second one exits now.
    The previous handlers come back on `restore()` (the trainer may run inside a test)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._then: list[Callable[[], None]] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        name = signal.Signals(signum).name
        print(f"received {name}: stopping after this step (again to exit now)", flush=True)
        for action in self._then:
            action()

    def then(self, action: Callable[[], None]) -> None:
        """Run `action` when a stop is asked (now, if it was): in the signal's handler, so
        between two steps of the main thread's code, not after the step it is in."""
        self._then.append(action)
        if self.requested:
            action()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
