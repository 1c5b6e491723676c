"""`compare --plot`: the runs' curves in one image, a panel per metric, steps across; below
them a tau panel (chain tau and the largest DDTree budget's, against step, from stored
evaluations, with the reference drafter's tau dotted) when the runs have any, and a speedup
panel (each serving benchmark's speedup per concurrency against step) when they have those.

matplotlib is imported only when a plot is drawn (it costs ~0.3 s), with its headless Agg
backend, so the command line starts fast and plots on machines without a display.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path
from typing import Any

from dflashops.errors import OpsError, UsageError
from dflashops.runs.evaluation.fingerprints import differs
from dflashops.runs.evaluation.results import SPEEDUP, tau_value
from dflashops.runs.reading.view import RunView

FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")
LOG_SPAN = 10.0  # a loss panel whose values span more than this factor gets a log scale


def check(path: Path) -> None:
    """Refuse a plot file that cannot be written before anything is read."""
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise UsageError(f"--plot {path}: name a .png, .svg, .pdf or .jpg file")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: no directory {path.parent}")
    if importlib.util.find_spec("matplotlib") is None:
        raise OpsError(
            "--plot: matplotlib is missing from this install (it is a dependency of "
            "dflashops): reinstall it, e.g. pip install -e ."
        )


def title(views: list[RunView], today: datetime.date | None = None) -> str:
    """'a, b on ct200, ct201 · 2026-12-01': the runs, where they live, the day drawn."""
    names = ", ".join(v.name for v in views)
    targets = ", ".join(dict.fromkeys(v.target for v in views))
    return f"{names} on {targets} · {(today or datetime.date.today()).isoformat()}"


def points(view: RunView, key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in view.records if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def wants_log(key: str, values: list[float]) -> bool:
    """A loss that spans decades (positive, max/min > LOG_SPAN) reads better on a log scale."""
    if "loss" not in key or not values or min(values) <= 0:
        return False
    return max(values) / min(values) > LOG_SPAN


def tau_points(evals: list[dict[str, Any]], run: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, taus) of a run's stored evaluations; key as tau_value takes it."""
    by_step: dict[int, float] = {}
    for r in sorted((r for r in evals if r["run"] == run), key=lambda r: r.get("mtime") or 0):
        value = tau_value(r, key)
        if value is not None:
            by_step[r["step"]] = value
    return sorted(by_step), [by_step[s] for s in sorted(by_step)]


def unlike(views: list[RunView], evals: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """(run, step) -> the differing keys ('prompts', '?' unknown) of each result measured with
    other settings than the first row's (the first run's first result)."""
    order = {v.name: i for i, v in enumerate(views)}
    rows = sorted(evals, key=lambda r: (order.get(r["run"], len(order)), r["step"]))
    if not rows:
        return {}
    out = {}
    for r in rows:
        found = differs(r, rows[0])
        if found != []:
            out[(r["run"], r["step"])] = "?" if found is None else ",".join(found)
    return out


def mark_unlike(ax: Any, views: list[RunView], evals: list[dict[str, Any]]) -> None:
    """A red x over each chain tau measured with other settings than the first row's."""
    marked = unlike(views, evals)
    for view in views:
        xs, ys = tau_points(evals, view.name, "tau")
        hits = [(x, y, marked[(view.name, x)]) for x, y in zip(xs, ys, strict=True)
                if (view.name, x) in marked]  # fmt: skip
        if hits:
            keys = ", ".join(dict.fromkeys(k for _, _, k in hits))
            ax.plot([h[0] for h in hits], [h[1] for h in hits], "x", color="red", markersize=10,
                    label=f"{view.name}: settings differ ({keys})")  # fmt: skip


def draw_tau(ax: Any, views: list[RunView], evals: list[dict[str, Any]]) -> None:
    budgets = sorted({b for r in evals for b in (r.get("ddtree") or {})}, key=int)
    mark_unlike(ax, views, evals)
    for view in views:
        line = None
        series = [("tau", "-o", "tau chain")]
        series += [(f"ddtree{b}", "--s", f"DDTree {b}") for b in budgets[-1:]]  # the largest
        series += [("ref_tau", ":", "reference")]
        for key, style, label in series:
            xs, ys = tau_points(evals, view.name, key)
            if xs:
                color = None if line is None else line.get_color()
                (drawn,) = ax.plot(xs, ys, style, color=color, label=f"{view.name} {label}")
                line = line or drawn
    ax.set_ylabel("tau (eval)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def draw_speedup(ax: Any, views: list[RunView], serves: list[dict[str, Any]]) -> None:
    """Each run's speedup per concurrency (a line style per concurrency, a color per run)."""
    levels = sorted({c for r in serves for c in (r.get("serve") or {})}, key=int)
    styles = ["-o", "--s", ":^", "-.v"]
    for view in views:
        line = None
        for i, c in enumerate(levels):
            xs, ys = tau_points(serves, view.name, f"{SPEEDUP}{c}")
            if xs:
                color = None if line is None else line.get_color()
                (drawn,) = ax.plot(xs, ys, styles[i % len(styles)], color=color,
                                   label=f"{view.name} @{c}")  # fmt: skip
                line = line or drawn
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speedup (serve)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def draw(
    views: list[RunView],
    keys: list[str],
    steps: list[int],
    path: Path,
    evals: list[dict[str, Any]] | None = None,
    serves: list[dict[str, Any]] | None = None,
) -> Any:
    """Write the figure to `path` (format from its suffix) and return it (closed); a tau panel
    below the metrics when `evals` (stored results, see commands/evals.py) has any of the runs,
    and a speedup panel below it when `serves` (stored serving results) has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {v.name for v in views}
    evals = [r for r in evals or [] if r["run"] in names]
    serves = [r for r in serves or [] if r["run"] in names]
    panels = len(keys) + (1 if evals else 0) + (1 if serves else 0)
    fig, axes = plt.subplots(panels, 1, figsize=(9, 2.6 * panels + 0.5), sharex=True,
                             squeeze=False)  # fmt: skip
    if evals:
        draw_tau(axes[len(keys), 0], views, evals)
    if serves:
        draw_speedup(axes[-1, 0], views, serves)
    for ax, key in zip(axes[: len(keys), 0], keys, strict=True):
        shown: list[float] = []
        for view in views:
            xs, ys = points(view, key)
            if xs:
                ax.plot(xs, ys, label=f"{view.name} ({view.target})")
                shown += ys
        if wants_log(key, shown):
            ax.set_yscale("log")
        if not shown:
            ax.text(0.5, 0.5, f"no run logged {key}", transform=ax.transAxes, ha="center",
                    color="grey")  # fmt: skip
        for s in steps:
            ax.axvline(s, color="grey", linewidth=0.5, linestyle=":")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if axes[0, 0].get_legend_handles_labels()[0]:
        axes[0, 0].legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title(views))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise OpsError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return fig
