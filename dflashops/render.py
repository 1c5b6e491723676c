"""Human output: sizes, durations, progress bars (always on stderr), tables (tables.py).

Text is text: every string printed through `console()` or put in a `table()` shows exactly as
it is (a log line, a container name or an error with `[/]`, `[bold]` or `:smile:` in it);
colour comes only from `styled()`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from dflashops.metrics import value_format
from dflashops.tables import Col, Grid

SHOW_AFTER_S = 2.0  # contract: progress for anything over about two seconds
BIG_TRANSFER = 0  # TODO(pull-ckpt): drop; the delay above now decides what is shown


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress(label: str, total: int | None, *, enabled: bool = True) -> Iterator[Meter]:
    """Byte counting on stderr, shown once the work has taken more than two seconds: a bar on
    a terminal, else a line every few seconds (for logs). The meter is called with each
    count of bytes done; `set_total` gives a total learnt on the way."""
    if not enabled:
        yield _NoMeter()
        return
    shown = _LazyBar(label, total) if sys.stderr.isatty() else _PlainProgress(label, total)
    try:
        yield shown
    finally:
        shown.close()


class Meter(Protocol):
    def __call__(self, n: int) -> None: ...
    def set_total(self, total: int) -> None: ...


class _NoMeter:
    def __call__(self, n: int) -> None:
        """Nothing shown."""

    def set_total(self, total: int) -> None:
        """Nothing shown."""


class _LazyBar:
    """A rich progress bar that appears only after SHOW_AFTER_S (quick copies stay silent)."""

    def __init__(self, label: str, total: int | None) -> None:
        self.label, self.total = label, total
        self.start = time.monotonic()
        self.done = 0
        self.bar = None

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.update(self.task, total=total)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is None:
            if time.monotonic() - self.start < SHOW_AFTER_S:
                return
            self._open()
        self.bar.advance(self.task, n)

    def _open(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), transient=True,
        )  # fmt: skip
        self.bar.start()
        self.task = self.bar.add_task(self.label, total=self.total, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


class _PlainProgress:
    """Progress for logs: after SHOW_AFTER_S, one line every `every` seconds."""

    def __init__(self, label: str, total: int | None, every: float = 5.0) -> None:
        self.label, self.total, self.every = label, total, every
        self.done = 0
        self.next = time.monotonic() + SHOW_AFTER_S

    def set_total(self, total: int) -> None:
        self.total = total

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.every
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            sys.stderr.write(
                f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)}{share}\n"
            )
            sys.stderr.flush()

    def close(self) -> None:
        """Nothing to take down."""


# ---------------------------------------------------------------- runs: tables and numbers


def styled(text: object, style: str | None = None):  # noqa: ANN201 (rich.text.Text)
    """`text` exactly as it is (brackets and all), in `style` ("green", "bold red", ...)."""
    from rich.text import Text

    return Text(str(text), style=style or "")


def console(*, stderr: bool = False):  # noqa: ANN201 (rich.console.Console, imported lazily)
    """A rich console that prints strings literally (no markup, no emoji codes) and whole: a
    line wider than the terminal is the terminal's to wrap, never cut or folded (a run name in
    it stays one word). Tables are laid out for its width (tables.py); when not a terminal, the
    width is $COLUMNS, else 220."""
    import os

    from rich.console import Console

    class LiteralConsole(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; ours ends as every command does
            raise BrokenPipeError

        def render_str(self, text: str, **kwargs):  # noqa: ANN003, ANN202
            return super().render_str(text, **{**kwargs, "markup": False, "emoji": False})

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", 0) or 220)
    return LiteralConsole(
        file=stream, width=width, highlight=False, soft_wrap=True, markup=False, emoji=False
    )


def metric(value: object, key: str = "") -> str:
    """A metric value as a table shows it: '-' for missing, a key's usual precision."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and key in ("step", ""):
        return str(value)
    fmt = value_format(key)
    if fmt is None:
        fmt = ".4g" if abs(value) < 1e5 else ".3e"
    return format(value, fmt)


def duration(seconds: float | None) -> str:
    """'45s', '12m05s', '3h07m', '2d04h'."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(*columns: Col | str, title: str | None = None, label: str | None = None) -> Grid:
    """A plain table (no box, left-aligned headers) that never cuts a name: see tables.py."""
    return Grid(*columns, title=title, label=label)
