"""What decides a τ and what it is measured on: benchmark prompt files (JSONL, parquet), the
fingerprint on every result, and how vLLM's per-step counts become rounds. No vLLM needed."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.workload.test_eval import _eval, _one_line_error, run_dir  # noqa: F401  (a fixture)
from workload.eval import evaluate as ev
from workload.eval import prompts as pr
from workload.eval import run_settings
from workload.eval.decode import Round
from workload.eval.vllm_offline import engine_rounds, first_difference, last_error

pytestmark = pytest.mark.usefixtures("one_thread")

GSM8K = [
    {"question": "Count from 3 to 8.", "answer": "3 4 5 6 7 8 #### 8"},
    {"question": "Count from 10 to 14.", "answer": "10 11 12 13 14 #### 14"},
]
MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Count from 1 to 5.", "Now backwards."]},
    {"question_id": 82, "category": "writing", "turns": ["Count from 7 to 9.", "Again."]},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    """Columns of every row's keys (a row without one holds null there); parquet has no empty
    struct, so {} values are left out (a record's {} kwargs are no kwargs)."""
    rows = [{k: v for k, v in r.items() if v != {}} for r in rows]
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path)
    return path


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_gsm8k_and_mt_bench_files_are_read(tmp_path, write):
    ext = "jsonl" if write is _jsonl else "parquet"
    gsm = pr.read_prompt_set(write(tmp_path / f"test.{ext}", GSM8K))
    assert (gsm.kind, gsm.format, len(gsm.items)) == ("gsm8k", ext, 2)
    first = gsm.items[0]["messages"]
    assert first == [{"role": "user", "content": "Count from 3 to 8." + pr.REASON}]
    assert gsm.items[1]["where"] == f"{tmp_path / f'test.{ext}'}:2"
    mt = pr.read_prompt_set(write(tmp_path / f"question.{ext}", MT_BENCH))
    assert mt.kind == "mt-bench"
    assert [i["messages"] for i in mt.items] == [  # the first turn only
        [{"role": "user", "content": "Count from 1 to 5."}],
        [{"role": "user", "content": "Count from 7 to 9."}],
    ]
    assert mt.describe()["name"] == "question" and mt.describe()["n_prompts"] == 2


def test_each_benchmark_shape_has_its_kind(tmp_path):
    shapes = {
        "math500": {"problem": "What is 2+2?", "solution": "4", "answer": "4"},
        "humaneval": {"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"},
        "mbpp": {"task_id": 2, "text": "Write a function.", "test_list": ["assert f()"]},
        "chat": {"prompt": "plain text"},
    }
    for kind, row in shapes.items():
        got = pr.read_prompt_set(_jsonl(tmp_path / f"{kind}.jsonl", [row]))
        assert got.kind == kind
    humaneval = pr.read_prompt_set(tmp_path / "humaneval.jsonl").items[0]["messages"][0]
    assert (
        humaneval["content"].startswith("Write a solution") and "def f():" in humaneval["content"]
    )
    assert pr.read_prompt_set(tmp_path / "chat.jsonl").items[0]["prompt"] == "plain text"
    # Hugging Face's MT-Bench: `prompt` is the list of turns
    hf = _parquet(tmp_path / "mt.parquet", [{"prompt": ["Hi there.", "More."], "category": "x"}])
    assert pr.read_prompt_set(hf).items[0]["messages"][0]["content"] == "Hi there."


@pytest.mark.parametrize(
    ("rows", "bad"),
    [
        ([GSM8K[0], {"answer": "no question"}], 2),  # a GSM8K file whose line 2 has no question
        ([MT_BENCH[0], {"turns": []}], 2),
        ([{"nothing": "known"}], 1),
    ],
)
@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_a_malformed_benchmark_file_is_one_line_naming_file_line(
    run_dir,  # noqa: F811
    capsys,
    tmp_path,
    write,
    rows,
    bad,
):
    path = write(tmp_path / ("p.jsonl" if write is _jsonl else "p.parquet"), rows)
    err = _one_line_error(*_eval(capsys, run_dir, "--prompts", str(path))[:3])
    assert f"{path}:{bad}:" in err


def test_a_file_that_is_not_parquet_is_one_line(run_dir, capsys, tmp_path):  # noqa: F811
    path = tmp_path / "broken.parquet"
    path.write_text('{"question": "not parquet"}\n')
    err = _one_line_error(*_eval(capsys, run_dir, "--prompts", str(path))[:3])
    assert str(path) in err and "parquet" in err


# ----------------------------------------------------------------------------- fingerprints


def _sim(capsys, run_dir, *extra):  # noqa: F811
    rc, _, err, result = _eval(
        capsys, run_dir, "--max-prompts", "2", "--max-new-tokens", "8", "--budgets", "8", *extra
    )
    assert rc == 0, err
    return result


def test_fingerprints_equal_for_equal_settings_and_differ_with_prompts_or_kwargs(
    run_dir,  # noqa: F811
    capsys,
    tmp_path,
):
    a, b = _sim(capsys, run_dir), _sim(capsys, run_dir)
    assert a["engine"]["name"] == "sim" and "transformers" in a["engine"]["version"]
    fp = a["fingerprint"]
    assert set(fp) >= {
        "prompts_sha256",
        "chat_template_sha256",
        "chat_template_kwargs",
        "temperature",
        "max_new_tokens",
        "block_size",
        "target",
        "engine",
    }
    assert fp["temperature"] == 0.0 and fp["max_new_tokens"] == 8 and fp["block_size"] == 8
    assert fp["target"]["path"] == str((run_dir / "target").resolve()) and fp["target"]["digest"]
    assert fp["engine"] == a["engine"] and fp["chat_template_kwargs"] == {}
    assert a["fingerprint"] == b["fingerprint"]
    assert a["checkpoint_sha256"] == b["checkpoint_sha256"] and len(a["checkpoint_sha256"]) == 64
    assert a["prompt_set"]["kind"] == "chat" and a["prompt_set"]["format"] == "jsonl"
    # the same prompts as parquet: the same fingerprint; other prompts: another
    rows = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    same = _parquet(tmp_path / "same.parquet", rows)
    c = _sim(capsys, run_dir, "--prompts", str(same))
    assert c["fingerprint"] == a["fingerprint"] and c["prompt_set"]["format"] == "parquet"
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "Count from 4 to 9."}, rows[0]])
    d = _sim(capsys, run_dir, "--prompts", str(other))
    assert d["fingerprint"]["prompts_sha256"] != a["fingerprint"]["prompts_sha256"]
    # chat template kwargs: rendered with them, and recorded
    e = _sim(capsys, run_dir, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert e["fingerprint"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert e["fingerprint"] != a["fingerprint"]
    assert {k: v for k, v in e["fingerprint"].items() if k != "chat_template_kwargs"} == {
        k: v for k, v in a["fingerprint"].items() if k != "chat_template_kwargs"
    }


def test_chat_template_kwargs_from_the_run_config_reach_the_template(run_dir, capsys, tmp_path):  # noqa: F811
    """The run's data.chat_template_kwargs are rendered with: a template that prints them
    makes the prompts longer, and the fingerprint records them."""
    from workload.config import DataConfig

    if "chat_template_kwargs" not in DataConfig.__dataclass_fields__:
        pytest.skip("workload.config has no data.chat_template_kwargs yet (it refuses the key)")
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if extra %}{{ extra }}{% endif %}<|im_start|>assistant\n"
    )
    configs = {}
    for name, kwargs in (
        ("plain", ""),
        ("kwargs", ", chat_template_kwargs: {extra: ' MORE WORDS'}"),
    ):
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(
            f"target: {{path: {run_dir / 'target'}}}\n"
            f"data: {{path: {run_dir / 'data.jsonl'}, max_length: 128, "
            f"chat_template: {template}{kwargs}}}\n"
        )
    a = _sim(capsys, run_dir, "--config", str(configs["plain"]))
    b = _sim(capsys, run_dir, "--config", str(configs["kwargs"]))
    assert a["fingerprint"]["chat_template_kwargs"] == {}
    assert b["fingerprint"]["chat_template_kwargs"] == {"extra": " MORE WORDS"}
    assert b["prompts"][0]["prompt_tokens"] > a["prompts"][0]["prompt_tokens"]


def test_the_kwargs_key_is_read_from_the_yaml_where_the_config_lacks_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: {chat_template_kwargs: {enable_thinking: false}}\n")
    bare = SimpleNamespace(data=SimpleNamespace())
    assert run_settings.config_kwargs(bare, path) == {"enable_thinking": False}
    path.write_text("data: {path: x}\n")
    assert run_settings.config_kwargs(bare, path) == {}
    path.write_text("data: {chat_template_kwargs: [1]}\n")
    with pytest.raises(ev.EvalError, match="data.chat_template_kwargs: expected a mapping"):
        run_settings.config_kwargs(bare, path)


def test_bad_chat_template_kwargs_are_one_line(run_dir, capsys):  # noqa: F811
    err = _one_line_error(*_eval(capsys, run_dir, "--chat-template-kwargs", "[1, 2]")[:3])
    assert "--chat-template-kwargs" in err and "JSON object" in err
    err = _one_line_error(*_eval(capsys, run_dir, "--chat-template-kwargs", "{nope")[:3])
    assert "not valid JSON" in err


# ----------------------------------------------------------------------------- counting


def test_engine_steps_become_rounds_cut_at_the_stop_and_the_limit():
    # 12 new tokens after a 5-token prompt, block 4: the prompt pass gives token 1; steps
    # accept 3, 0, 2, 3 (past the end: cut to the 2 tokens left) -> rounds 4, 1, 3, 2
    rounds, left = engine_rounds(list(range(11)), [3, 0, 2, 3, 3], 5, 64, 4)
    assert [r.produced for r in rounds] == [4, 1, 3, 2] and left == 0
    assert [r.accepted for r in rounds] == [3, 0, 2, 2]
    assert [r.start for r in rounds] == [5, 9, 10, 13]
    # at the length limit the block shrinks as the simulation's does
    rounds, _ = engine_rounds(list(range(8)), [3, 3, 3], 5, 8, 4)
    assert [(r.size, r.accepted, r.produced) for r in rounds] == [(4, 3, 4), (4, 3, 3)]
    # steps that do not cover the output leave tokens unaccounted
    assert engine_rounds(list(range(10)), [1], 5, 64, 4)[1] == 7


def test_first_difference_is_the_first_round_that_parts():
    a = [Round(5, 4, 3, 4), Round(9, 4, 1, 2), Round(11, 4, 0, 1)]
    b = [Round(5, 4, 3, 4), Round(9, 4, 2, 3)]
    assert first_difference(a, b) == 1 and first_difference(a, a) is None
    assert first_difference(a, a[:2]) == 2


def test_the_engine_error_line_is_the_exception_with_its_message():
    lines = ["INFO starting\n", "Traceback (most recent call last):\n", '  File "x.py"\n',
             "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n",
             "  Value error, needs speculative decoding\n",
             "    For further information visit https://errors.pydantic.dev\n"]  # fmt: skip
    assert last_error(lines) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig: "
        "Value error, needs speculative decoding"
    )
    assert last_error(["just a line\n"]) == "just a line"


def test_a_python_without_vllm_fails_in_one_line_with_its_log(run_dir, tmp_path):  # noqa: F811
    """The engines' process dies (here: no vllm in that python): exit 1, one line that says
    why and where all it printed is kept; never a traceback."""
    out = tmp_path / "r.json"
    argv = [sys.executable, "-m", "workload.eval", "--config", str(run_dir / "run.yaml"),
            "--checkpoint", str(run_dir / "checkpoints" / "step_5"), "--max-new-tokens", "4",
            "--engine", "vllm", "--vllm-python", sys.executable, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == "" and not out.exists()
    lines = [x for x in proc.stderr.splitlines() if x.startswith("eval: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "No module named 'vllm'" in lines[0]
    log = out.with_name("r.json.vllm.log")
    assert str(log) in lines[0] and "Traceback" in log.read_text()
    missing = subprocess.run([*argv[:-4], "--vllm-python", str(tmp_path / "nope"), "--out", str(out)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert missing.returncode == 2
    assert (
        missing.stderr.strip()
        == f"eval: error: --vllm-python {tmp_path / 'nope'}: no such executable"
    )


# ----------------------------------------------------------------------------- vLLM's report


def test_the_vllm_result_names_the_first_departure_and_the_greedy_misses(
    run_dir,  # noqa: F811
    capsys,
    monkeypatch,
):
    """`eval --engine vllm` with the engines' process replaced by a stand-in that returns what
    vLLM would (Hugging Face's greedy output, the simulation's accepted counts) except for one
    pair of rounds of prompt 1, merged into one, and one token of prompt 2's speculative output: the result
    says where the rounds part (and the draft there) and which output is not greedy."""
    import torch

    from workload.drafter.targets import load_target
    from workload.eval import vllm_offline as eval_vllm
    from workload.eval.decode import greedy_continuation

    rc, _, err, sim = _eval(capsys, run_dir, "--budgets", "8")
    assert rc == 0, err
    accepted = [p["checkpoint"]["accepted"] for p in sim["prompts"]]
    a = accepted[1]
    split = next(r for r in range(len(a) - 2) if a[r] + a[r + 1] + 1 < 8)  # not the last round
    merged = a[split] + a[split + 1] + 1
    tampered = [*a[:split], merged, *a[split + 2 :]]

    def engines(python, request, timeout, log):
        target, _ = load_target(run_dir / "target")
        with torch.inference_mode():
            plain = [greedy_continuation(target, p, request["max_new_tokens"], request["stop_ids"])
                     for p in request["prompts"]]  # fmt: skip
        spec = [list(t) for t in plain]
        spec[2][-1] = (spec[2][-1] + 1) % 100

        def engine(outputs, steps):  # fmt: skip
            return {"start_s": 1.0, "generate_s": 2.0, "tokens": sum(map(len, outputs)),
                    "dtype": "float32", "pooled": {"drafts": 10, "draft_tokens": 70,
                    "accepted_tokens": 25, "accepted_per_position": [9, 7, 5, 2, 1, 1, 0]},
                    "outputs": [{"tokens": t, "per_step_accepted": s, "per_step_drafted": []}
                                for t, s in zip(outputs, steps, strict=True)]}  # fmt: skip

        steps = [accepted[0], tampered, accepted[2]]
        return {"version": "0.0-test", "device": "cpu", "dtype": "float32",
                "engines": {"plain": engine(plain, [[]] * 3), "checkpoint": engine(spec, steps)}}  # fmt: skip

    monkeypatch.setattr(eval_vllm, "run_engines", engines)
    rc, out, err, r = _eval(capsys, run_dir, "--budgets", "8", "--engine", "vllm",
                            "--vllm-python", sys.executable)  # fmt: skip
    assert rc == 0 and out == "", err
    assert r["engine"] == {"name": "vllm", "version": "0.0-test"}
    s = r["simulation"]
    assert (s["prompts"], s["prompts_identical"]) == (3, 2)
    first = s["first_difference"]
    assert first == s["differences"][0] and first["prompt"] == 1 and first["round"] == split
    assert first["where"] == r["prompts"][1]["where"]
    assert first["vllm"] == {"accepted": merged, "produced": merged + 1}
    assert first["simulation"] == {"accepted": a[split], "produced": a[split] + 1}
    draft = first["draft"]
    assert draft["slot"] == a[split] + 1  # the slot the simulation did not accept
    assert draft["label"] != draft["top_tokens"][0]  # its best token was not the target's
    assert draft["gap"] >= 0 and len(draft["top_logits"]) == 2
    assert r["prompts"][1]["checkpoint"]["rounds_identical"] is False
    assert sum(r["prompts"][1]["checkpoint"]["rounds"]) == r["prompts"][1]["new_tokens"] - 1
    g = r["greedy"]
    assert (g["prompts"], g["equal"]) == (3, 2) and [d["prompt"] for d in g["differ"]] == [2]
    assert g["differ"][0]["where"] == r["prompts"][2]["where"]
    assert r["speedup"] == pytest.approx(1.0)  # equal token counts in equal times
    assert r["engine_mean_acceptance_length"] == pytest.approx(3.5)
    assert r["simulation"]["tau"] == pytest.approx(sim["tau"])
    assert r["ddtree"] == sim["ddtree"]  # the simulation on the same continuation
    assert "rounds as simulated on 2/3 prompts" in err and "output equals greedy on 2/3" in err
