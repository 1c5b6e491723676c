"""What decides a tau, kept apart: results measured with other settings (their fingerprints,
contract §6) are marked in `evals` (grouped by prompt set), `compare --tau` and the plot, and no
gap is computed across them; `eval --engine vllm` where the eval target has no vLLM; and `watch`,
the alarms, running the user's command with the facts in its environment.

On the `local` target with run directories and eval results laid out as the trainer and the
evaluator write them (rundirs.py), read through the real command line: no training here (the
engine's own run is test_evals.py's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run

FINGERPRINT = {
    "prompts_sha256": "a" * 64, "chat_template_sha256": "c" * 64, "chat_template_kwargs": {},
    "temperature": 0.0, "max_new_tokens": 64, "block_size": 4,
    "target": {"path": "/models/tiny", "digest": "d" * 64},
    "engine": {"name": "sim", "version": "torch 2"}, "dtype": "float32",
}  # fmt: skip


def write_result(ws: Path, run: str, step: int, tau: float, **changed) -> None:
    """<ws>/evals/RUN/step_N.json as the evaluator writes it; `changed` fingerprint keys (None:
    a result from before fingerprints)."""
    doc = {"tau": tau, "ddtree": {"8": tau + 1}, "per_position": [0.5], "n_prompts": 8,
           "max_new_tokens": 64, "checkpoint": f"/ckpts/{run}/step_{step}",
           "engine": {"name": "sim", "version": "torch 2"}}  # fmt: skip
    if changed.get("fingerprint", True) is not None:
        doc["fingerprint"] = {**FINGERPRINT, **changed}
        named = "mtbench.jsonl" if "prompts_sha256" in changed else "prompts.jsonl"
        doc["prompt_set"] = {"name": named, "kind": "chat", "n_prompts": 8}
    where = ws / "evals" / run
    where.mkdir(parents=True, exist_ok=True)
    (where / f"step_{step}.json").write_text(json.dumps(doc))


@pytest.fixture
def bed(tmp_path):
    ws = tmp_path / "ws"
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text("version: 1\ntargets:\n  local: {kind: local, workspace: "
                         f"{ws}, python: {sys.executable}}}\n")  # fmt: skip

    def cli(*args: str, **kw) -> Ran:
        return dflashops(*args, inventory=inventory, home=tmp_path, **kw)

    return ws, cli


@pytest.fixture
def unlike(bed):
    """Runs base and new: new's step 20 on other prompts, its step 30 with thinking on, its
    step 40 from before fingerprints."""
    ws, cli = bed
    records = [{"step": s, "loss": 1 / s, "acc": s / 100} for s in (10, 20, 30, 40)]
    make_run(ws, "base", records)
    make_run(ws, "new", records)
    for step, tau in ((10, 2.0), (20, 2.5), (30, 2.4), (40, 2.6)):
        write_result(ws, "base", step, tau)
    write_result(ws, "new", 10, 2.2)
    write_result(ws, "new", 20, 3.0, prompts_sha256="b" * 64)
    write_result(ws, "new", 30, 3.1, chat_template_kwargs={"enable_thinking": True})
    write_result(ws, "new", 40, 3.2, fingerprint=None)
    return ws, cli


def test_evals_groups_by_prompt_set_and_marks_unlike_settings(unlike):
    _, cli = unlike
    ran = cli("--json", "evals")
    assert ran.code == 0, ran.err
    rows = {(r["run"], r["step"]): r for r in json.loads(ran.out)["evals"]}
    assert rows[("base", 30)]["settings"]["differs"] == []
    assert rows[("new", 20)]["settings"]["differs"] == ["prompts"]
    assert rows[("new", 30)]["settings"]["differs"] == ["template_kwargs"]
    assert rows[("new", 40)]["settings"]["differs"] is None  # unknown
    assert rows[("new", 10)]["settings"]["vs"] == {"run": "base", "step": 10, "target": "local"}

    text = cli("evals").out
    titles = [line for line in text.splitlines() if line.startswith("prompts: ")]
    assert [t.split()[1] for t in titles] == ["prompts.jsonl", "mtbench.jsonl", "unknown"]
    assert "sha256 aaaaaaaaaaaa, 8 prompts" in titles[0]
    sections = text.split("prompts: ")[1:]
    assert [line.split()[:2] for line in sections[1].splitlines()[2:]] == [["new", "20"]]
    row = {tuple(line.split()[:2]): line.split() for line in text.splitlines()}
    assert row[("base", "20")][-3] == "=" and row[("new", "30")][-3] == "≠template_kwargs"
    assert row[("new", "20")][-3] == "≠prompts" and row[("new", "40")][-3] == "?"


def test_compare_tau_computes_no_gap_across_unlike_settings(unlike, tmp_path):
    _, cli = unlike
    doc = json.loads(cli("--json", "compare", "base", "new", "--tau").out)["tau"]
    new = doc["runs"][1]["values"]["tau"]
    assert [new[s]["settings"] for s in ("10", "20", "30", "40")] == [
        [], ["prompts"], ["template_kwargs"], None
    ]  # fmt: skip
    text = cli("compare", "base", "new", "--tau", "--metrics", "loss").out
    tau_rows = text.split("\ntau ", 1)[1]
    line = next(x for x in tau_rows.splitlines() if x.startswith("new"))
    assert "2.2" in line and "(+10%)" in line  # equal settings: the gap
    assert "3 ≠prompts" in line and "3.1 ≠template_kwargs" in line and "3.2 ?" in line
    assert line.count("%") == 1  # and none across unlike settings

    from dflashops import plot
    from dflashops.runs.reading.view import RunView

    views = [RunView(n, "local", "runs", "/x", "finished", 0.0, {"log": {"records": []}})
             for n in ("base", "new")]  # fmt: skip
    evals = json.loads(cli("--json", "evals").out)["evals"]
    fig = plot.draw(views, ["loss"], [10, 20], tmp_path / "p.png", evals=evals)
    marks = {ln.get_label(): list(ln.get_xdata()) for ln in fig.axes[-1].get_lines()}
    assert marks["new: settings differ (prompts, template_kwargs, ?)"] == [20, 30, 40]


def test_evals_of_a_sweeps_name_shows_its_runs_with_their_swept_values(unlike):
    ws, cli = unlike
    for lr in ("3e-4", "1e-3", "1e-2"):  # as `launch lrs --sweep optim.lr=3e-4,1e-3,1e-2` makes
        run = make_run(ws, f"lrs-lr{lr}")
        state = json.loads((run / "state.json").read_text())
        state["sweep"] = {"name": "lrs", "keys": ["optim.lr"], "values": {"optim.lr": lr}}
        (run / "state.json").write_text(json.dumps(state))
    make_run(ws, "lrs-lr5e-4")  # its name, but no record of the sweep: not one of its runs
    for run, tau in (("lrs-lr3e-4", 2.1), ("lrs-lr1e-3", 2.7), ("lrs-lr5e-4", 9.9)):
        write_result(ws, run, 30, tau)

    ran = cli("--json", "evals", "lrs")
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)
    assert set(doc) == set(json.loads(cli("--json", "evals").out)) | {"sweep"}
    assert [(r["run"], r["step"], r["tau"]) for r in doc["evals"]] == [
        ("lrs-lr1e-3", 30, 2.7), ("lrs-lr3e-4", 30, 2.1)
    ]  # fmt: skip
    assert doc["sweep"] == {"name": "lrs", "keys": ["optim.lr"], "runs": [
        {"run": f"lrs-lr{lr}", "values": {"optim.lr": lr}} for lr in ("1e-2", "1e-3", "3e-4")
    ]}  # fmt: skip

    text = cli("evals", "lrs").out
    assert text.splitlines()[0] == "sweep lrs (optim.lr): 3 run(s); not evaluated: lrs-lr1e-2"
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("lrs")}
    assert set(rows) == {"lrs-lr1e-3", "lrs-lr3e-4"}
    assert rows["lrs-lr1e-3"][1:3] == ["optim.lr=1e-3", "30"]

    one = cli("--json", "evals", "lrs-lr3e-4")  # a run's name is still that run
    assert [r["run"] for r in json.loads(one.out)["evals"]] == ["lrs-lr3e-4"]
    assert "sweep" not in json.loads(one.out)
    missing = cli("evals", "lrz")
    assert missing.code == 4 and missing.out == ""
    (line,) = missing.err.strip().splitlines()
    assert line.startswith("dflashops: error: no run 'lrz' on the targets read"), line


def test_eval_with_vllm_where_the_target_has_none_is_one_line(unlike):
    ws, cli = unlike
    ran = cli("eval", "base", "--step", "10", "--on", "local", "--engine", "vllm")
    assert ran.code == 2, ran.err
    assert ran.err.strip().splitlines() == [
        "dflashops: error: no vLLM engine on local: run `dflashops setup local --engine vllm` "
        "or set engines.vllm in hosts.yaml"
    ]
    assert not (ws / "ckpts").exists() and not (ws / "evals" / "base" / "jobs").exists()
    bad = cli("eval", "base", "--step", "10", "--on", "local", "--engine", "trt")
    assert bad.code == 2 and bad.err.strip().endswith(
        "--engine trt: expected one of auto, sim, vllm"
    )


DUMP = """
import json, os, sys
facts = {k: v for k, v in os.environ.items() if k.startswith("DFLASHOPS_ALERT_")}
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({"argv": sys.argv[2:], "facts": facts}) + "\\n")
"""


def test_watch_runs_the_alert_command_with_the_facts_in_its_environment(unlike, tmp_path):
    ws, cli = unlike
    script, log = tmp_path / "dump.py", tmp_path / "alerts.jsonl"
    script.write_text(DUMP)
    command = f"{sys.executable} {script} {log} 'two words' ; touch {tmp_path / 'shell-ran'}"
    ran = cli("watch", "new", "--vs", "base", "--margin", "0.5", "--on-alert", command)
    assert ran.code == 0, ran.err  # the run has ended: one check, then done
    assert ran.out.startswith("alert: new: tau 2.2 at step 10 is within 0.5 of base's 2")
    (alert,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert alert["argv"] == ["two words", ";", "touch", str(tmp_path / "shell-ran")]
    assert not (tmp_path / "shell-ran").exists()  # no shell
    facts = alert["facts"]
    assert facts["DFLASHOPS_ALERT_RULE"] == "margin" and facts["DFLASHOPS_ALERT_STEP"] == "10"
    assert float(facts["DFLASHOPS_ALERT_VALUE"]) == 2.2
    assert float(facts["DFLASHOPS_ALERT_BASELINE_VALUE"]) == 2.0
    assert facts["DFLASHOPS_ALERT_RUN"] == "new" and facts["DFLASHOPS_ALERT_BASELINE"] == "base"
    assert "base's 2" in facts["DFLASHOPS_ALERT_MESSAGE"]  # quotes as they are
    ahead = cli("watch", "new", "--vs", "base", "--margin", "0.1", "--once", "--on-alert", command)
    assert ahead.code == 0 and ahead.out == "" and len(log.read_text().splitlines()) == 1

    make_run(ws, "flat", [{"step": s, "acc": a} for s, a in ((10, .5), (20, .6), (30, .55),
                                                            (40, .58))])  # fmt: skip
    stalled = json.loads(cli("--json", "watch", "flat", "--metric", "acc", "--stall", "2",
                             "--once", "--on-alert", command).out)  # fmt: skip
    assert [(a["rule"], a["step"]) for a in stalled["alerts"]] == [("stall", 40)]
    last = json.loads(log.read_text().splitlines()[-1])["facts"]
    assert last["DFLASHOPS_ALERT_RULE"] == "stall" and last["DFLASHOPS_ALERT_STALL"] == "2"


def test_bad_alarm_requests_are_one_line(unlike):
    _, cli = unlike
    for args, says in (
        (["--margin", "0.1"], "--margin needs --vs BASELINE"),
        ([], "give a rule: --vs BASELINE --margin X, or --stall K"),
        (["--stall", "0"], "--stall 0: a number of values, >= 1"),
        (["--stall", "2", "--on-alert", "no-such-program-x"], "no-such-program-x: no such program"),
        (["--stall", "2", "--on-alert", "'unclosed"], "No closing quotation"),
    ):
        ran = cli("watch", "new", *args)
        assert ran.code == 2 and len(ran.err.strip().splitlines()) == 1, (args, ran.err)
        assert says in ran.err, (args, ran.err)
