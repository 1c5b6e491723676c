"""`eval RUN --step N --on TARGET --serve`: the serving benchmark as an eval job's one step.

The job is an eval job (runs/evaluation/job.py: detached, the target's eval lock, `status`/`logs`/
`stop` by its name) whose step runs `python -m workload.serve_bench` instead of the evaluator,
with the eval target's vLLM environment, and keeps its result in <ws>/evals/RUN/serve_N.json.
`--vs RUN2:STEP` pulls that checkpoint there too and serves it side by side; `--vs PATH` is a
drafter directory on the target (served side by side) or a stored serving result (`.json`, put
side by side: its difference only where the fingerprints agree). `--vs-engine NAME|PATH` serves
the checkpoint (and the target alone) in a second vLLM environment of the target too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dflashops import engine_envs
from dflashops.errors import UsageError
from dflashops.inventory import Target, engine_of
from dflashops.remote import layout
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.view import ckpt_copy_dir
from dflashops.targets.base import Machine

VS_STEP = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63}):(\d+)\Z")


def serve_result_path(target: Target, run: str, step: int) -> str:
    return layout.serve_result_path(target.workspace, run, step)


def concurrency_levels(text: str | None) -> list[int]:
    """--concurrency 1,4,16 (the default): numbers >= 1, sorted, each once."""
    if text is None:
        return [1, 4, 16]
    try:
        found = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        found = []
    if not found or found[0] < 1:
        raise UsageError(f"--concurrency {text}: expected numbers >= 1, e.g. 1,4,16")
    return found


@dataclass(frozen=True)
class Vs:
    """The --vs subject: another run's checkpoint, a drafter directory, or a stored result."""

    run: str | None = None
    step: int | None = None
    path: str | None = None

    @property
    def is_result(self) -> bool:
        return self.path is not None and self.path.endswith(".json")

    def on(self, dest: Target) -> str:
        """Where it is on the eval target."""
        if self.run is not None and self.step is not None:
            return ckpt_copy_dir(dest, self.run, self.step)
        assert self.path is not None
        return self.path


def parse_vs(text: str | None) -> Vs | None:
    if text is None:
        return None
    found = VS_STEP.match(text)
    if found:
        return Vs(run=found.group(1), step=int(found.group(2)))
    if not text.startswith("/"):
        raise UsageError(
            f"--vs {text}: expected RUN:STEP (another checkpoint), or an absolute PATH on the "
            "target (a drafter directory, or a serving result .json)"
        )
    return Vs(path=text)


@dataclass(frozen=True)
class ServingChat:
    """How the target is served, in vLLM's words (`--serve-chat-template FILE`: its
    --chat-template; `--serve-chat-template-kwargs JSON`: its --default-chat-template-kwargs);
    None: the engine's default. FILE is a file here, else an absolute path on the target."""

    template: str | None = None
    kwargs: dict | None = None

    def __post_init__(self) -> None:
        if self.template is not None and self.local is None and not self.template.startswith("/"):
            raise UsageError(f"--serve-chat-template {self.template}: no such file here (a "
                             "file on the target: its absolute path)")  # fmt: skip

    @property
    def local(self) -> Path | None:
        """The template file here, if it is one."""
        if self.template is None or not Path(self.template).is_file():
            return None
        return Path(self.template)

    def argv(self, template: str | None) -> list[str]:
        """The workload programs' options, the template at `template` where it is to be read."""
        out = ["--serve-chat-template", template] if template is not None else []
        if self.kwargs is not None:
            out += ["--serve-chat-template-kwargs", json.dumps(self.kwargs)]
        return out


def serve_argv(base: list[str], python: str, levels: list[int], vs: Vs | None,
               dest: Target, vs_config: str | None = None) -> list[str]:  # fmt: skip
    """The evaluator's argv (eval_argv's) made the serving benchmark's; `vs_config`: the --vs
    drafter's run config there (its chat settings checked too)."""
    argv = list(base)
    argv[argv.index("workload.eval")] = "workload.serve_bench"
    argv += ["--vllm-python", python, "--concurrency", ",".join(map(str, levels))]
    if vs is not None:
        argv += ["--vs-result" if vs.is_result else "--vs", vs.on(dest)]
    if vs_config is not None:
        argv += ["--vs-config", vs_config]
    return argv


def vs_engine_argv(machine: Machine, name: str | None) -> list[str]:
    """--vs-engine NAME|PATH: the serving benchmark's second vLLM environment; refused when the
    eval target has no such environment."""
    if name is None:
        return []
    target = machine.target
    named = [n for n in target.engines if engine_of(n) == "vllm"]
    if name.startswith("/"):
        python = name
    elif name in named or name == "vllm":
        python = engine_envs.python_of(target, name)
    else:
        raise UsageError(
            f"--vs-engine {name}: {target.name} has no engine environment of that name "
            f"(hosts.yaml engines: {', '.join(named) or 'none'}); name one, e.g. engines: "
            "{vllm-0.31: /opt/vllm031/bin/python}, or give its python's absolute path"
        )
    if probe(machine, paths=[python]).paths.get(python) == "missing" and not machine.dry_run:
        raise UsageError(f"--vs-engine {name}: {python} is not on {target.name}")
    return ["--vs-vllm-python", python, "--vs-engine-name", name]
