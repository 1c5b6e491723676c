"""How `pct` turns argv into parameters: PVE::JSONSchema::get_options over Getopt::Long.

Getopt::Long runs with its defaults (permute, auto_abbrev, ignore_case) and
prefix_pattern `(--|-)`, so in `pct exec 201 ls -la` the `-la` is an (unknown) option.
Only `--` ends option parsing. Errors are PVE 400 exceptions, printed with a usage line.
"""

from __future__ import annotations

import sys


class ParamError(Exception):
    """A PVE::Exception with code 400: `400 <msg>`, then `key: error` lines, then usage."""

    def __init__(self, msg: str, errors: dict[str, str] | None = None):
        super().__init__(msg)
        self.msg = msg
        self.errors = errors or {}


class Prop:
    """A parameter of a pct command's JSON schema."""

    def __init__(self, type: str, optional: bool = True, minimum=None, maximum=None):
        self.type = type  # "string", "integer", "boolean" or "array"
        self.optional = optional
        self.minimum = minimum
        self.maximum = maximum


VMID = Prop("integer", optional=False, minimum=100, maximum=999_999_999)


def _spec(prop: Prop) -> str:
    if prop.type == "boolean":
        return ":s"
    return "=s@" if prop.type == "array" else "=s"


def getopt_long(specs: dict[str, str], args: list[str]) -> tuple[dict, list[str], bool]:
    """Getopt::Long::GetOptionsFromArray with permute; returns (opts, operands, ok).

    Warnings go to stderr exactly as Getopt::Long words them.
    """
    opts: dict = {}
    rest: list[str] = []
    ok = True
    queue = list(args)
    while queue:
        arg = queue.pop(0)
        if arg == "--":
            rest.extend(queue)
            break
        if not _is_option(arg):
            rest.append(arg)
            continue
        name, eq, inline = arg[2 if arg.startswith("--") else 1 :].partition("=")
        found = _lookup(specs, name)
        if found is None:
            ok = False
            continue
        spec = specs[found]
        value = inline if eq else None
        if spec.startswith("="):
            if value is None:
                if not queue:
                    sys.stderr.write(f"Option {name} requires an argument\n")
                    ok = False
                    continue
                value = queue.pop(0)
        elif value is None:
            # optional value: take the next word unless it ends or looks like an option
            takes = queue and queue[0] != "--" and not _is_option(queue[0])
            value = queue.pop(0) if takes else ""
        if spec.endswith("@"):
            opts.setdefault(found, []).append(value)
        else:
            opts[found] = value
    return opts, rest, ok


def _is_option(arg: str) -> bool:
    """Matches /^(--|-).+$/s: a prefix and at least one more character."""
    return len(arg) > 2 if arg.startswith("--") else len(arg) > 1 and arg.startswith("-")


def _lookup(specs: dict[str, str], name: str) -> str | None:
    low = name.lower()
    if low in specs:
        return low
    hits = sorted(k for k in specs if k.startswith(low))
    if len(hits) == 1:
        return hits[0]
    if hits:
        sys.stderr.write(f"Option {name} is ambiguous ({', '.join(hits)})\n")
    else:
        sys.stderr.write(f"Unknown option: {name}\n")
    return None


def get_options(props: dict[str, Prop], args: list[str], arg_param: list[str]) -> dict:
    """PVE::JSONSchema::get_options, then the schema check done by RESTHandler::handle."""
    specs = {name: _spec(p) for name, p in props.items()}
    opts, rest, ok = getopt_long(specs, args)
    if not ok:
        raise ParamError("unable to parse option")
    _assign_positional(props, opts, rest, arg_param)
    for name, prop in props.items():
        if prop.type == "boolean" and name in opts:
            opts[name] = _parse_boolean(opts[name])
    _validate(props, opts)
    return opts


def _assign_positional(props: dict[str, Prop], opts: dict, rest: list[str], names: list[str]):
    for i, name in enumerate(names):
        if opts.get("extra-args"):
            raise ParamError("internal error: extra-args must be the last argument")
        if name == "extra-args":
            opts["extra-args"] = rest[:]
            rest.clear()
            continue
        if not rest:
            if any(not props[n].optional for n in names[i:] if n != "extra-args"):
                raise ParamError("not enough arguments")
            if names[-1] == "extra-args":
                opts["extra-args"] = []
            break
        opts[name] = rest.pop(0)
    if rest:
        raise ParamError("too many arguments")


def _parse_boolean(value: str) -> int:
    if value == "" or value.lower() in ("1", "on", "yes", "true"):
        return 1
    if value.lower() in ("0", "off", "no", "false"):
        return 0
    raise ParamError("unable to parse boolean option")


def _validate(props: dict[str, Prop], opts: dict) -> None:
    errors = {}
    for name, prop in props.items():
        if name not in opts:
            if not prop.optional:
                errors[name] = "property is missing and it is not optional"
            continue
        value = opts[name]
        if prop.type == "integer":
            digits = str(value)[1:] if str(value)[:1] in "+-" else str(value)
            if not (digits.isascii() and digits.isdigit()):
                errors[name] = f"type check ('integer') failed - got '{value}'"
                continue
            opts[name] = number = int(value)
            if prop.maximum is not None and number > prop.maximum:
                errors[name] = f"value must have a maximum value of {prop.maximum}"
            elif prop.minimum is not None and number < prop.minimum:
                errors[name] = f"value must have a minimum value of {prop.minimum}"
    if errors:
        raise ParamError("Parameter verification failed.", errors)


def format_param_error(err: ParamError, usage: str) -> str:
    text = f"400 {err.msg}\n"
    text += "".join(f"{key}: {msg}\n" for key, msg in sorted(err.errors.items()))
    return text + usage + "\n"
