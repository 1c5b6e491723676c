"""Human output: sizes, durations, progress bars (always on stderr)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

BIG_TRANSFER = 32 << 20


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress(
    label: str, total: int | None, *, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr; a line every few seconds when not a terminal."""
    if not enabled:
        yield lambda n: None
        return
    if not sys.stderr.isatty():
        yield _PlainProgress(label, total).advance
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
    )
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


class _PlainProgress:
    """Progress for logs: one line every `every` seconds."""

    def __init__(self, label: str, total: int | None, every: float = 5.0) -> None:
        self.label, self.total, self.every = label, total, every
        self.done = 0
        self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            sys.stderr.write(
                f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)}{share}\n"
            )
            sys.stderr.flush()


# ---------------------------------------------------------------- runs: tables and numbers

METRIC_FORMATS = {
    "loss": ".4f",
    "acc": ".3f",
    "streak": ".2f",
    "dds8": ".2f",
    "lr": ".2e",
    "noise": ".3f",
    "epoch": ".2f",
    "grad_norm": ".2f",
    "tok_s": ".0f",
}


def console(*, stderr: bool = False):  # noqa: ANN201 (rich.console.Console, imported lazily)
    """A rich console; when not a terminal, wide enough that tables never wrap."""
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", 0) or 220)
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def metric(value: object, key: str = "") -> str:
    """A metric value as a table shows it: '-' for missing, a key's usual precision."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and key in ("step", ""):
        return str(value)
    fmt = METRIC_FORMATS.get(key)
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


def table(*columns: str, title: str | None = None):  # noqa: ANN201 (rich.table.Table)
    """A plain table in the style of `hosts`: no box, left-aligned headers."""
    from rich.table import Table

    return Table(*columns, box=None, pad_edge=False, title=title, title_justify="left")
