"""`datagen NAME --host TARGET[,TARGET...] --prompts FILE --target PATH [--engine vllm|transformers]
[--max-new-tokens N] [--temperature T] [--chat-template-kwargs JSON] [--follow|--detach]`

The target answers a chat corpus again, turn by turn, as a job (CONTRACTS §7): the input
copied into <ws>/data/NAME/ on each target and checked there (a malformed line: one line naming
FILE:LINE, exit 2, nothing left behind), then `python -m workload.datagen` in a detached tmux
session of our own on each target (it survives a closed laptop), one engine per GPU, the input
shared by chunks across processes and targets. `status`, `logs`, `stop` and `resume` take NAME
as a run's name. The directory is the dataset (`launch --set data.path=<ws>/data/NAME`).
Followed (the default), it is watched to its end; over several targets the shares are then
combined on the first target (`datagen NAME --collect` does that for a detached job).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dflashops import context
from dflashops.commands import _options
from dflashops.errors import UsageError
from dflashops.render import console
from dflashops.runs.datagen.job import Request, collect, follow, start_datagen
from dflashops.runs.datagen.kind import DATAGEN
from dflashops.runs.reading.survey import find
from dflashops.runs.reading.view import check_name


def register(app: typer.Typer) -> None:
    @app.command("datagen")
    @context.command
    def datagen(
        ctx: typer.Context,
        name: str = typer.Argument(
            ..., metavar="NAME", help="A new job (and dataset) name, unique across the inventory."
        ),
        host: str = typer.Option(
            None,
            "--host",
            metavar="TARGET[,TARGET...]",
            help="The target(s) to generate on; several share the input (the first holds the "
            "combined dataset).",
        ),  # fmt: skip
        prompts: Path = typer.Option(
            None,
            "--prompts",
            metavar="FILE",
            help="A local JSONL file of conversations (messages, ShareGPT conversations, or Alpaca "
            "instruction/input/output records).",
        ),  # fmt: skip
        model: str = typer.Option(
            None, "--target", metavar="PATH", help="The target model's directory on the targets."
        ),
        engine: str = typer.Option(
            None,
            "--engine",
            metavar="vllm|transformers",
            help="Default: vllm where every target has its environment (setup --engine vllm), "
            "else transformers.",
        ),  # fmt: skip
        max_new_tokens: int = typer.Option(8192, "--max-new-tokens", min=1, metavar="N"),
        temperature: float = typer.Option(
            0.0, "--temperature", min=0.0, metavar="T", help="0: greedy (the recipe's)."
        ),
        chat_template_kwargs: str = typer.Option(
            "{}",
            "--chat-template-kwargs",
            metavar="JSON",
            help="Given to the chat template, e.g. '{\"enable_thinking\": false}'.",
        ),  # fmt: skip
        chunk: int = typer.Option(
            None,
            "--chunk",
            min=1,
            metavar="N",
            help="Conversations per chunk, the unit of sharing and resuming (default 512).",
        ),  # fmt: skip
        nproc: int = typer.Option(
            None,
            "--nproc",
            min=1,
            metavar="N",
            help="Processes per target (default: one per GPU, else 1).",
        ),  # fmt: skip
        tensor_parallel_size: int = typer.Option(
            1,
            "--tensor-parallel-size",
            min=1,
            metavar="N",
            help="GPUs per engine (vllm), for a target that does not fit one GPU.",
        ),  # fmt: skip
        follow_: bool = typer.Option(
            True,
            "--follow/--detach",
            help="Watch it to its end and combine the shares (Ctrl-C detaches), or return "
            "once it runs.",
        ),  # fmt: skip
        collect_: bool = typer.Option(
            False, "--collect", help="Combine a finished job's shares on its first target."
        ),
        wait: float = _options.WAIT_OPTION,
        json_out: bool = _options.json_option("Print one JSON document: the job and dataset."),
    ) -> None:
        """Generate training replies with the target model, as a job on one target or several."""
        opts = context.begin(ctx, json_out)
        check_name(name)
        if collect_:
            with opts.sessions() as (reader, writer):
                view = find(reader, name, records="none")
                manifest = collect(reader, writer, view)
            return report(opts, opts.json, name, view.target, view.dir, "finished", manifest)
        for option, value in (("--host", host), ("--prompts", prompts), ("--target", model)):
            if value is None:
                raise UsageError(f"{option} is required (or --collect NAME)")
        if engine is not None and engine not in ("vllm", "transformers"):
            raise UsageError(f"--engine {engine}: vllm or transformers")
        kwargs = _options.json_object(chat_template_kwargs, "--chat-template-kwargs") or {}
        req = Request(prompts, model, engine, max_new_tokens, temperature, kwargs, chunk,
                      tensor_parallel_size, nproc)  # fmt: skip
        inventory = opts.inventory()
        targets = [inventory.target(t) for t in _options.parse_hosts(host)]
        with opts.sessions() as (reader, writer):
            started = start_datagen(reader, writer, name, targets, req, wait=wait)
            if started.view is None:
                opts.dry_run_done(name=name, targets=[t.name for t in targets],
                                  nodes=started.placement.record())  # fmt: skip
                return
            view = started.view
            if not follow_:
                return report(opts, opts.json, name, view.target, view.dir, view.state, None)
            manifest = follow(reader, writer, view)
        report(opts, opts.json, name, view.target, view.dir, "finished", manifest)


def report(
    opts: context.Context, as_json: bool, name: str, where: str, path: str, state: str,
    manifest: dict[str, Any] | None,
) -> None:  # fmt: skip
    keys = ("input", "done", "failed", "skipped", "complete", "engine", "sampling", "target")
    doc = {"name": name, "kind": DATAGEN.name, "target": where, "dir": path, "state": state,
           "manifest": {k: manifest.get(k) for k in keys} if manifest else None}  # fmt: skip
    if as_json:
        opts.emit(doc)
        return
    if manifest is None:
        console().print(f"{name}: {state} on {where}; follow it: dflashops logs {name} --follow; "
                        f"progress: dflashops status {name}")  # fmt: skip
        return
    failed = f", failed {manifest['failed']}" if manifest.get("failed") else ""
    console().print(
        f"{name}: complete: {manifest['done']} of {manifest['input']} conversations{failed}, "
        f"skipped {manifest['skipped']}; dataset {where}:{path} "
        f"(launch --set data.path={path})"
    )
