"""The serving benchmark's side-by-side (workload/eval/serve.py): the difference of two results
only where their fingerprints agree (the hardware included), and otherwise what differs, named
with both values; the mean and spread of --repeat; the server's argv without prefix caching; the
warning of fewer prompts than the concurrency; the prompts' overlap with the training data; and
its own inputs refused in one line. None starts a server. (The benchmark itself, servers and all:
tests/operator/test_serve.py.)"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.workload.conftest import FIXTURE_BUILDS, cached_tiny
from tests.workload.drafters import STEPS, trained_drafter
from tests.workload.test_parity import THINKING
from workload.eval import serve
from workload.eval.errors import EvalError
from workload.eval.inputs import parity_check
from workload.eval.overlap import training_overlap
from workload.eval.serve import (
    Subject,
    attach_vs,
    bucket_of,
    few_prompts,
    main,
    passes_of,
    serve_table,
    server_argv,
)

H100 = {"device": "gpu", "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "driver": "550.54.15",
        "cuda": "12.8"}  # fmt: skip
H200 = {**H100, "gpu": "NVIDIA H200"}  # a stored result's stand-in: no GPU needed

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
        "fingerprint": {
            "prompts_sha256": prompts,
            "max_new_tokens": 64,
            "concurrency": [1, 4],
            "hardware": H100,
        },  # fmt: skip
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


def test_a_result_on_other_hardware_is_beside_not_differenced():
    """An H200 result against an H100 one: shown side by side, no difference, the hardware named
    with both values; a stored result from before the hardware was kept is not differenced
    either. On the engine axis the environment's CUDA may differ, the GPU may not."""
    mine, other = result(250.0, 3.0), result(200.0, 2.5)
    other["fingerprint"]["hardware"] = H200
    attach_vs(mine, copy.deepcopy(other))
    assert "diff" not in mine and mine["vs"]["serve"]["4"]["speedup"] == 2.0
    assert mine["diff_refused"] == [f"hardware: {json.dumps(H100)} vs {json.dumps(H200)}"]
    del other["fingerprint"]["hardware"]
    attach_vs(mine, copy.deepcopy(other))
    assert mine["diff_refused"] == [f"hardware: {json.dumps(H100)} vs null"]
    other["fingerprint"]["hardware"] = {**H100, "cuda": "12.6"}
    attach_vs(mine, copy.deepcopy(other), "engine")
    assert "diff_refused" not in mine and mine["diff"]["tau"] == pytest.approx(0.5)
    attach_vs(mine, copy.deepcopy(other))  # two drafters: one engine, one CUDA
    assert mine["diff_refused"] == [f"hardware: {json.dumps(H100)} vs "
                                     f"{json.dumps(other['fingerprint']['hardware'])}"]  # fmt: skip
    other["fingerprint"]["hardware"] = {**H200, "cuda": "12.6"}
    attach_vs(mine, other, "engine")
    assert "diff" not in mine and mine["diff_refused"][0].startswith("hardware: ")


def client_pass(rate: float, ttft: float) -> dict:
    """One pass as the benchmark client reports it (the keys `figures` reads)."""
    return {"output_throughput": rate, "p50_ttft_ms": ttft, "p99_ttft_ms": ttft + 1,
            "p50_tpot_ms": 2.0, "p99_tpot_ms": 3.0, "completed": 6, "total_output_tokens": 384,
            "duration": 1.0, "spec_decode_num_drafts": 10,
            "spec_decode_accepted_tokens": 20}  # fmt: skip


def test_repeats_give_the_mean_and_the_spread():
    bench = SimpleNamespace(levels=[1, 4], args=SimpleNamespace(repeat=2))
    spec = Subject("checkpoint", Path("/d"), "python")
    plain = Subject("plain", None, "python")
    spec.passes = {"c1": client_pass(300.0, 10.0), "c1.2": client_pass(200.0, 12.0),
                   "c4": client_pass(400.0, 20.0), "c4.2": client_pass(400.0, 20.0)}  # fmt: skip
    plain.passes = {n: client_pass(100.0, 8.0) for n in spec.passes}
    table = serve_table(bench, spec, plain)
    one = table["1"]
    assert one["repeats"] == 2 and one["speedup"] == pytest.approx(2.5)
    assert one["spread"]["speedup"] == pytest.approx(0.7071, abs=1e-3)
    assert one["spec"]["output_tokens_per_s"] == pytest.approx(250.0)
    assert one["spec"]["ttft_ms"]["p50"] == pytest.approx(11.0)
    assert [r["spec"]["ttft_ms"]["p50"] for r in one["by_repeat"]] == [10.0, 12.0]
    assert one["spec"]["requests"] == 6 and one["spec"]["tau"] == 3.0
    assert table["4"]["spread"]["spec"]["output_tokens_per_s"] == 0.0
    bench.args.repeat = 1
    single = serve_table(bench, spec, plain)["1"]
    assert single["repeats"] == 1 and single["speedup"] == 3.0 and "spread" not in single
    bench.args.repeat, bench.prompts = 2, ["p0", "p1"]
    bench.groups = lambda: {("chat", "<1k"): [0, 1]}
    sent = [(p["name"], p["concurrency"], p["warmups"]) for p in passes_of(bench, spec)]
    assert sent == [("c1", 1, 1), ("c4", 4, 1), ("c1.2", 1, 0), ("c4.2", 4, 0)]


def test_the_servers_run_without_prefix_caching():
    """False is said to vLLM (--no-NAME), not dropped: its own default keeps prefix caching on."""
    args = {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False}
    bench = SimpleNamespace(settings=SimpleNamespace(target_path=Path("/t")), kwargs={},
                            args=SimpleNamespace(serve_chat_template=None),
                            server_args=lambda: args)  # fmt: skip
    argv = server_argv(bench, Subject("plain", None, "python"), 8000)
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    args["enable_prefix_caching"] = True  # --vllm-arg enable_prefix_caching=true
    assert "--enable-prefix-caching" in server_argv(bench, Subject("plain", None, "python"), 8000)


def test_fewer_prompts_than_the_highest_concurrency_is_warned():
    assert few_prompts(16, [1, 4, 16]) == []
    (line,) = few_prompts(6, [1, 4, 16])
    assert line.startswith("6 prompts, fewer than the highest concurrency 16")


def test_prompts_in_the_training_data_are_counted_and_refused_above_the_limit(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "a"}]}) + "\n"
        for q in ("What is 2+2?", "Name a  colour.")))  # fmt: skip
    items = [{"messages": [{"role": "user", "content": q}], "where": f"p.jsonl:{i}"}
             for i, q in enumerate(["What is 2+2?", "Why?", "Who?", "Name a colour. "], 1)]  # fmt: skip
    with pytest.raises(EvalError, match=r"2 of 4 prompts \(50%\).*p.jsonl:1, p.jsonl:4"):
        training_overlap(items, data, force=False)
    forced = training_overlap(items, data, force=True)
    assert forced["overlapping"] == 2 and forced["forced"] and forced["where"][0] == "p.jsonl:1"
    held_out = training_overlap(items[1:3], data, force=False)
    assert held_out["overlapping"] == 0 and held_out["share"] == 0.0
    elsewhere = training_overlap(items, tmp_path / "absent.jsonl", force=False)
    assert "no such file" in elsewhere["not_checked"]  # another machine's data: said, not refused


def test_the_benchmark_refuses_trained_on_prompts_before_any_server(tmp_path):
    """The tiny build's own training questions as the serving prompts: exit 2, one line."""
    build = cached_tiny(FIXTURE_BUILDS["dense"])
    lines = (build / "data.jsonl").read_text().splitlines()[:3]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": json.loads(x)["messages"][:1]}) + "\n"
                               for x in lines))  # fmt: skip
    code, err = bench_main(["--config", str(build / "run.yaml"), "--checkpoint", str(tmp_path),
                            "--prompts", str(prompts), "--vllm-python", sys.executable,
                            "--out", str(tmp_path / "o.json")])  # fmt: skip
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "3 of 3 prompts (100%) are verbatim user turns of the training data" in line
    assert "--force" in line and not (tmp_path / "o.json").exists()


def bench_main(argv: list[str]) -> tuple[int, str]:
    """`python -m workload.serve_bench ARGV` in this process (its main, less an interpreter's
    start and torch's import): the exit status and what it printed on stderr."""
    err, handler = io.StringIO(), signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    return int(code or 0), err.getvalue()


def test_length_buckets():
    assert [bucket_of(n) for n in (10, 1023, 1024, 4095, 4096, 16384)] == [
        "<1k", "<1k", "1-4k", "1-4k", "4-16k", ">16k"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--concurrency", "0"], "--concurrency 0: expected numbers >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--vs", "/x", "--vs-vllm-python", "/y"], "--vs and --vs-vllm-python: give one"),
        (["--repeat", "0"], "--repeat 0: must be >= 1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, said):
    code, err = bench_main(["--config", str(tmp_path / "run.yaml"), "--checkpoint",
                            str(tmp_path), "--out", str(tmp_path / "o.json"), *args])  # fmt: skip
    assert code == 2, err
    assert said in err.strip().splitlines()[-1]
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
