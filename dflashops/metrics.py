"""The metrics of train_log.jsonl as the operator shows them (CONTRACTS §3): one line each, with
how a value is written, which way is better, and where it is shown. Adding a metric is one line
here (the trainer has its own list of what it logs). A key that is not here is still read and
shown where it is asked for (`compare --metrics KEY`), written with 4 significant digits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # the train_log.jsonl key
    format: str  # format spec of a value
    higher: bool | None = None  # higher is better (False: lower; None: neither): compare's best
    row: int | None = None  # a column of `status`'s table, kept that long on a narrow terminal
    history: bool = False  # a column of `status RUN`'s recent log lines (and the live view)
    vs: bool = False  # shown for both runs of `status --vs` (and by --follow --vs)

    @property
    def header(self) -> str:
        """'TOK/S', 'GRAD NORM', 'VAL LOSS'."""
        return "TOK/S" if self.name == "tok_s" else self.name.upper().replace("_", " ")


TABLE = (
    Metric("loss", ".4f", higher=False, row=8, history=True, vs=True),
    Metric("acc", ".3f", higher=True, row=7, history=True, vs=True),
    Metric("streak", ".2f", higher=True, row=4, history=True, vs=True),
    Metric("dds8", ".2f", higher=True, row=3, history=True, vs=True),
    Metric("lr", ".2e", history=True),
    Metric("noise", ".3f", history=True),
    Metric("epoch", ".2f"),
    Metric("grad_norm", ".2f", history=True),
    Metric("tok_s", ".0f", higher=True, row=2, history=True),
    Metric("val_loss", ".4f", higher=False, history=True),
    Metric("val_acc", ".3f", higher=True, history=True),
    Metric("val_streak", ".2f", higher=True, history=True),
    Metric("val_dds8", ".2f", higher=True, history=True),
    Metric("kept", ".3f", history=True),
)
BY_NAME = {m.name: m for m in TABLE}

ROW = tuple(m for m in TABLE if m.row is not None)  # status's columns, in this order
HISTORY = tuple(m.name for m in TABLE if m.history)  # the first stay longest
VS = tuple(m.name for m in TABLE if m.vs)
# compare --tau's keys (stored evaluations and serving benchmarks): higher is better
EVAL_PREFIXES = ("tau", "ddtree", "speedup")


def value_format(key: str) -> str | None:
    """The format spec of `key`'s values; None for a key not in the table."""
    metric = BY_NAME.get(key)
    return metric.format if metric is not None else None


def higher_is_better(key: str) -> bool | None:
    """True where a higher value of `key` is better, False where lower, None where neither."""
    if key in BY_NAME:
        return BY_NAME[key].higher
    return True if key.startswith(EVAL_PREFIXES) else None
