"""The documents, tested (issue 34): every YAML sample of README.md and docs/ is read by the
inventory's or the run config's own loader; every `dflashops` command line of the README (its
code blocks and its inline code) is parsed by the real CLI under --dry-run, against the
README's own inventory sample; every option of the command synopses (README's Commands,
docs/contracts.md section 5) is one the verb's --help lists; and the facts of contracts.md a
test can reach are checked against the CLI. A renamed option fails here."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dflashops.inventory import load_inventory
from tests.operator.cli import dflashops
from tests.operator.test_rehearsal import Listener

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, lang: str | None = None) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if lang in (None, kind)]


def yaml_samples() -> list[tuple[str, str]]:
    return [(f"{p.name}#{i}", text) for p in DOCS for i, text in enumerate(blocks(p, "yaml"))]


@pytest.mark.parametrize(("where", "text"), yaml_samples(), ids=[w for w, _ in yaml_samples()])
def test_every_yaml_sample_is_read_by_its_loader(where, text, tmp_path):
    doc = yaml.safe_load(text)
    path = tmp_path / "sample.yaml"
    path.write_text(text)
    if "targets" in doc or "hosts" in doc:
        inventory = load_inventory(path)  # raises InventoryError naming file:line and key
        assert inventory.targets, where
        return
    from workload.config import load_config

    # a schema of defaults: its `{path, ...}` placeholders are given as a launch gives them
    cfg = load_config(path, ["target.path=/models/t", "data.path=/data/d.jsonl"])
    assert cfg.drafter.block_size > 1, where


def test_the_documents_have_an_inventory_sample_and_a_config_sample():
    kinds = {"targets" in yaml.safe_load(t) for _, t in yaml_samples()}
    assert kinds == {True, False}


# ---------------------------------------------------------------- the README's command lines


def readme_lines() -> list[str]:
    """`dflashops ...` in the README's code blocks (a line each, a `#` comment cut) and in its
    inline code (which may wrap over lines)."""
    text = (ROOT / "README.md").read_text()
    found = []
    for body in blocks(ROOT / "README.md", "sh"):
        for line in body.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("dflashops "):
                found.append(line)
    prose = FENCE.sub("", text)
    for span in re.findall(r"`(dflashops [^`]+)`", prose):
        found.append(" ".join(span.split()))
    return found


def readme_inventory(port: int) -> str:
    """The README's inventory sample with every SSH address on a loopback port that counts
    connections (none may be made)."""
    [text] = blocks(ROOT / "README.md", "yaml")
    doc = yaml.safe_load(text)
    for spec in (doc.get("hosts") or {}).values():
        spec.update(address="127.0.0.1", port=port)
    for spec in doc["targets"].values():
        if spec.get("kind") == "ssh":
            spec.update(address="127.0.0.1", port=port)
    return yaml.safe_dump(doc)


@pytest.fixture(scope="module")
def listener():
    host = Listener()
    yield host
    host.stop.set()
    host.thread.join()
    host.sock.close()


@pytest.fixture
def workdir(tmp_path):
    """The clone's folders a README line names, and the local files it gives."""
    (tmp_path / "templates").symlink_to(ROOT / "templates")
    (tmp_path / "prompts.jsonl").write_text(
        '{"instruction": "Say hi.", "input": "", "output": ""}\n'
    )
    (tmp_path / "Qwen3.6-27B").mkdir()
    (tmp_path / "Qwen3.6-27B" / "config.json").write_text("{}\n")
    return tmp_path


def test_every_readme_command_line_parses_under_dry_run(listener, workdir):
    lines = readme_lines()
    assert len(lines) >= 20 and any(" datagen " in f" {line} " for line in lines), lines
    inventory = workdir / "hosts.yaml"
    inventory.write_text(readme_inventory(listener.port))
    secrets = {"HF_TOKEN": "hf_stand_in", "WANDB_API_KEY": "stand-in"}
    for line in lines:
        argv = shlex.split(line)[1:]
        ran = dflashops("--dry-run", *argv, inventory=inventory, cwd=workdir, home=workdir,
                        env=secrets, timeout=120)  # fmt: skip
        assert "Traceback" not in ran.err, (line, ran.err)
        needs_a_host = ran.code == 1 and "--dry-run opens no connection" in ran.err  # trust
        assert ran.code in (0, 4) or needs_a_host, (line, ran.code, ran.err)  # 2: refused
    assert listener.accepted == 0


# ---------------------------------------------------------------- the synopses against --help


def synopsis(path: Path, heading: str) -> list[str]:
    """The command synopsis block that follows `heading`."""
    text = path.read_text()
    after = text[text.index(heading) :]
    return next(b for k, b in FENCE.findall(after) if k == "").splitlines()


def options_by_verb(lines: list[str]) -> dict[str, set[str]]:
    verbs: dict[str, set[str]] = {}
    verb = ""
    for line in lines:
        if not line.strip():
            continue
        if not line[0].isspace():
            words = re.split(r"\s{2,}", line)[0].split()  # the synopsis, not what it does
            names = [w for w in words[:2] if re.fullmatch(r"[a-z][a-z-]*", w)]
            if names and names[0] == "dflashops":
                names = []
            verb = " ".join(names)
        verbs.setdefault(verb, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    return verbs


@functools.cache
def help_options(verb: str) -> set[str]:
    ran = dflashops(*verb.split(), "--help", env={"COLUMNS": "200"})
    assert ran.code == 0, (verb, ran.err)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", ran.out))


@pytest.mark.parametrize(
    ("doc", "heading"),
    [("README.md", "## Commands"), ("docs/contracts.md", "## 5. The command line")],
)
def test_every_option_of_a_synopsis_is_in_its_verbs_help(doc, heading):
    verbs = options_by_verb(synopsis(ROOT / doc, heading))
    assert {"launch", "eval", "datagen", "hosts trust"} <= set(verbs), sorted(verbs)
    root = help_options("")
    for verb, options in sorted(verbs.items()):
        known = help_options(verb) | root if verb else root
        assert not options - known, f"{doc}: {verb or 'dflashops'}: {sorted(options - known)}"


def test_the_contracts_facts_that_the_cli_can_tell(tmp_path, listener):
    """contracts.md: `--engine auto` is eval's default; `--config` is required for launch; a
    dry-run check of a run on a remote target is not found (exit 4)."""
    contracts = (ROOT / "docs" / "contracts.md").read_text()
    assert "`--engine auto` is the default" in contracts
    assert "[default: auto]" in " ".join(
        dflashops("eval", "--help", env={"COLUMNS": "200"}).out.split()
    )
    assert "--host TARGET[,TARGET...] --config FILE|TEMPLATE" in contracts
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(readme_inventory(listener.port))
    bare = dflashops(
        "--dry-run", "launch", "r1", "--host", "ct200", inventory=inventory, home=tmp_path
    )
    assert bare.code == 2 and "give --config" in bare.err, bare.err
    assert "`check`\n  excepted" in contracts or "(`check` excepted" in contracts.replace(
        "\n  ", " "
    )
    check = dflashops("--dry-run", "check", "nosuch", "--on", "ct129", inventory=inventory,
                      home=tmp_path)  # fmt: skip
    assert check.code == 4, check.err
    assert listener.accepted == 0
