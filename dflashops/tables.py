"""Tables that never cut a name, at any terminal width.

A `Grid` is laid out when it is printed, for the width it gets. Each column says what may
happen to it when the width is short: a `keep` column (run and target names, the row's key) is
always shown whole; a `wrap` column (free text) wraps onto more lines, never narrower than its
header; any other column is left out: one with nothing to say first (empty or dashes only),
then the lowest `priority`, then the rightmost; a line under the table names what was left out.
When even the kept columns do not fit, the grid is stacked: one block per row, its `head` cells
on the first line, then `key: value` lines. Titles and stacked lines are printed whole by
`console()` (a line wider than the terminal is the terminal's to wrap); in a live view they wrap
between words, so a name stays whole there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

GAP = 2  # between two columns: one space of padding on each side, none at the edges
WRAP_MIN = 16  # a wrap column is not squeezed below this (or its header, if wider)


@dataclass
class Col:
    """A column and what may happen to it when the width is short."""

    header: str
    keep: bool = False  # shown whole in every layout; stacked rather than cut
    priority: int = 0  # optional columns: the lowest is left out first
    wrap: bool = False  # long text that may wrap onto more lines
    head: bool = False  # in the stacked layout, on the block's first line


class Grid:
    """A plain table (no box, left-aligned headers) laid out for the width it is printed at."""

    def __init__(self, *columns: Col | str, title: str | None = None, label: str | None = None):
        self.columns = [c if isinstance(c, Col) else Col(c) for c in columns]
        if not any(c.keep for c in self.columns):
            self.columns[0].keep = True
        if not any(c.head for c in self.columns):
            self.columns[0].head = True
        for c in self.columns:
            c.keep = c.keep or c.head
        self.title = title
        self.label = label  # said above the stacked blocks (the first column's meaning)
        self.rows: list[list[Any]] = []

    def add_row(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([_text(c) for c in cells])

    # ------------------------------------------------------------ layout

    def widths(self, width: int) -> dict[int, int] | None:
        """Column index -> width of every column shown at `width`; None: not even the kept
        columns fit (the stacked layout)."""
        natural = [self._natural(i) for i in range(len(self.columns))]
        least = [self._least(i, natural[i]) for i in range(len(self.columns))]
        shown = list(range(len(self.columns)))
        optional = [i for i, c in enumerate(self.columns) if not c.keep]
        optional.sort(key=lambda i: (self._says_something(i), self.columns[i].priority, -i))
        dropped = []
        while _total(least[i] for i in shown) > width:
            if not optional:
                return None
            dropped.append(optional.pop(0))
            shown.remove(dropped[-1])
        for i in reversed(dropped):  # one left out on the way that fits after all comes back
            if _total([*(least[j] for j in shown), least[i]]) <= width:
                shown = sorted([*shown, i])
        out = {i: least[i] for i in shown}
        _share(width - _total(out.values()), out, natural)
        return out

    def _says_something(self, index: int) -> bool:
        """False for a column of empty cells and dashes only: the first to leave."""
        return any(row[index].plain.strip() not in ("", "-") for row in self.rows)

    def _natural(self, index: int) -> int:
        cells = [row[index] for row in self.rows]
        return max([_cell_width(self.columns[index].header), *(_cell_width(c) for c in cells)])

    def _least(self, index: int, natural: int) -> int:
        col = self.columns[index]
        if not col.wrap:
            return natural
        return max(_cell_width(col.header), min(natural, WRAP_MIN))

    # ------------------------------------------------------------ rendering

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.text import Text

        width = options.max_width
        if self.title:
            yield Text(self.title, style="italic")
        layout = self.widths(width)
        if layout is None:
            yield from self._stacked()
            return
        yield self._table(layout)
        left_out = [c.header for i, c in enumerate(self.columns) if i not in layout]
        if left_out and self.rows:
            note = f"(not shown at {width} columns: {', '.join(left_out)}; --json has all)"
            yield Text(note, style="dim")

    def _table(self, layout: dict[int, int]) -> Any:
        from rich.table import Column, Table

        columns = [
            Column(c.header, width=layout[i], no_wrap=not c.wrap, overflow="fold")
            for i, c in enumerate(self.columns)
            if i in layout
        ]
        out = Table(*columns, box=None, pad_edge=False)
        for row in self.rows:
            out.add_row(*(cell for i, cell in enumerate(row) if i in layout))
        return out

    def _stacked(self) -> Iterator[Any]:
        from rich.text import Text

        if self.label:
            yield Text(self.label, style="italic")
        heads = [i for i, c in enumerate(self.columns) if c.head]
        rest = [i for i, c in enumerate(self.columns) if not c.head]
        pad = max((len(self.columns[i].header) for i in rest), default=0) + 1
        for n, row in enumerate(self.rows):
            if n:
                yield Text("")
            yield self._head_line(heads, row)
            for i in rest:
                col = self.columns[i]
                if not row[i].plain:
                    continue
                yield Text(f"  {(col.header.lower() + ':'):<{pad}} ") + row[i]

    def _head_line(self, heads: list[int], row: list[Any]) -> Any:
        """The first head cell as it is; any other with its header before it."""
        from rich.text import Text

        line = Text("")
        for n, i in enumerate(heads):
            if n:
                line.append(f"  {self.columns[i].header.lower()} ")
            line.append_text(row[i])
        return line


def _share(spare: int, widths: dict[int, int], natural: list[int]) -> None:
    """Give `spare` columns to the squeezed (wrap) columns, one at a time in turn."""
    squeezed = [i for i in widths if widths[i] < natural[i]]
    while spare > 0 and squeezed:
        for i in list(squeezed):
            if spare == 0:
                break
            widths[i] += 1
            spare -= 1
            if widths[i] == natural[i]:
                squeezed.remove(i)


def _total(widths: Iterable[int]) -> int:
    widths = list(widths)
    return sum(widths) + GAP * max(0, len(widths) - 1)


def _text(cell: Any) -> Any:
    """A cell as rich Text, shown literally (brackets and all)."""
    from rich.text import Text

    if isinstance(cell, Text):
        return Text(visible(cell.plain), style=cell.style, spans=cell.spans)  # same length
    return Text("" if cell is None else visible(str(cell)))


def visible(text: str) -> str:
    """`text` with each control character (an escape sequence's ESC, a CR, a bidi override)
    shown as U+FFFD, so that a name from a target never acts on the user's terminal; one
    character for one, so that a styled span still covers what it did."""
    return "".join(c if c.isprintable() or c == "\n" else "\ufffd" for c in text)


def _cell_width(cell: Any) -> int:
    from rich.cells import cell_len

    plain = cell if isinstance(cell, str) else cell.plain
    return max((cell_len(line) for line in plain.splitlines()), default=0)
