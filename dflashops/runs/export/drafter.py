"""The export of one complete checkpoint: its drafter files (everything its MANIFEST.sha256 lists
but the optimizer state: config.json with its dflash_config, model.safetensors, the drafter's
module), the chat template it was trained with (data.chat_template, else the target's
chat_template.jinja, else its tokenizer_config.json's) and a model card (card.py), under a new
MANIFEST.sha256 of its own.

It is copied as `pull-ckpt` copies (runs/evaluation/pulls.py's send): the training target's
`tar -c` through this process into the destination's partial directory (.partial-NAME beside
it), every file checked against the export's manifest as it lands, renamed into place only when
all verify; the two small files made here travel in front of the tar. A copy cut short resumes
(the files that verified are not sent again); exporting again to a directory that holds the
same export is free. A destination that holds anything else is refused, never replaced.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tarfile
import time
from dataclasses import dataclass
from typing import Any

import yaml

from dflashops import context
from dflashops import remote as helpers
from dflashops.errors import UsageError
from dflashops.inventory import Target
from dflashops.remote.layout import (
    CHAT_TEMPLATE,
    CHECKPOINTS,
    MANIFEST,
    MODEL_CARD,
    OPTIMIZER_DIR,
    RESOLVED_CONFIG,
    RUN_CONFIG,
    TOKENIZER_CONFIG,
    TRAINING_STATE,
)
from dflashops.render import Stopwatch, progress
from dflashops.runs.evaluation.pulls import check_placed, find_checkpoint, partial_dir, send
from dflashops.runs.evaluation.results import stored
from dflashops.runs.export.card import Facts, model_card
from dflashops.runs.reading.probe import probe
from dflashops.runs.reading.survey import reread
from dflashops.runs.reading.view import RunView
from dflashops.ssh.session import Session
from dflashops.targets.base import Machine


@dataclass
class Made:
    """The files made here (name -> bytes) and the export's manifest (name -> sha256)."""

    files: dict[str, bytes]
    entries: dict[str, str]
    facts: Facts

    @property
    def manifest(self) -> str:
        return "".join(f"{d}  {n}\n" for n, d in sorted(self.entries.items()))


def drafter_files(entries: dict[str, str]) -> dict[str, str]:
    """The checkpoint's files a server loads: all but what only a resumed trainer reads."""
    return {n: d for n, d in entries.items()
            if n != TRAINING_STATE and not n.startswith(OPTIMIZER_DIR + "/")}  # fmt: skip


def settings_of(view: RunView) -> dict[str, Any]:
    """The run's config with every default filled in (the trainer's resolved.yaml), else its
    run.yaml."""
    files = view.raw.get("files") or {}
    for name in (RESOLVED_CONFIG, RUN_CONFIG):
        try:
            doc = yaml.safe_load(files.get(name) or "")
        except yaml.YAMLError:
            continue
        if isinstance(doc, dict):
            return doc
    context.note(f"warning: {view.name} has no readable {RUN_CONFIG}; the card says less")
    return {}


def _read(machine: Machine, path: str) -> str | None:
    result = machine.run(["cat", "--", path])
    return result.stdout.decode("utf-8", "replace") if result.ok else None


def chat_template(machine: Machine, settings: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the template the run was trained with, where it came from), read in the training target;
    (None, None) when neither the config nor the target's tokenizer has one."""
    given = (settings.get("data") or {}).get("chat_template")
    if isinstance(given, str) and "{" in given:
        return given, "data.chat_template"
    if isinstance(given, str):
        return _read(machine, given), f"data.chat_template ({given})"
    target = str((settings.get("target") or {}).get("path") or "")
    if not target:
        return None, None
    text = _read(machine, posixpath.join(target, CHAT_TEMPLATE))
    if text is not None:
        return text, f"the target's {CHAT_TEMPLATE}"
    try:
        found = json.loads(_read(machine, posixpath.join(target, TOKENIZER_CONFIG)) or "{}")
    except ValueError:
        found = {}
    template = found.get("chat_template") if isinstance(found, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template, f"the target's {TOKENIZER_CONFIG}") if isinstance(template, str) else (None, None)  # fmt: skip


def measured(session: Session, run: str, step: int) -> tuple[list[dict], list[dict]]:
    """The stored eval and serving results of that step, on every target that can be read."""
    found = stored(session, [run])
    for target, err in found.errors.items():
        context.note(f"{target}: its evals not read ({err.message}); the card leaves them out")
    evals = [r for r in found.results if r.get("step") == step]
    serves = [s for s in found.serves if s.get("step") == step]
    return evals, serves


def member(name: str, data: bytes) -> bytes:
    """One regular file as a tar member (its header and padded data, no end-of-archive): put in
    front of the training target's tar, the receiver reads one stream."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    return info.tobuf(format=tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)


def make(session: Session, view: RunView, step: int, dest: str) -> tuple[Made, Source]:
    """The files made here, and the checkpoint's drafter files to send."""
    view = reread(session.machine(view.target), view.name, records="none", checkpoints=True,
                  files=[RUN_CONFIG, RESOLVED_CONFIG])  # fmt: skip
    ckpt = find_checkpoint(view, step)
    sent = drafter_files(ckpt.entries or {})
    settings = settings_of(view)
    template, origin = chat_template(session.machine(view.target), settings)
    files: dict[str, bytes] = {}
    sha = None
    if template is not None:
        files[CHAT_TEMPLATE] = template.encode()
        sha = hashlib.sha256(files[CHAT_TEMPLATE]).hexdigest()
    else:
        context.note(f"warning: no chat template found for {view.name} (data.chat_template, the "
                     "target's tokenizer); the export has none: serve with the one it was trained with")  # fmt: skip
    evals, serves = measured(session, view.name, step)
    facts = Facts(view.name, step, view.target, dest, settings, origin, sha, evals, serves)
    files[MODEL_CARD] = model_card(facts).encode()
    entries = {**sent, **{n: hashlib.sha256(b).hexdigest() for n, b in files.items()}}
    source = Source(posixpath.join(view.dir, CHECKPOINTS, ckpt.name), sorted(sent))
    return Made(files, entries, facts), source


@dataclass
class Source:
    dir: str  # the checkpoint's directory in the training target
    names: list[str]  # its files that go into the export


def already(machine: Machine, final: str, manifest: str) -> bool:
    """True when `final` holds this export and it verifies; refused when it holds anything
    else (an export is never put over a directory it did not make)."""
    found = probe(machine, names=[], dirs=[final], paths=[final], verify=True)
    kind = found.paths.get(final, "missing")
    if machine.dry_run or kind == "missing":
        return False
    there = found.dirs.get(final, {})
    if kind != "dir" or there.get("manifest") != manifest:
        raise UsageError(f"{machine.target.name}:{final} exists and is not this export; "
                         "give --to a new directory (or remove that one)")  # fmt: skip
    if there.get("verified"):
        return True
    context.note(f"{machine.target.name}:{final} holds this export but does not verify "
                 f"({there.get('problem')}); copying again")  # fmt: skip
    return False


def export(reader: Session, writer: Session, view: RunView, step: int, dest: Target,
           final: str) -> dict[str, Any]:  # fmt: skip
    """Make `final` on `dest` this checkpoint's export; returns what was done."""
    made, source = make(reader, view, step, final)
    report = {"run": view.name, "step": step, "from": view.target, "to": dest.name,
              "dest": final, "files": sorted(made.entries),
              "block_size": made.facts.block_size}  # fmt: skip
    if already(reader.machine(dest), final, made.manifest):
        return {**report, "copied": False, "seconds": 0.0}
    clock = Stopwatch()
    partial = partial_dir(final)
    head = json.dumps({"manifest": made.manifest}).encode() + b"\n"
    earlier = helpers.run(reader.machine(dest), "receive.py", partial, "--plan", final,
                          stdin=head, what=f"reading {partial}")  # fmt: skip
    kept = set(json.loads(earlier.stdout)["verified"]) if earlier.stdout else set()
    names = [n for n in source.names if n not in kept]
    head += b"".join(member(n, b) for n, b in sorted(made.files.items()))
    src, dst = writer.machine(view.target), writer.machine(dest)
    with progress(f"{view.name} step_{step} -> {dest.name}:{final}", None) as advance:
        done = send(src, source.dir, names, dst, partial, final, head, advance)
    if not dst.dry_run:
        check_placed(done, made.entries, dest.name, final, partial)
    return {**report, "copied": True, "seconds": round(clock.seconds, 3),
            "kept_files": len(source.names) - len(names),
            "verified": f"sha256 against its {MANIFEST}"}  # fmt: skip
