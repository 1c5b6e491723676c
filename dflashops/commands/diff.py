"""`diff RUN RUN... [--all]`: the runs' configs side by side, with a recipe audit column.

A run's config is the trainer's resolved.yaml (every key, defaults filled in), else the
run.yaml that launch wrote. The audit column comes from each run's audit.json (the trainer's
recipe audit): the recipe's value and why it matters; a value the audit flagged is marked
* (differs from the recipe), ! (warning) or !! (error). Keys with warnings or errors are always
shown; other keys only when the runs differ (all of them with --all).

Each run's dataset is shown under its name: data.path and, for a dataset made by `datagen`
(CONTRACTS §7), what its manifest says made it (target, engine, temperature, chat template
kwargs); those become rows `dataset.*` of the table, compared as the config's keys are, and
so does where each run has lived (`run.lived`: targets, processes each, from which step). Under
the data line, what the run's token store lost to data.max_length (turns cut, the share of
supervised tokens past it: the trainer's audit item `dataset.lost`).
"""

from __future__ import annotations

import json
from typing import Any

import typer
import yaml

from dflashops import context
from dflashops.commands import _options
from dflashops.remote import layout
from dflashops.render import console, styled, table
from dflashops.runs.datagen.job import dataset_of
from dflashops.runs.lifecycle.sweep import swept_keys
from dflashops.runs.reading.survey import expand, pick
from dflashops.runs.reading.view import RunView, check_name, lived_text
from dflashops.tables import Col

FILES = [layout.RESOLVED_CONFIG, layout.RUN_CONFIG, layout.AUDIT_FILE]
MARKS = {"peer": "~", "info": "*", "warn": "!", "error": "!!"}  # the least severe first
UNSET = "(unset)"
LOST_KEY = "dataset.lost"  # the trainer's audit item: what the token store lost to max_length


def register(app: typer.Typer) -> None:
    @app.command("diff")
    @context.command
    def diff(
        ctx: typer.Context,
        names: list[str] = typer.Argument(..., metavar="RUN RUN...", help="Runs to compare."),
        all_: bool = typer.Option(False, "--all", "-a", help="Every key, not just differing ones."),
        host: str = _options.HOST_OPTION,
        json_out: bool = _options.JSON_OPTION,
    ) -> None:
        """Show the runs' resolved configs side by side, with the recipe audit."""
        opts = context.begin(ctx, json_out)
        for name in names:
            check_name(name)
        session = opts.session()
        found, names = expand(session, list(names), archive=True, records="none", files=FILES)
        if opts.dry_run:
            opts.dry_run_done(runs=names)
            return
        views = pick(session, found, names, host=host)
        configs = {v.name: read_config(v) for v in views}
        datasets = {v.name: read_dataset(session, v, configs[v.name][0]) for v in views}
        audits = {v.name: read_audit(v) for v in views}
        for v in views:
            datasets[v.name]["store"] = store_report(audits[v.name])
            configs[v.name][0].update(dataset_rows(datasets[v.name]))
            configs[v.name][0]["run.lived"] = lived_text(v) or UNSET
        rows = swept_first(build_rows(views, configs, audits, all_), views)
        if opts.json:
            opts.emit(
                {
                    "runs": [
                        {
                            "run": v.name,
                            "target": v.target,
                            "source": configs[v.name][1],
                            "dataset": datasets[v.name],
                        }
                        for v in views
                    ],
                    "rows": rows,
                }
            )
            return
        show(views, configs, rows, all_, datasets)


def swept_first(rows: list[dict[str, Any]], views: list[RunView]) -> list[dict[str, Any]]:
    """The rows of the keys a sweep varied first (in the sweep's order), then the others."""
    swept = swept_keys([v.status for v in views])
    first = sorted((r for r in rows if r["key"] in swept), key=lambda r: swept.index(r["key"]))
    return first + [r for r in rows if r["key"] not in swept]


def read_dataset(session: Any, view: RunView, config: dict[str, Any]) -> dict[str, Any]:
    """The run's data.path and, where it is a datagen dataset on the run's target, how it
    was made."""
    path = config.get("data.path")
    if not isinstance(path, str) or not path:
        return {"path": None, "datagen": None}
    full = path if path.startswith("/") else f"{view.dir}/{path}"
    machine = session.machine(session.inventory.target(view.target))
    return {"path": path, "datagen": dataset_of(machine, full)}


def store_report(audit: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """What the run's token store lost to data.max_length (the trainer's audit item
    `dataset.lost`): {"lost": "2.1%", "note": "3 turns cut at max_length 4096, ..."}."""
    item = audit.get(LOST_KEY)
    if item is None:
        return None
    return {"lost": item.get("value"), "note": item.get("note")}


def dataset_rows(dataset: dict[str, Any]) -> dict[str, Any]:
    store = dataset.get("store")
    lost = {LOST_KEY: store["lost"]} if store else {}
    made = dataset.get("datagen")
    if not made:
        return lost
    target = made.get("target") or {}
    engine = made.get("engine") or {}
    return {"dataset.target": target.get("path"), "dataset.target_digest": target.get("digest"),
            "dataset.engine": f"{engine.get('name')} {engine.get('version')}",
            "dataset.temperature": made.get("temperature"),
            "dataset.max_new_tokens": made.get("max_new_tokens"),
            "dataset.cut": cut_share(made),
            "dataset.chat_template_kwargs": made.get("chat_template_kwargs"), **lost}  # fmt: skip


def cut_share(made: dict[str, Any]) -> str | None:
    """How many replies ended at the length limit, e.g. "12 of 480 replies (2.5%)"."""
    cut, replies = made.get("cut"), made.get("replies")
    if cut is None:
        return None
    if not replies:
        return f"{cut} replies"
    return f"{cut} of {replies} replies ({100 * cut / replies:.1f}%)"


def dataset_line(dataset: dict[str, Any]) -> str:
    store = dataset.get("store")
    tokens = f"\n  tokens: {store['note']}" if store else ""
    return made_line(dataset) + tokens


def made_line(dataset: dict[str, Any]) -> str:
    made = dataset.get("datagen")
    if not made:
        return f"  data: {dataset.get('path') or '(unset)'}"
    rows = dataset_rows(dataset)
    cut = rows["dataset.cut"]
    cut = f", cut at max_new_tokens {rows['dataset.max_new_tokens']}: {cut}" if cut else ""
    return (f"  data: {dataset['path']} (datagen: target {rows['dataset.target']}, engine "
            f"{rows['dataset.engine']}, temperature {rows['dataset.temperature']}, chat template "
            f"kwargs {json.dumps(rows['dataset.chat_template_kwargs'])}{cut})")  # fmt: skip


def read_config(view: RunView) -> tuple[dict[str, Any], str]:
    """(flattened config, the file it came from)."""
    files = view.raw.get("files") or {}
    for name in (layout.RESOLVED_CONFIG, layout.RUN_CONFIG):
        text = files.get(name)
        if text is None:
            continue
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            context.note(f"warning: {view.name}: {name} is not valid YAML; skipped")
            continue
        if isinstance(data, dict):
            return flatten(data), name
    context.note(f"warning: {view.name}: neither resolved.yaml nor run.yaml in {view.dir}")
    return {}, "-"


def read_audit(view: RunView) -> dict[str, dict[str, Any]]:
    """key -> the audit item of the most severe level for that key."""
    text = (view.raw.get("files") or {}).get(layout.AUDIT_FILE)
    if not text:
        return {}
    try:
        items = json.loads(text)
    except ValueError:
        context.note(f"warning: {view.name}: audit.json is not valid JSON; no audit shown")
        return {}
    order = list(MARKS)
    out: dict[str, dict[str, Any]] = {}
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or "key" not in item:
            continue
        old = out.get(item["key"])
        rank = order.index(item.get("level", "info")) if item.get("level") in order else 0
        if old is None or rank > order.index(old.get("level", "info")):
            out[item["key"]] = item
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def text_of(value: Any) -> str:
    if value is UNSET:
        return UNSET
    if isinstance(value, str):
        return value
    return json.dumps(value)


def build_rows(
    views: list[RunView],
    configs: dict[str, tuple[dict[str, Any], str]],
    audits: dict[str, dict[str, dict[str, Any]]],
    all_: bool,
) -> list[dict[str, Any]]:
    keys: list[str] = []
    for v in views:
        keys += [k for k in configs[v.name][0] if k not in keys]
    keys += sorted({k for a in audits.values() for k in a if k not in keys})
    rows = []
    for key in keys:
        vals = {v.name: configs[v.name][0].get(key, UNSET) for v in views}
        differs = len({text_of(x) for x in vals.values()}) > 1
        items = {n: audits[n][key] for n in audits if key in audits[n]}
        severe = any(i.get("level") in ("warn", "error") for i in items.values())
        if not (all_ or differs or severe):
            continue
        rows.append(
            {
                "key": key,
                "differs": differs,
                "values": {n: None if x is UNSET else x for n, x in vals.items()},
                "unset": [n for n, x in vals.items() if x is UNSET],
                "audit": items,
            }
        )
    return rows


def audit_cell(items: dict[str, dict[str, Any]]):  # noqa: ANN201 (rich Text, shown literally)
    if not items:
        return styled("")
    first = next(iter(items.values()))
    worst = max(items.values(), key=lambda i: list(MARKS).index(i.get("level", "info")))
    note = worst.get("note", "")
    recipe = first.get("recipe")
    level = worst.get("level", "info")
    colour = {"warn": "yellow", "error": "red"}.get(level)
    text = f"recipe {text_of(recipe)}: {note}" if recipe is not None else note
    return styled(text, colour)


def show(
    views: list[RunView],
    configs: dict[str, tuple[dict[str, Any], str]],
    rows: list[dict[str, Any]],
    all_: bool,
    datasets: dict[str, dict[str, Any]],
) -> None:
    out = console()
    for v in views:
        out.print(f"{v.name}: {v.target}:{v.dir}/{configs[v.name][1]} ({v.state})")
        out.print(dataset_line(datasets[v.name]))
    out.print()
    if not rows:
        out.print("the configs are the same" + ("" if all_ else " (--all shows every key)"))
        return
    names = [Col(v.name, keep=True, wrap=True) for v in views]  # a long value wraps, never a name
    grid = table(
        Col("KEY", keep=True, head=True), *names, Col("RECIPE AUDIT", keep=True, wrap=True)
    )
    for row in rows:
        cells = [row["key"]]
        for v in views:
            value = UNSET if v.name in row["unset"] else row["values"][v.name]
            item = row["audit"].get(v.name)
            level = item.get("level", "info") if item else None
            mark = f" {MARKS.get(level, '*')}" if level not in (None, "peer") else ""
            cells.append(text_of(value) + mark)
        grid.add_row(*cells, audit_cell(row["audit"]))
    out.print(grid)
    out.print()
    out.print("* differs from the recipe, ! warning, !! error (from each run's audit.json; an "
              "audit note alone: the recipe's value where the peers' trainers default otherwise)"
              + ("" if all_ else "; only differing keys and warnings shown (--all: every key)"))  # fmt: skip
