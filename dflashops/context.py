"""The global options of a command line and what they lazily open (inventory, session)."""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click
import typer

from dflashops.errors import ExitCode, OpsError
from dflashops.inventory import Inventory, find_inventory, load_inventory

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Context:
    inventory_path: str | None = None
    json: bool = False
    dry_run: bool = False
    verbose: int = 0
    _inventory: Inventory | None = field(default=None, repr=False)
    _session: Any = field(default=None, repr=False)

    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = load_inventory(find_inventory(self.inventory_path))
        return self._inventory

    def session(self):  # noqa: ANN201 (Session, imported lazily)
        if self._session is None:
            from dflashops.session import Session

            self._session = Session(self.inventory(), dry_run=self.dry_run, announce=say)
        return self._session

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def emit(self, document: Any) -> None:
        """The one JSON document of a `--json` reading command."""
        sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def note(line: str) -> None:
    """Progress and remarks: stderr, never mixed into --json output."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def fail(message: str, code: int) -> None:
    sys.stderr.write(f"dflashops: error: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def get(ctx: typer.Context) -> Context:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Context) else Context()


def command(fn: F) -> F:
    """Turn OpsError into one line and its exit code; Ctrl-C into 130; close connections."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = next((a for a in args if isinstance(a, typer.Context)), kwargs.get("ctx"))
        try:
            return fn(*args, **kwargs)
        except OpsError as exc:
            fail(exc.message, int(exc.code))
        except KeyboardInterrupt:
            fail("interrupted", int(ExitCode.INTERRUPTED))
        except (typer.Exit, typer.Abort, click.exceptions.ClickException):
            raise
        except Exception as exc:  # a bug of ours: still one line, the details on request
            if ctx is not None and get(ctx).verbose:
                traceback.print_exc()
            fail(
                f"internal error: {type(exc).__name__}: {exc} (rerun with -v for details)",
                int(ExitCode.FAILED),
            )
        finally:
            if ctx is not None:
                get(ctx).close()

    return wrapper  # type: ignore[return-value]
