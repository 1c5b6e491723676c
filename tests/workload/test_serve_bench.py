"""The serving benchmark's side-by-side (workload/eval/serve.py): the difference of two results
only where their fingerprints agree, and otherwise what differs, named with both values; and its
own inputs refused in one line. (The benchmark itself, servers and all: tests/operator/test_serve.py.)"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.workload.conftest import WORKLOAD
from tests.workload.drafters import STEPS, trained_drafter
from tests.workload.test_parity import THINKING
from workload.eval import serve
from workload.eval.errors import EvalError
from workload.eval.inputs import parity_check
from workload.eval.serve import attach_vs, bucket_of

# vLLM's own server parser and checks, given the server's argv: what it makes of our chat options
PARSED = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(a)  # the server's own checks before it loads (the template's)
print(json.dumps({"chat_template": a.chat_template, "kwargs": a.default_chat_template_kwargs}))
"""


def result(tokens_per_s: float, tau: float, prompts: str = "p1") -> dict:
    part = {"output_tokens_per_s": tokens_per_s, "ttft_ms": {"p50": 10.0, "p99": 20.0},
            "tpot_ms": {"p50": 5.0, "p99": 9.0}}  # fmt: skip
    plain = {**part, "output_tokens_per_s": 100.0}
    return {
        "checkpoint": "/ws/ckpts/r/step_2",
        "checkpoint_sha256": "abc",
        "fingerprint": {"prompts_sha256": prompts, "max_new_tokens": 64, "concurrency": [1, 4]},
        "serve": {
            c: {"spec": part, "plain": plain, "speedup": tokens_per_s / 100.0} for c in ("1", "4")
        },  # fmt: skip
        "tau": tau,
        "per_position": [0.8, 0.5],
        "tau_by_category": {"gsm8k": tau},
        "tau_by_length": {"<1k": tau},
    }


def test_two_drafters_on_the_same_prompts_show_both_and_their_difference():
    mine, other = result(250.0, 3.0), result(200.0, 2.5)
    attach_vs(mine, copy.deepcopy(other))
    assert mine["vs"]["tau"] == 2.5 and mine["vs"]["serve"]["4"]["speedup"] == 2.0
    diff = mine["diff"]
    assert diff["tau"] == pytest.approx(0.5)
    assert diff["serve"]["4"]["speedup"] == pytest.approx(0.5)
    assert diff["serve"]["1"]["output_tokens_per_s"] == pytest.approx(50.0)
    assert diff["tau_by_category"] == {"gsm8k": pytest.approx(0.5)}
    assert "diff_refused" not in mine


def test_an_ab_whose_prompts_differ_computes_no_difference_and_says_why():
    mine, other = result(250.0, 3.0), result(200.0, 2.5, prompts="p2")
    attach_vs(mine, other)
    assert "diff" not in mine and mine["vs"]["tau"] == 2.5
    assert mine["diff_refused"] == ['prompts_sha256: "p1" vs "p2"']


def test_one_drafter_in_two_engines_differs_only_in_the_engine():
    """--vs-vllm-python: the engine is what is compared; its version may differ, nothing else."""
    mine, other = result(250.0, 3.0), result(200.0, 2.5)
    mine["fingerprint"]["engine"] = {"name": "vllm", "version": "0.32.0"}
    other["fingerprint"]["engine"] = {"name": "vllm", "version": "0.31.1"}
    attach_vs(mine, copy.deepcopy(other), "engine")
    assert mine["vs_axis"] == "engine" and mine["diff"]["tau"] == pytest.approx(0.5)
    drafters = result(250.0, 3.0)
    drafters["fingerprint"]["engine"] = mine["fingerprint"]["engine"]
    attach_vs(drafters, copy.deepcopy(other))  # two drafters: the engines must agree
    assert drafters["diff_refused"] == [
        'engine: {"name": "vllm", "version": "0.32.0"} vs {"name": "vllm", "version": "0.31.1"}'
    ]
    other["fingerprint"]["max_new_tokens"] = 128
    attach_vs(mine, other, "engine")
    assert "diff" not in mine and mine["diff_refused"] == ["max_new_tokens: 64 vs 128"]


def test_length_buckets():
    assert [bucket_of(n) for n in (10, 1023, 1024, 4095, 4096, 16384)] == [
        "<1k", "<1k", "1-4k", "1-4k", "4-16k", ">16k"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--concurrency", "0"], "--concurrency 0: expected numbers >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--vs", "/x", "--vs-vllm-python", "/y"], "--vs and --vs-vllm-python: give one"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, said):
    argv = [sys.executable, "-m", "workload.serve_bench", "--config", str(tmp_path / "run.yaml"),
            "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o.json"), *args]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=WORKLOAD.parent)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_what_is_benchmarked_is_what_is_checked(tiny_dense, vllm_python, tmp_path):
    """--serve-chat-template(-kwargs): the server is started with them, in the words vLLM's own
    parser reads; the prompts are rendered with them; and the parity check compares them with
    training's (the tiny run trains on its tokenizer's template: refused)."""
    ckpt = trained_drafter(tiny_dense) / "checkpoints" / f"step_{STEPS}"
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    args = serve.parse_args(["--config", str(tiny_dense / "run.yaml"), "--checkpoint", str(ckpt),
                             "--out", str(tmp_path / "o.json"), "--vllm-python", vllm_python,
                             "--max-prompts", "2", "--serve-chat-template", str(template),
                             "--serve-chat-template-kwargs", '{"enable_thinking": false}'])  # fmt: skip
    bench = serve.Bench(args)
    assert bench.tokenizer.decode(bench.ids[0]).endswith("<think>\n\n</think>\n\n")
    argv = serve.server_argv(bench, bench.subjects[0], 8000)
    done = subprocess.run([vllm_python, "-c", PARSED, *argv[3:]], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {"chat_template": str(template), "kwargs": {"enable_thinking": False}}
    with pytest.raises(EvalError, match="parity: chat template: training renders with {} "):
        parity_check(args)
