"""Run commands on the `local` target: run directories laid out as the trainer writes them
(contract sections 2-4), read and changed through the real command line; the launch script
run by real tmux with a stand-in interpreter, so no training is needed here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashops.remote import source as remote_source
from tests.operator.cli import Ran, as_at_a_terminal, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER, make_run, write_checkpoint


@pytest.fixture
def ws(tmp_path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def tmux_dir(tmp_path):
    """A private tmux server for the test (TMUX_TMPDIR), killed afterwards."""
    path = tmp_path / "tmux"
    path.mkdir()
    yield path
    env = {**os.environ, "TMUX_TMPDIR": str(path)}
    for server in (["-L", "dflashops"], []):  # runs live on our own socket, -L dflashops
        subprocess.run(["tmux", *server, "kill-server"], env=env, capture_output=True)


PLAN_STAND_IN = """\
case " $* " in *" workload.plan "*)
  echo '{"world": 1, "sharding": "none", "per_rank": {"total": 1048576}, "gpu_memory": null,'
  echo ' "fits": null, "notes": []}'
  exit 0 ;;
esac
"""


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """A stand-in for the trainer's interpreter (torchrun and trainer in one): answers the
    memory plan, shows what the launcher gave it, then behaves as the run.yaml's line
    `# FAKE_MODE=...` says (config error, hard death, or nothing)."""
    path = tmp_path / "fakepy"
    path.write_text(
        "#!/bin/sh\n" + PLAN_STAND_IN + 'echo "argv: $*"\n'
        'echo "secret: ${DFO_TEST_SECRET:+set} pythonpath: $PYTHONPATH"\n'
        'echo "cuda: ${CUDA_VISIBLE_DEVICES:-unset}"\n'
        'case "$(sed -n "s/^# FAKE_MODE=//p" run.yaml)" in\n'
        "  config) echo 'error: run.yaml:3: loss.type: expected one of ce, kl' >&2; exit 2 ;;\n"
        "  die) kill -9 $$ ;;\n"
        "esac\n"
        "exit 0\n"
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def inventory(tmp_path, ws, tmux_dir, fake_python) -> Path:
    path = tmp_path / "hosts.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {fake_python}, env: {env}}}\n"
    )
    return path


@pytest.fixture
def cli(inventory):
    def run(*args: str, **kw) -> Ran:
        return dflashops(*args, inventory=inventory, **kw)

    return run


# ---------------------------------------------------------------- reading train_log.jsonl


def test_log_with_a_malformed_line_and_a_partial_last_line(cli, ws):
    good = [
        json.dumps({"step": s, "time": time.time(), "loss": 1.0 / s, "acc": 0.5}) for s in (1, 2, 3)
    ]
    text = good[0] + "\n{not json\n" + good[1] + '\n{"step": "x"}\n' + good[2] + '\n{"step": 4, "lo'
    make_run(ws, "messy", log_text=text)
    ran = cli("--json", "status", "messy")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert doc["step"] == 3 and doc["metrics"]["loss"] == pytest.approx(1 / 3)
    assert "train_log.jsonl:2: malformed line skipped" in ran.err
    assert "train_log.jsonl:4: no integer 'step'" in ran.err
    assert ":6" not in ran.err  # the partial last line is ignored quietly
    assert doc["warnings"] == [
        "train_log.jsonl:2: malformed line skipped",
        "train_log.jsonl:4: no integer 'step'; line skipped",
    ]
    compared = cli("--json", "compare", "messy", "messy", "--steps", "2,3")
    assert compared.code == 0, compared.err
    values = json.loads(compared.out)["runs"][0]["values"]["acc"]
    assert values["3"] == {"value": 0.5, "step": 3}


def test_readers_keep_any_numeric_key_and_drop_the_rest(cli, ws):
    rec = {"step": 5, "time": time.time(), "loss": 0.5, "my_metric": 7, "tag": "text", "flag": True}
    make_run(ws, "extra", [rec])
    doc = json.loads(cli("--json", "status", "extra").out)
    assert doc["metrics"] == {"loss": 0.5, "my_metric": 7}
    compared = json.loads(cli("--json", "compare", "extra", "extra", "--metrics", "my_metric").out)
    assert compared["runs"][0]["values"]["my_metric"]["5"]["value"] == 7


# ---------------------------------------------------------------- status views


def test_status_table_vs_and_names(cli, ws):
    now = time.time()
    make_run(ws, "a1", [{"step": s, "time": now, "acc": s / 10} for s in (2, 4, 6)])
    make_run(ws, "a2", [{"step": s, "time": now, "acc": s / 20} for s in (3, 6)], status="stopped")
    table = cli("status")
    assert table.code == 0, table.err
    assert [line.split()[0] for line in table.out.splitlines()[1:2]] == ["a2"]
    assert "a1 " not in table.out and "1 finished or archived run(s) not shown" in table.out
    vs = cli("status", "a1", "--vs", "a2")
    assert vs.code == 0, vs.err
    rows = {tuple(line.split()[:2]): line for line in vs.out.splitlines()}  # (step, run): row
    assert "0.400" in rows["4", "a1"] and "0.150 @3" in rows["4", "a2"]
    make_run(ws, "a3", [{"step": 3, "time": now, "acc": 0.3}])
    rows = json.loads(cli("--json", "status", "a1", "--vs", "a3").out)["rows"]
    # none that early, then the record at or before the step, then never reached
    assert [r["a3"] and r["a3"]["step"] for r in rows] == [None, None, None]
    assert [r["step"] for r in rows] == [2, 4, 6]
    back = json.loads(cli("--json", "status", "a3", "--vs", "a1").out)["rows"]
    assert back == [{"step": 3, "a3": {"step": 3, "time": now, "acc": 0.3},
                     "a1": {"step": 2, "time": now, "acc": 0.2}}]  # fmt: skip
    missing = cli("status", "a1x")
    assert missing.code == 4 and "did you mean 'a1'" in missing.err.lower()
    bad = cli("status", "bad name")
    assert bad.code == 2


def test_follow_of_a_finished_run_returns_at_once(cli, ws):
    make_run(ws, "done")
    ran = cli("status", "done", "--follow", "--interval", "1", timeout=30)
    assert ran.code == 0, ran.err
    assert ran.out.splitlines()[-1].startswith("done step 30")
    assert "done: finished at step 30" in ran.err


# ---------------------------------------------------------------- launch machinery


def test_secrets_reach_the_trainer_only_and_a_config_error_leaves_nothing(cli, ws, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("loss:\n  type: ce\n")
    env = {"DFO_TEST_SECRET": "s3cr3t-value", "CUDA_VISIBLE_DEVICES": "7"}
    ok = cli("launch", "sec", "--host", "local", "--config", str(cfg), "--secret", "DFO_TEST_SECRET",
             "--set", "optim.max_steps=5", env=env)  # fmt: skip
    assert ok.code == 1, ok.err  # the stand-in exits 0 without saying it finished
    assert "s3cr3t" not in ok.out + ok.err
    # a failed launch takes back what it made, the secrets file included
    assert not (ws / "runs" / "sec").exists()
    assert list((ws / "dflashops" / "secrets").iterdir()) == []
    cfg.write_text("# FAKE_MODE=config\nloss:\n  type: ce\n")
    bad = cli("launch", "sec", "--host", "local", "--config", str(cfg), env=env)
    assert bad.code == 2, bad.err
    assert bad.err.strip().splitlines()[-1] == (
        "dflashops: error: sec: the trainer refused to start: run.yaml:3: loss.type: expected one "
        "of ce, kl"
    )
    assert not (ws / "runs" / "sec").exists()
    dry = cli(
        "--dry-run",
        "launch",
        "sec2",
        "--host",
        "local",
        "--config",
        str(cfg),
        "--secret",
        "DFO_TEST_SECRET",
        "--set",
        "target.path=/m",
        "--set",
        "data.path=/d",
        env=env,
    )  # fmt: skip (a rehearsal checks the config here: a complete one)
    assert dry.code == 0 and "s3cr3t" not in dry.out + dry.err
    assert not (ws / "runs" / "sec2").exists()


def test_the_trainer_gets_the_secret_and_our_environment_only(trainer_cli, ws, tmp_path):
    """Secrets arrive in the trainer's environment through a 0600 file outside the run
    directory that is gone once it started; nothing of our (or a tmux server's) environment
    such as a stale CUDA_VISIBLE_DEVICES reaches it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    env = {"DFO_TEST_SECRET": "s3cr3t-value", "CUDA_VISIBLE_DEVICES": "7"}
    ran = trainer_cli("launch", "sec", "--host", "local", "--config", str(cfg),
                      "--secret", "DFO_TEST_SECRET", env=env)  # fmt: skip
    assert ran.code == 0, ran.err
    run = ws / "runs" / "sec"
    seen = json.loads((run / "env.json").read_text())
    assert seen["DFO_TEST_SECRET"] == "s3cr3t-value" and "CUDA_VISIBLE_DEVICES" not in seen
    assert list((ws / "dflashops" / "secrets").iterdir()) == []  # read, then deleted
    for path in run.rglob("*"):
        if path.is_file() and path.name != "env.json":
            assert b"s3cr3t" not in path.read_bytes(), path
    assert "s3cr3t" not in ran.out + ran.err
    assert trainer_cli("stop", "sec").code == 0
    archived = trainer_cli("archive", "sec")
    assert archived.code == 0, archived.err
    again = trainer_cli("resume", "sec")  # archived: refused, and no secret is reused anywhere
    assert again.code == 2


def test_a_trainer_killed_hard_is_reported_and_taken_back(cli, ws, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# FAKE_MODE=die\nseed: 1\n")
    ran = cli("launch", "dies", "--host", "local", "--config", str(cfg))
    assert ran.code == 1 and "the trainer failed (exit code 137)" in ran.err, ran.err
    assert not (ws / "runs" / "dies").exists()
    assert cli("--json", "status", "dies").code == 4


def test_launch_refuses_bad_input_before_touching_anything(cli, ws, tmp_path):
    cases = [
        (("launch", "bad/name", "--host", "local", "--config", "tiny"), 2, "run name"),
        (("launch", "ok", "--host", "nowhere", "--config", "tiny"), 4, "no target 'nowhere'"),
        (("launch", "ok", "--host", "local"), 2, "give --config FILE or a template name (qwen36-27b, tiny)"),
        (("launch", "ok", "--host", "local", "--config", "nope"), 2, "no such file, nor a template"),
        (("launch", "ok", "--host", "local", "--config", "tiny", "--set", "drafter"), 2, "KEY=VALUE"),
        (("launch", "ok", "--host", "local", "--config", "tiny", "--secret", "NOT_SET_ANYWHERE"), 2,
         "not set in your environment"),
    ]  # fmt: skip
    for args, code, message in cases:
        ran = cli(*args)
        assert ran.code == code and message in ran.err, (args, ran.err)
    assert not (ws / "runs").exists()


# ---------------------------------------------------------------- checkpoints and archive


def test_ckpts_lists_complete_incomplete_and_corrupt(cli, ws):
    run = make_run(ws, "ck", ckpts=(10, 20))
    write_checkpoint(run / "checkpoints" / "step_30", 30, complete=False)
    doc = json.loads(cli("--json", "ckpts", "ck").out)
    assert [(c["step"], c["complete"]) for c in doc["checkpoints"]] == [
        (10, True),
        (20, True),
        (30, False),
    ]
    blob = run / "checkpoints" / "step_20" / "model.safetensors"
    blob.write_bytes(b"x" + blob.read_bytes()[1:])
    verified = cli("--json", "ckpts", "ck", "--verify")
    assert verified.code == 1
    marks = {
        c["step"]: (c["verified"], c["problem"]) for c in json.loads(verified.out)["checkpoints"]
    }
    assert marks[10] == (True, None) and marks[20] == (False, "sha256 mismatch: model.safetensors")


def test_pull_ckpt_on_the_local_target_is_verified_idempotent_and_refuses_a_bad_manifest(cli, ws):
    run = make_run(ws, "pl", ckpts=(10, 20))
    ran = cli("--json", "pull-ckpt", "20", "--to", "local", "--run", "pl")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert (doc["copied"], doc["files"], doc["from"]) == (True, 2, "local")
    copy = ws / "ckpts" / "pl" / "step_20"
    for name in ("model.safetensors", "config.json", "MANIFEST.sha256"):
        assert (copy / name).read_bytes() == (run / "checkpoints" / "step_20" / name).read_bytes()
    assert (copy.parent / "run.yaml").read_text() == (run / "run.yaml").read_text()
    again = json.loads(cli("--json", "pull-ckpt", "20", "--to", "local", "--run", "pl").out)
    assert again["copied"] is False
    bad = run / "checkpoints" / "step_30"
    write_checkpoint(bad, 30)
    (bad / "MANIFEST.sha256").write_text("not a manifest\n")
    refused = cli("pull-ckpt", "30", "--to", "local", "--run", "pl")
    assert refused.code == 1 and "not in sha256sum format" in refused.err, refused.err
    assert not (ws / "ckpts" / "pl" / "step_30").exists()


def test_archive_moves_and_prunes_by_policy(cli, ws):
    run = make_run(ws, "old", ckpts=(10, 20, 30, 40))
    write_checkpoint(run / "checkpoints" / "step_50", 50, complete=False)
    dry = cli("--dry-run", "archive", "old", "--keep-last", "1", "--keep-every", "20")
    assert dry.code == 0, dry.err
    actions = {
        line.split()[0]: line.split()[-1]
        for line in dry.out.splitlines()
        if line.startswith("step_")
    }
    assert actions == {"step_10": "remove", "step_20": "keep", "step_30": "remove",
                       "step_40": "keep", "step_50": "(incomplete)"}  # fmt: skip
    assert "python3 -c '<program:" in dry.out and (run / "checkpoints" / "step_10").is_dir()
    ran = cli("--json", "archive", "old", "--keep-last", "1", "--keep-every", "20")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert sorted(doc["removed"]) == ["step_10", "step_30", "step_50"] and doc["freed_bytes"] > 2000
    moved = ws / "archive" / "old" / "checkpoints"
    assert not run.exists() and sorted(p.name for p in moved.iterdir()) == ["step_20", "step_40"]
    listed = json.loads(cli("--json", "status", "--all").out)["runs"]
    assert [(r["run"], r["state"]) for r in listed] == [("old", "archived")]
    assert cli("--json", "compare", "old", "old").code == 0
    again = cli("launch", "old", "--host", "local", "--config", "tiny")
    assert again.code == 2 and "local:archive/old" in again.err
    assert cli("archive", "old").code == 2


def test_archive_never_removes_the_newest_complete_checkpoint(cli, ws):
    make_run(ws, "keep", ckpts=(10, 20))
    doc = json.loads(cli("--json", "archive", "keep", "--keep-last", "0").out)
    assert doc["removed"] == ["step_10"] and doc["kept"] == ["step_20"]


def test_a_missing_interpreter_points_at_setup(tmp_path, ws, tmux_dir):
    inv = tmp_path / "nopy.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    inv.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {tmp_path}/venv/bin/python, env: {env}}}\n"
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\n")
    ran = dflashops("launch", "nopy", "--host", "local", "--config", str(cfg), inventory=inv)
    assert ran.code == 1
    assert ran.err.strip().endswith("not found on local; run `dflashops setup local` first")
    assert not (ws / "runs" / "nopy").exists()


# ---------------------------------------------------------------- --json: one document on stdout


def test_every_json_command_prints_exactly_one_document(cli, ws, tmp_path):
    make_run(ws, "j1", ckpts=(10, 20))
    make_run(ws, "j2", ckpts=(10,), status="stopped")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    evaluate = ["eval", "j1", "--step", "20", "--on", "local", "--set",
                f"target.path={tmp_path}/model", "--set", f"data.path={tmp_path}/data.jsonl"]  # fmt: skip
    reads = [
        ["status"], ["status", "--all"], ["status", "j1"], ["status", "j1", "--vs", "j2"],
        ["status", "j1", "--follow", "--interval", "1"], ["ckpts", "j1", "--verify"],
        ["compare", "j1", "j2"], ["diff", "j1", "j2"], ["stop", "j1"],
        ["pull-ckpt", "10", "--to", "local", "--run", "j1"],
    ]  # fmt: skip
    dry = [
        ["status"], ["ckpts", "j1"], ["compare", "j1", "j2"], ["diff", "j1", "j2"], ["stop", "j1"],
        ["archive", "j2", "--keep-last", "1"], ["pull-ckpt", "20", "--to", "local", "--run", "j1"],
        ["resume", "j2"], ["launch", "j3", "--host", "local", "--config", "tiny", "--set",
                           "target.path=/m", "--set", "data.path=/d"], evaluate,
        ["datagen", "j4", "--host", "local", "--prompts", str(tmp_path / "prompts.jsonl"),
         "--target", str(tmp_path / "model")],
    ]  # fmt: skip
    runs = [[*args, "--json"] for args in reads + dry[:1]]  # the command's own --json
    runs += [["--json", *args] for args in reads[:2] + [["logs", "j1"]]]
    runs += [["--dry-run", *args, "--json"] for args in dry]
    runs += [["--json", "--dry-run", "status"], ["--json", "--dry-run", "logs", "j1"]]
    for args in runs:
        ran = cli(*args)
        assert ran.code == 0, (args, ran.err)
        try:
            json.loads(ran.out)
        except ValueError:
            pytest.fail(f"{args}: stdout is not one JSON document: {ran.out[:300]!r}")
    assert (ws / "runs" / "j2").is_dir() and not (ws / "runs" / "j3").exists()
    assert not (ws / "data" / "j4").exists()
    assert not (ws / "ckpts" / "j1" / "step_20").exists()


# ---------------------------------------------------------------- a reader that goes away early


def _piped(inventory: Path, *args: str, read: int | None) -> tuple[int, str]:
    """Run the CLI into a real pipe whose reader takes `read` bytes and closes it (None: closed
    before the command starts); (exit code, stderr). A hang fails the test by its timeout."""
    full = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]
    if read is None:
        r, w = os.pipe()
        os.close(r)
        with open(w, "wb") as out:
            proc = subprocess.Popen(full, stdout=out, stderr=subprocess.PIPE)
    else:
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert len(proc.stdout.read(read)) == read
        proc.stdout.close()
    try:
        err = proc.stderr.read().decode()
        return proc.wait(timeout=30), err
    finally:
        proc.kill()


@pytest.fixture
def live_run(ws):
    """A run whose trainer is alive (a process with workload.train on its command line) and
    whose console.log is far bigger than a pipe's buffer."""
    run = make_run(ws, "live", status="running")
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "workload.train"]
    )
    state = json.loads((run / "state.json").read_text())
    state.update(pid=trainer.pid, exit_code=None, finished=None)
    (run / "state.json").write_text(json.dumps(state))
    (run / "console.log").write_bytes(b"step 1/30 loss 1.0\n" * 200_000)
    yield run
    trainer.kill()
    trainer.wait()


def test_output_into_a_closed_pipe_ends_quietly(inventory, live_run):
    cases = [
        (["logs", "live"], 4096),
        (["logs", "live", "--follow"], 4096),
        (["status", "live", "--follow", "--interval", "1"], None),
        (["--json", "status"], None),
    ]
    for args, read in cases:
        code, err = _piped(inventory, *args, read=read)
        assert code == 141, (args, code, err)
        assert "Traceback" not in err and "Exception" not in err and "error" not in err, (args, err)
    # rich exits 1 on a broken pipe; one big write cut short by the reader returns short, not
    # EPIPE, so the JSON document's end is dropped quietly (exit 0): quiet and over, either way
    for args, read in (
        (["status"], None),
        (["status", "live"], None),
        (["--json", "logs", "live"], 100),
    ):
        code, err = _piped(inventory, *args, read=read)
        assert code in (0, 1, 141) and err == "", (args, code, err)
    followers = subprocess.run(["pgrep", "-f", str(live_run / "console.log")], capture_output=True)
    assert followers.stdout == b"", "a log follower outlived its command"


# ---------------------------------------------------------------- reading the log on, not again


def _probe(ws: Path, **request) -> dict:
    """The run probe as a target runs it (python3 -c PROGRAM, a JSON request on stdin)."""
    argv = ["python3", "-c", remote_source("runs_probe.py")]
    request = {"ws": str(ws), "names": ["big"], **request}
    out = subprocess.run(argv, input=json.dumps(request).encode(), capture_output=True, check=True)
    return json.loads(out.stdout)["runs"][0]["log"]


def test_the_probe_parses_only_what_is_asked_for(ws):
    now = time.time()
    lines = [json.dumps({"step": s, "time": now, "loss": 1 / s}) for s in range(1, 101)]
    lines[1] = "{not json"
    run = make_run(ws, "big", log_text="\n".join(lines) + "\n")
    log = run / "train_log.jsonl"
    first = _probe(ws, records="all")
    assert len(first["records"]) == 99 and first["warnings"] == [
        "train_log.jsonl:2: malformed line skipped"
    ]
    # bytes before the cursor are never parsed again: garble line 1 in place (same length)
    data = log.read_bytes()
    log.write_bytes(b"x" * len(lines[0]) + data[len(lines[0]) :])
    with log.open("a") as f:
        f.write(json.dumps({"step": 101, "time": now}) + "\n{oops\n" + '{"step": 102, "lo')
    more = _probe(ws, records="all", cursor=first["cursor"])
    assert [r["step"] for r in more["records"]] == [101] and not more["reset"]
    assert more["warnings"] == ["train_log.jsonl:102: malformed line skipped"]
    with log.open("a") as f:
        f.write('ss": 0.5}\n')  # the partial last line is read once it is complete
    done = _probe(ws, records="all", cursor=more["cursor"])
    assert done["records"] == [{"step": 102, "loss": 0.5}] and done["warnings"] == []
    # the tail modes parse back from the end only as far as they need
    recent = _probe(ws, records="recent")
    assert [r["step"] for r in recent["records"]] == list(range(83, 101)) + [101, 102]
    assert recent["warnings"] == ["train_log.jsonl:102: malformed line skipped"]
    last = _probe(ws, records="none")
    assert last["last"] == {"step": 102, "loss": 0.5} and "records" not in last
    # a log replaced since (a resume rewinds it) is read again from its start
    (run / "new.jsonl").write_text(json.dumps({"step": 1, "time": now}) + "\n")
    os.replace(run / "new.jsonl", log)
    again = _probe(ws, records="all", cursor=done["cursor"])
    assert again["reset"] and [r["step"] for r in again["records"]] == [1]


FAKE_TRAINER = """\
import json, os, sys, time
run = sys.argv[1]
time.sleep(1.5)
with open(os.path.join(run, "train_log.jsonl"), "a") as log:
    for step in range(31, 41):
        line = "{oops" if step == 35 else json.dumps({"step": step, "time": time.time()})
        log.write(line + "\\n")
        log.flush()
        time.sleep(0.2)
path = os.path.join(run, "state.json")
state = json.load(open(path))
state.update(status="finished", exit_code=0, finished=time.time())
json.dump(state, open(path + ".tmp", "w"))
os.replace(path + ".tmp", path)
"""


def test_follow_prints_each_new_record_once_as_the_log_grows(cli, ws):
    run = make_run(ws, "grow", status="running")
    trainer = subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(run), "workload.train"])
    try:
        state = json.loads((run / "state.json").read_text())
        state.update(pid=trainer.pid, exit_code=None, finished=None)
        (run / "state.json").write_text(json.dumps(state))
        ran = cli("status", "grow", "--follow", "--interval", "1", timeout=60)
    finally:
        trainer.kill()
        trainer.wait()
    assert ran.code == 0, ran.err
    steps = [int(line.split()[2].split("/")[0]) for line in ran.out.splitlines()[1:]]
    assert ran.out.startswith("grow: running on local\n")
    assert steps == [10, 20, 30, 31, 32, 33, 34, 36, 37, 38, 39, 40]
    assert ran.err.count("train_log.jsonl:8: malformed line skipped") == 1
    assert "grow: finished at step 40" in ran.err


# ---------------------------------------------------------------- stop, resume, Ctrl-C


@pytest.fixture
def trainer_cli(tmp_path, ws, tmux_dir):
    """The CLI on a local target whose python is the stand-in trainer."""
    stub = tmp_path / "stand-in"
    stub.write_text(STAND_IN_TRAINER)
    stub.chmod(0o755)
    inv = tmp_path / "trainer.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    inv.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {stub}, env: {env}}}\n"
    )

    def run(*args: str, **kw) -> Ran:
        return dflashops(*args, inventory=inv, **kw)

    run.inventory = inv
    return run


def _interrupted(inventory: Path, *args: str) -> tuple[int, str]:
    """Run the CLI and press Ctrl-C (SIGINT) once it has printed something on stdout (it is
    following by then): (exit code, stderr)."""
    full = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
    proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=as_at_a_terminal)  # fmt: skip
    try:
        assert proc.stdout.read(1), "printed nothing"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=30), proc.stderr.read().decode()
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=10)
            raise AssertionError(
                f"{args}: still running 30 s after Ctrl-C:\n{err.decode()}"
            ) from None
    finally:
        proc.kill()


def test_stop_resume_and_ctrl_c_on_the_local_target(trainer_cli, ws, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    launched = trainer_cli("launch", "st", "--host", "local", "--config", str(cfg))
    assert launched.code == 0 and "st: running on local (tmux dflash-st" in launched.out
    refused = trainer_cli("archive", "st")
    assert refused.code == 2 and "stop it first" in refused.err
    for args in (["status", "st", "--follow"], ["logs", "st", "--follow"]):
        code, err = _interrupted(trainer_cli.inventory, *args)
        assert code == 130 and "detached; st keeps running" in err, (args, code, err)
    assert json.loads(trainer_cli("--json", "status", "st").out)["state"] == "running"
    first = json.loads(trainer_cli("stop", "st", "--json").out)
    assert (first["state"], first["stopped"], first["exit_code"]) == ("stopped", True, 0)
    assert first["checkpoint"] == first["step"] >= 1
    resumed = trainer_cli("resume", "st")
    assert resumed.code == 0 and f"resuming from step_{first['step']}" in resumed.err
    again = trainer_cli("--json", "stop", "st")
    assert again.code == 0, again.err
    second = json.loads(again.out)
    assert second["checkpoint"] > first["checkpoint"]
    steps = [json.loads(line)["step"] for line in (ws / "runs/st/train_log.jsonl").open()]
    assert steps == list(range(1, second["checkpoint"] + 1))  # rewound, then on
    ckpts = json.loads(trainer_cli("--json", "ckpts", "st", "--verify").out)["checkpoints"]
    assert [(c["step"], c["verified"]) for c in ckpts] == [
        (first["step"], True),
        (second["step"], True),
    ]
    done = trainer_cli("stop", "st")
    assert done.code == 0 and done.out == "st: not running (stopped); nothing to stop\n"


# ---------------------------------------------------------------- hostile values, run identity

HOSTILE = 'it\'s "q" $(touch {pwned}/sub) `touch {pwned}/tick` ;|&<> \\ end'


def test_no_value_a_user_sets_reaches_a_shell(tmp_path, tmux_dir):
    """Quotes, $(...), backticks and newlines in the workspace, the python path, env values and
    config values arrive as they are, and nothing they spell runs."""
    pwned = tmp_path / "pwned"
    pwned.mkdir()
    hostile = HOSTILE.format(pwned=pwned)
    odd = tmp_path / hostile.replace("/", "_")
    odd.mkdir()
    stub = odd / "python"
    stub.write_text(STAND_IN_TRAINER)
    stub.chmod(0o755)
    ws = odd / "ws"
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump({
        "version": 1,
        "targets": {"local": {
            "kind": "local", "workspace": str(ws), "python": str(stub),
            "env": {"TMUX_TMPDIR": str(tmux_dir), "ODD": hostile + "\nsecond line"},
        }},
    }))  # fmt: skip
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    ran = dflashops("launch", "odd", "--host", "local", "--config", str(cfg),
                    "--set", f"note={hostile}", inventory=inv)  # fmt: skip
    assert ran.code == 0, ran.err
    run = ws / "runs" / "odd"
    seen = json.loads((run / "env.json").read_text())
    assert seen["ODD"] == hostile + "\nsecond line"
    assert yaml.safe_load((run / "run.yaml").read_text())["note"] == hostile
    assert dflashops("stop", "odd", inventory=inv).code == 0
    assert list(pwned.iterdir()) == []
    refused = dflashops("launch", "x$(touch y)", "--host", "local", "--config", str(cfg),
                        inventory=inv)  # fmt: skip
    assert refused.code == 2 and "run name" in refused.err


def test_names_are_one_to_one_with_sessions_and_a_failed_launch_leaves_nothing(
    trainer_cli, ws, tmp_path, tmux_dir
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    for name in ("v5.1", "v5_1"):  # --force: the first one holds the target
        ran = trainer_cli("launch", name, "--host", "local", "--config", str(cfg), "--force")
        assert ran.code == 0, ran.err
    env = {**os.environ, "TMUX_TMPDIR": str(tmux_dir)}
    sessions = subprocess.run(["tmux", "-L", "dflashops", "list-sessions", "-F",
                               "#{session_name}"], env=env, capture_output=True, text=True)  # fmt: skip
    assert sorted(sessions.stdout.split()) == ["dflash-v5=1", "dflash-v5_1"]
    for name in ("v5.1", "v5_1"):
        assert json.loads(trainer_cli("--json", "status", name).out)["state"] == "running"
        assert trainer_cli("stop", name).code == 0
    # tmux missing on the target: the launch fails and nothing of it is left
    no_tmux = tmp_path / "no-tmux.yaml"
    stub = ws.parent / "stand-in"
    only_python = tmp_path / "bin"
    only_python.mkdir()
    (only_python / "python3").symlink_to("/usr/bin/python3")
    no_tmux.write_text(
        f"version: 1\ntargets:\n  local: {{kind: local, workspace: {ws}, python: {stub}}}\n"
    )
    failed = dflashops("launch", "lost", "--host", "local", "--config", str(cfg),
                       inventory=no_tmux, env={"PATH": str(only_python)})  # fmt: skip
    assert failed.code == 1 and "tmux is not installed" in failed.err, failed.err
    assert not (ws / "runs" / "lost").exists()
    again = trainer_cli("launch", "lost", "--host", "local", "--config", str(cfg))
    assert again.code == 0, again.err
    assert trainer_cli("stop", "lost").code == 0


def test_two_launches_of_one_name_on_two_targets_cannot_both_win(tmp_path, tmux_dir):
    stub = tmp_path / "stand-in"
    stub.write_text(STAND_IN_TRAINER)
    stub.chmod(0o755)
    inv = tmp_path / "two.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    inv.write_text(
        "version: 1\ntargets:\n"
        + "".join(
            f"  {name}: {{kind: local, workspace: {tmp_path / name}, python: {stub}, env: {env}}}\n"
            for name in ("one", "two")
        )
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")
    full = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inv), "launch", "race"]
    procs = [
        subprocess.Popen(
            [*full, "--host", host, "--config", str(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for host in ("one", "two")
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "run name 'race' is taken" in loser
    left = [name for name in ("one", "two") if (tmp_path / name / "runs" / "race").exists()]
    assert len(left) == 1
    assert dflashops("stop", "race", inventory=inv).code == 0


def _start_time(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rindex(b")") + 2 :].split()[19])


def test_a_reused_pid_is_not_taken_for_the_trainer(cli, ws):
    """After a restart another process can hold the recorded pid, even one whose command line
    says workload.train: the run is not shown running, and stop signals nothing."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "workload.train"]
    )
    try:
        run = make_run(ws, "ghost", status="running")
        state = json.loads((run / "state.json").read_text())
        state.update(pid=other.pid, pid_start=_start_time(other.pid) - 1, exit_code=None,
                     finished=None)  # fmt: skip
        (run / "state.json").write_text(json.dumps(state))
        doc = json.loads(cli("--json", "status", "ghost").out)
        assert doc["state"] == "failed", doc
        stopped = cli("stop", "ghost")
        assert stopped.code == 0 and "not running" in stopped.out, stopped.err
        assert other.poll() is None  # never signalled
    finally:
        other.kill()


def test_stop_kill_ends_a_trainer_that_does_not_stop(trainer_cli, ws, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# IGNORE_TERM\nseed: 0\n")
    assert trainer_cli("launch", "stubborn", "--host", "local", "--config", str(cfg)).code == 0
    pid = json.loads((ws / "runs/stubborn/state.json").read_text())["pid"]
    asked = trainer_cli("stop", "stubborn", "--timeout", "3")
    assert asked.code == 1 and "still running after" in asked.err, asked.err
    killed = trainer_cli("--json", "stop", "stubborn", "--kill")
    assert killed.code == 0, killed.err
    doc = json.loads(killed.out)
    assert doc["state"] == "failed" and doc["exit_code"] == 137, doc
    assert not Path(f"/proc/{pid}").exists()
