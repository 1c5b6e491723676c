"""The command line's group of verbs, each loaded only when it runs: `dflashops exec` imports
exec's module and what it uses, never the other verbs'. `--help` and the completion of verb
names read commands.VERBS (name, module, short help) and import no verb."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any

import typer
import typer.core
import typer.main

from dflashops.commands import VERBS

# typer's own click (vendored from typer 0.26 on, else the click package)
CLICK = typer.core.TyperGroup.__mro__[1].__module__.rpartition(".")[0]


def load(name: str) -> Any:
    """The click command of verb `name`, from its module's register(app)."""
    from dflashops import complete

    # the import statement's own machinery (not importlib's), so that -X importtime counts it
    module = __import__(f"dflashops.commands.{VERBS[name].module}", fromlist=["register"])
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    module.register(app)
    complete.attach(app)
    command = typer.main.get_command(app)
    return getattr(command, "commands", {}).get(name, command)  # a group's (hosts) by name


class VerbCommands(MutableMapping[str, Any]):
    """The commands of VERBS by name: iterating lists them, reading one loads it."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.loaded:
            if name not in VERBS:
                raise KeyError(name)
            self.loaded[name] = load(name)
        return self.loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self.loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self.loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(VERBS)

    def __len__(self) -> int:
        return len(VERBS)


class LazyVerbs(typer.core.TyperGroup):
    """A TyperGroup whose commands are VERBS, each loaded when it is looked up by name."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = VerbCommands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(VERBS)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        short = importlib.import_module(f"{CLICK}.utils").make_default_short_help
        limit = formatter.width - 6 - max(map(len, VERBS))
        rows = [(name, short(verb.help, limit)) for name, verb in VERBS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: Any, incomplete: str) -> list[Any]:
        item = importlib.import_module(f"{CLICK}.shell_completion").CompletionItem
        names = [item(n, help=v.help) for n, v in VERBS.items() if n.startswith(incomplete)]
        return names + typer.core.TyperCommand.shell_complete(self, ctx, incomplete)
