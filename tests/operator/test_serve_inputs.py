"""`eval --serve`'s refusals, before anything connects or starts: one line each, exit 2."""

from __future__ import annotations

import sys

import pytest

from tests.operator.cli import dflashops


@pytest.fixture
def inv(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {tmp_path / 'ws'}, python: {sys.executable}}}\n"
    )
    return path


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--steps", "2,4", "--serve"], "--serve: one checkpoint at a time; give --step N"),
        (["--step", "2", "--concurrency", "4"], "--concurrency: only with --serve"),
        (["--step", "2", "--vs", "r:2"], "--vs: only with --serve"),
        (["--step", "2", "--serve", "--concurrency", "0,4"], "--concurrency 0,4: expected"),
        (["--step", "2", "--serve", "--concurrency", "a"], "--concurrency a: expected"),
        (["--step", "2", "--serve", "--vs", "other"], "--vs other: expected RUN:STEP"),
        (["--step", "2", "--serve", "--reference", "/x"], "--serve: --reference belong"),
        (["--step", "2", "--serve", "--engine", "sim"], "--serve: --engine sim belong"),
        (["--step", "2", "--vs-engine", "vllm-2"], "--vs-engine: only with --serve"),
        (
            ["--step", "2", "--serve", "--vs", "r:2", "--vs-engine", "vllm-2"],
            "--vs and --vs-engine: give one",
        ),
        (
            ["--step", "2", "--serve-chat-template-kwargs", "{}"],
            "--serve-chat-template-kwargs: only with --serve",
        ),
        (
            ["--step", "2", "--serve", "--serve-chat-template-kwargs", "{bad"],
            "--serve-chat-template-kwargs {bad: not JSON (",
        ),
        (
            ["--step", "2", "--serve", "--serve-chat-template", "nope.jinja"],
            "--serve-chat-template nope.jinja: no such file here",
        ),
    ],
)
def test_bad_serve_options_are_one_line(inv, tmp_path, args, said):
    ran = dflashops("eval", "sv", "--on", "local", *args, inventory=inv, home=tmp_path)
    assert ran.code == 2, ran.err
    assert said in ran.err
    assert "Traceback" not in ran.err and len(ran.err.strip().splitlines()) == 1


def test_a_second_engine_the_target_does_not_have_is_one_line(tmp_path):
    """--vs-engine names an `engines:` entry of the eval target (ENGINE-LABEL) or a python there;
    refused before anything starts, naming the environments it has."""
    ws = tmp_path / "ws"
    inv = tmp_path / "hosts.yaml"
    inv.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {sys.executable}, engines: "
        f"{{vllm: {sys.executable}, vllm-0.31: {sys.executable}}}}}\n"
    )
    for name, said in (
        ("vllm-0.30", "--vs-engine vllm-0.30: local has no engine environment of that name "
                      "(hosts.yaml engines: vllm, vllm-0.31)"),
        ("/no/such/python", "--vs-engine /no/such/python: /no/such/python is not on local"),
    ):  # fmt: skip
        ran = dflashops("eval", "sv", "--on", "local", "--step", "2", "--serve", "--vs-engine",
                        name, inventory=inv, home=tmp_path)  # fmt: skip
        assert ran.code == 2, ran.err
        (line,) = ran.err.strip().splitlines()
        assert line.startswith(f"dflashops: error: {said}"), line
    assert not ws.exists() or not any(ws.rglob("*.json"))
    bad = inv.read_text().replace("vllm-0.31", "trt-1")
    inv.write_text(bad)
    ran = dflashops("hosts", inventory=inv, home=tmp_path)
    assert ran.code == 2 and "engines.trt-1: not an engine we run" in ran.err, ran.err


def serving_result(speedups: dict[str, float]) -> dict:
    """A stored serving result as workload.serve_bench writes it (the keys the readers use)."""
    part = {"output_tokens_per_s": 100.0, "ttft_ms": {"p50": 1.0, "p99": 2.0},
            "tpot_ms": {"p50": 1.0, "p99": 2.0}}  # fmt: skip
    fingerprint = {"prompts_sha256": "ab" * 32, "max_new_tokens": 64, "block_size": 8,
                   "engine": {"name": "vllm", "version": "0.32.0"}, "concurrency": [1, 16]}  # fmt: skip
    return {
        "tau": 3.0, "per_position": [0.7], "n_prompts": 24, "max_new_tokens": 64,
        "engine": {"name": "vllm", "version": "0.32.0"}, "fingerprint": fingerprint,
        "prompt_set": {"name": "prompts", "n_prompts": 24},
        "serve": {c: {"spec": {**part, "output_tokens_per_s": 100.0 * x}, "plain": part,
                      "speedup": x} for c, x in speedups.items()},
    }  # fmt: skip


def test_evals_shows_the_speedup_and_watch_alarms_on_it(inv, tmp_path):
    import json

    from tests.operator.rundirs import make_run

    make_run(tmp_path / "ws", "sv", ckpts=(100, 200))
    evals = tmp_path / "ws" / "evals" / "sv"
    evals.mkdir(parents=True)
    (evals / "serve_100.json").write_text(json.dumps(serving_result({"1": 1.5, "16": 2.4})))
    (evals / "serve_200.json").write_text(json.dumps(serving_result({"1": 1.6, "16": 2.1})))
    listed = dflashops("evals", "sv", inventory=inv, home=tmp_path)
    assert listed.code == 0, listed.err
    row = next(line for line in listed.out.splitlines() if line.split()[:2] == ["sv", "200"])
    assert "1.60/2.10x @1,16" in row and "vllm 0.32.0 serve" in row
    doc = json.loads(dflashops("--json", "evals", "sv", inventory=inv, home=tmp_path).out)
    assert [r["serve"]["16"]["speedup"] for r in doc["evals"]] == [2.4, 2.1]
    watched = dflashops("watch", "sv", "--metric", "speedup@16", "--stall", "1", "--once",
                        inventory=inv, home=tmp_path)  # fmt: skip
    assert watched.code == 0, watched.err
    assert "alert: sv: speedup@16 has not risen over the last 1 values" in watched.out


def test_compare_tables_and_draws_the_speedup_per_concurrency(inv, tmp_path):
    import json

    from dflashops import plot
    from dflashops.runs.reading.view import RunView
    from tests.operator.rundirs import make_run

    for run, (early, late) in (("sa", (1.2, 1.5)), ("sb", (1.4, 1.8))):
        make_run(tmp_path / "ws", run, [{"step": s, "loss": 1 / s} for s in (100, 200)])
        evals = tmp_path / "ws" / "evals" / run
        evals.mkdir(parents=True)
        for step, x in ((100, early), (200, late)):
            result = serving_result({"1": x - 0.1, "16": x})
            (evals / f"serve_{step}.json").write_text(json.dumps(result))
    other = serving_result({"1": 9.0, "16": 9.0})
    other["fingerprint"]["max_new_tokens"] = 128  # measured otherwise: marked, no gap
    (tmp_path / "ws" / "evals" / "sb" / "serve_100.json").write_text(json.dumps(other))

    ran = dflashops("--json", "compare", "sa", "sb", "--tau", inventory=inv, home=tmp_path)
    assert ran.code == 0, ran.err
    doc = json.loads(ran.out)["tau"]
    assert {"speedup@1", "speedup@16"} <= set(doc["metrics"]) and doc["steps"] == [100, 200]
    sb = doc["runs"][1]["values"]["speedup@16"]
    assert sb["200"]["value"] == 1.8 and sb["200"]["settings"] == []
    assert sb["100"]["settings"] == ["max_new_tokens"]
    text = dflashops("compare", "sa", "sb", "--tau", "--metrics", "loss", inventory=inv,
                     home=tmp_path).out  # fmt: skip
    table = text.split("\nspeedup@16 ", 1)[1]
    line = next(x for x in table.splitlines() if x.startswith("sb"))
    assert "9 ≠max_new_tokens" in line and "1.8" in line and "(+20%)" in line

    views = [RunView(n, "local", "runs", "/x", "finished", 0.0, {"log": {"records": []}})
             for n in ("sa", "sb")]  # fmt: skip
    serves = json.loads(dflashops("--json", "evals", inventory=inv, home=tmp_path).out)["evals"]
    fig = plot.draw(views, ["loss"], [100, 200], tmp_path / "p.png", serves=serves)
    panel = fig.axes[-1]
    assert panel.get_ylabel() == "speedup (serve)"
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in panel.get_lines()}
    assert lines["sa @16"] == [1.2, 1.5] and lines["sa @1"] == pytest.approx([1.1, 1.4])
