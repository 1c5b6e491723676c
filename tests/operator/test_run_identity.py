"""A run's identity on `local` targets, through the real command line with the stand-in trainer
(test_runs_local): the code snapshot a run executes and records, `--host` where a name exists
on two targets, and secrets that `resume` asks for again instead of reusing them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER, make_run, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_LINE = re.compile(r"^# workload snapshot ([0-9a-f]+)$", re.M)


class Targets:
    """Local targets, each with its own workspace and tmux server, whose python is the stand-in
    trainer; an inventory can name any of them (a target left out is one that was not read)."""

    def __init__(self, root: Path, names: tuple[str, ...]) -> None:
        self.root, self.names = root, names
        self.stand_in = root / "stand-in"
        self.stand_in.write_text(STAND_IN_TRAINER)
        self.stand_in.chmod(0o755)
        for name in names:
            (root / name / "tmux").mkdir(parents=True)

    def ws(self, name: str) -> Path:
        return self.root / name / "ws"

    def inventory(self, names: tuple[str, ...]) -> Path:
        path = self.root / f"hosts-{'-'.join(names)}.yaml"
        lines = ["version: 1", "targets:"]
        for name in names:
            env = json.dumps({"TMUX_TMPDIR": str(self.root / name / "tmux")})
            lines.append(f"  {name}: {{kind: local, workspace: {self.ws(name)}, "
                         f"python: {self.stand_in}, env: {env}}}")  # fmt: skip
        path.write_text("\n".join(lines) + "\n")
        return path

    def cli(self, *args: str, only: tuple[str, ...] | None = None, **kw) -> Ran:
        return dflashops(*args, inventory=self.inventory(only or self.names), **kw)

    def close(self) -> None:
        for name in self.names:
            env = {**os.environ, "TMUX_TMPDIR": str(self.root / name / "tmux")}
            subprocess.run(["tmux", "-L", "dflashops", "kill-server"], env=env,
                           capture_output=True)  # fmt: skip


@pytest.fixture
def targets(tmp_path):
    made = Targets(tmp_path, ("one", "two"))
    yield made
    made.close()


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 0\n")
    return path


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def trainer_env(run: Path) -> dict[str, str]:
    """The environment the (stand-in) trainer started with, as it recorded it."""
    return json.loads((run / "env.json").read_text())


# ---------------------------------------------------------------- the code a run executes


def package_copy(dest: Path) -> Path:
    """The operator with its workload and templates, copied: a source tree the test may edit
    (run from there, `dflashops` ships that tree's workload)."""
    for name in ("dflashops", "workload", "templates"):
        shutil.copytree(ROOT / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    return dest


def snapshot_of(run: Path) -> str:
    found = SNAPSHOT_LINE.findall((run / "run.yaml").read_text())
    assert len(found) == 1, (run / "run.yaml").read_text()
    return found[0]


def test_a_run_executes_its_own_snapshot_and_a_later_launch_never_changes_it(
    targets, config, tmp_path
):
    src = package_copy(tmp_path / "src")
    ws = targets.ws("one")

    def cli(*args: str) -> Ran:
        return targets.cli(*args, only=("one",), cwd=src)

    first = cli("launch", "snap1", "--host", "one", "--config", str(config))
    assert first.code == 0, first.err
    run1 = ws / "runs" / "snap1"
    digest1 = snapshot_of(run1)
    code1 = ws / "dflashops" / "code" / digest1
    assert json.loads((run1 / "launch.json").read_text())["code"] == str(code1)
    assert trainer_env(run1)["PYTHONPATH"] == str(code1)  # what the trainer imports
    before = tree_hashes(code1)
    assert "workload/train/loop.py" in before
    trainer = src / "workload" / "train" / "loop.py"
    original = trainer.read_text()
    trainer.write_text(original + "# edited after snap1 was launched\n")

    second = cli("launch", "snap2", "--host", "one", "--config", str(config), "--force")
    assert second.code == 0, second.err
    run2 = ws / "runs" / "snap2"
    digest2 = snapshot_of(run2)
    code2 = ws / "dflashops" / "code" / digest2
    assert digest2 != digest1
    assert trainer_env(run2)["PYTHONPATH"] == str(code2)
    assert (
        (code2 / "workload" / "train" / "loop.py")
        .read_text()
        .endswith("# edited after snap1 was launched\n")
    )
    # the first run's code and its record of it are as they were, and it still runs on them
    assert tree_hashes(code1) == before
    assert (code1 / "workload" / "train" / "loop.py").read_text() == original
    assert snapshot_of(run1) == digest1
    assert json.loads(cli("--json", "status", "snap1").out)["state"] == "running"
    # resumed, it keeps the code it ran, though the workload has changed since
    assert cli("stop", "snap1").code == 0
    held = cli("resume", "snap1")  # snap2 runs there (launched with --force): refused ...
    assert held.code == 2 and "one is busy: run snap2 is running there" in held.err, held.err
    resumed = cli("resume", "snap1", "--force")  # ... unless forced too
    assert resumed.code == 0, resumed.err
    assert trainer_env(run1)["PYTHONPATH"] == str(code1)
    assert snapshot_of(run1) == digest1 and tree_hashes(code1) == before
    assert cli("stop", "snap1").code == 0
    updated = cli("resume", "snap1", "--update-code", "--force")  # unless asked to take it now
    assert updated.code == 0, updated.err
    assert trainer_env(run1)["PYTHONPATH"] == str(code2)
    assert json.loads((run1 / "launch.json").read_text())["code"] == str(code2)
    for name in ("snap1", "snap2"):
        assert cli("stop", name).code == 0


# ---------------------------------------------------------------- one name on two targets


def test_a_name_on_two_targets_is_refused_until_host_picks_one(targets, config):
    # as if `one` could not be read when `two` launched it: the name exists twice
    for name in ("one", "two"):
        ran = targets.cli("launch", "dup", "--host", name, "--config", str(config), only=(name,))
        assert ran.code == 0, (name, ran.err)
    make_run(targets.ws("two"), "solo", ckpts=(10,))
    ask = (
        "dflashops: error: run 'dup' exists in more than one place (one:runs/dup, two:runs/dup); "
        "pick one with --host TARGET"
    )
    for args in (["status", "dup"], ["logs", "dup"], ["stop", "dup"], ["ckpts", "dup"],
                 ["pull-ckpt", "1", "--to", "one", "--run", "dup"], ["compare", "dup", "solo"],
                 ["diff", "dup", "solo"], ["status", "solo", "--vs", "dup"], ["archive", "dup"],
                 ["resume", "dup"], ["eval", "dup", "--step", "1", "--on", "one"]):  # fmt: skip
        ran = targets.cli(*args)
        assert (ran.code, ran.err.strip().splitlines()) == (2, [ask]), (args, ran.err)
    for name in ("one", "two"):
        doc = json.loads(targets.cli("--json", "status", "dup", "--host", name).out)
        assert (doc["target"], doc["dir"], doc["state"]) == (
            name, str(targets.ws(name) / "runs" / "dup"), "running"
        )  # fmt: skip
        newest = targets.cli("--json", "ckpts", "--host", name)  # no name: the newest running there
        assert (newest.code, json.loads(newest.out)["target"]) == (0, name), newest.err
    listed = json.loads(targets.cli("--json", "status", "--host", "two").out)["runs"]
    assert [(r["run"], r["target"]) for r in listed] == [("dup", "two")]

    stopped = targets.cli("--json", "stop", "dup", "--host", "two")
    assert stopped.code == 0, stopped.err
    doc = json.loads(stopped.out)
    assert (doc["target"], doc["state"], doc["stopped"]) == ("two", "stopped", True)
    step = doc["checkpoint"]
    assert json.loads(targets.cli("--json", "status", "dup", "--host", "one").out)["state"] == (
        "running"
    )
    logs = {name: targets.cli("logs", "dup", "--host", name) for name in ("one", "two")}
    assert all(ran.code == 0 for ran in logs.values()), logs
    for name, other in (("one", "two"), ("two", "one")):  # the launcher's line names the dir
        assert f"--run-dir {targets.ws(name) / 'runs' / 'dup'}" in logs[name].out
        assert str(targets.ws(other)) not in logs[name].out
    assert f"stopped at step {step} on request\n" in logs["two"].out
    assert "stopped at step" not in logs["one"].out and "step 1/1000" in logs["one"].out

    for name, steps in (("one", []), ("two", [step])):
        ran = targets.cli("--json", "ckpts", "dup", "--host", name)
        assert ran.code == 0, ran.err
        doc = json.loads(ran.out)
        assert (doc["target"], [c["step"] for c in doc["checkpoints"]]) == (name, steps)
    pulled = targets.cli("--json", "pull-ckpt", str(step), "--to", "one", "--run", "dup",
                         "--host", "two")  # fmt: skip
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["from"] == "two"
    assert (targets.ws("one") / "ckpts" / "dup" / f"step_{step}" / "MANIFEST.sha256").is_file()
    unsaved = targets.cli(
        "eval",
        "dup",
        "--step",
        str(step),
        "--on",
        "one",
        "--host",
        "one",
        "--set",
        f"target.path={targets.ws('one')}",
        "--prompts",
        str(targets.ws("one") / "runs" / "dup" / "run.yaml"),
    )
    assert unsaved.code == 4 and f"dup has no checkpoint step_{step}" in unsaved.err, (
        unsaved.err
    )  # --host one picked the run there, which saved no checkpoint

    # compare and diff: --host picks among the places of the name that is twice; `solo`
    # (on `two` only) is taken where it is
    for name in ("one", "two"):
        ran = targets.cli("--json", "compare", "dup", "solo", "--host", name)
        assert ran.code == 0, ran.err
        rows = json.loads(ran.out)["runs"]
        assert [(r["run"], r["target"]) for r in rows] == [("dup", name), ("solo", "two")]
        ran = targets.cli("--json", "diff", "dup", "solo", "--host", name)
        assert ran.code == 0, ran.err
        rows = json.loads(ran.out)["runs"]
        assert [(r["run"], r["target"]) for r in rows] == [("dup", name), ("solo", "two")]
    vs = json.loads(targets.cli("--json", "status", "solo", "--vs", "dup", "--host", "two").out)
    assert [(r["run"], r["target"]) for r in vs["runs"]] == [("solo", "two"), ("dup", "two")]

    # a single run named on the wrong target, or a target that is not there: not found
    wrong = targets.cli("status", "solo", "--host", "one")
    assert wrong.code == 4 and "no run 'solo' on one (it is at two:runs/solo)" in wrong.err
    for args in (["status", "dup"], ["compare", "dup", "solo"], ["ckpts", "dup"]):
        nowhere = targets.cli(*args, "--host", "nowhere")
        assert nowhere.code == 4 and "no target 'nowhere'" in nowhere.err, (args, nowhere.err)
    assert targets.cli("stop", "dup", "--host", "one").code == 0
    assert targets.cli("archive", "dup", "--host", "two").code == 0
    assert (targets.ws("two") / "archive" / "dup").is_dir()
    assert (targets.ws("one") / "runs" / "dup").is_dir()


def test_pick_by_host_among_archived_runs_too(targets):
    """A name in one target's runs/ and another's archive/ is two places as well."""
    make_run(targets.ws("one"), "twice", ckpts=(10,))
    make_run(targets.ws("two"), "twice", where="archive")
    write_checkpoint(targets.ws("two") / "archive" / "twice" / "checkpoints" / "step_20", 20)
    refused = targets.cli("ckpts", "twice")
    assert refused.code == 2 and "(one:runs/twice, two:archive/twice)" in refused.err
    for name, steps in (("one", [10]), ("two", [20])):
        doc = json.loads(targets.cli("--json", "ckpts", "twice", "--host", name).out)
        assert [c["step"] for c in doc["checkpoints"]] == steps
    doc = json.loads(targets.cli("--json", "status", "twice", "--host", "two").out)
    assert (doc["target"], doc["state"]) == ("two", "archived")


# ---------------------------------------------------------------- secrets and resume


def test_resume_asks_for_the_secret_again_and_none_is_left_behind(targets, config):
    ws = targets.ws("one")
    run = ws / "runs" / "sec"
    secrets_dir = ws / "dflashops" / "secrets"

    def cli(*args: str, value: str = "s3cr3t-value") -> Ran:
        return targets.cli(*args, only=("one",), env={"DFO_TEST_SECRET": value})

    launched = cli("launch", "sec", "--host", "one", "--config", str(config),
                   "--secret", "DFO_TEST_SECRET")  # fmt: skip
    assert launched.code == 0, launched.err
    assert trainer_env(run)["DFO_TEST_SECRET"] == "s3cr3t-value"
    assert cli("stop", "sec").code == 0
    # the trainer has exited: no secrets file anywhere, nothing of the value in the run but
    # the trainer's own record of its environment (env.json, the test's stand-in writes it)
    assert list(secrets_dir.iterdir()) == []
    leaked = [p for p in run.rglob("*") if p.is_file() and p.name != "env.json"
              and b"s3cr3t" in p.read_bytes()]  # fmt: skip
    assert leaked == [] and not [p for p in run.rglob("*secret*")]

    plain = cli("resume", "sec")  # the secret is in our environment, but not asked for
    assert plain.code == 0, plain.err
    assert "DFO_TEST_SECRET" not in trainer_env(run)
    assert cli("stop", "sec").code == 0
    assert [p for p in run.rglob("*") if p.is_file() and b"s3cr3t" in p.read_bytes()] == []

    again = cli("resume", "sec", "--secret", "DFO_TEST_SECRET", value="fresh-value")
    assert again.code == 0, again.err
    assert trainer_env(run)["DFO_TEST_SECRET"] == "fresh-value"
    assert "fresh-value" not in again.out + again.err
    assert list(secrets_dir.iterdir()) == []  # read, then deleted, as at launch
    assert cli("stop", "sec").code == 0
