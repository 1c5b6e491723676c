"""`eval --engine vllm` for real: a trained tiny drafter served by vLLM (CPU build) as the tiny
target's DFlash speculator, against `--engine sim` of the same checkpoint and prompts.

Needs a vLLM environment (tests/engines.py finds it; the `vllm_python` fixture); skipped
without one. An engine takes 20-100 s to start on two shared cores, so one evaluation (the plain
engine and the speculative one) serves every assertion on results; one more, killed while its
first engine starts, shows that nothing of it outlives the evaluator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.workload.conftest import WORKLOAD
from tests.workload.drafters import STEPS, trained_drafter

pytestmark = pytest.mark.slow

PROMPTS, NEW_TOKENS = 8, 96


def _eval(build: Path, ckpt: Path, out: Path, *extra: str) -> tuple[dict, str, str]:
    argv = [sys.executable, "-m", "workload.eval", "--config", str(build / "run.yaml"),
            "--checkpoint", str(ckpt), "--max-prompts", str(PROMPTS),
            "--max-new-tokens", str(NEW_TOKENS), "--budgets", "8", "--out", str(out), *extra]  # fmt: skip
    # vLLM's engine core in the engine process itself (its offline mode): each engine starts
    # without spawning a second process that imports vLLM again, ~15 s less an engine here.
    # The operator's test (test_evals.py) runs the engines as a user's eval does.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env,
                          cwd=WORKLOAD.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout, done.stderr


@pytest.fixture(scope="module")
def evals(vllm_python, tiny_dense, tmp_path_factory) -> dict:
    ckpt = trained_drafter(tiny_dense) / "checkpoints" / f"step_{STEPS}"
    where = tmp_path_factory.mktemp("vllm-eval")
    sim, _, _ = _eval(tiny_dense, ckpt, where / "sim.json")
    vllm, out, err = _eval(tiny_dense, ckpt, where / "vllm.json", "--engine", "vllm",
                           "--vllm-python", vllm_python)  # fmt: skip
    return {"sim": sim, "vllm": vllm, "stdout": out, "stderr": err, "ckpt": ckpt}


def test_vllm_tau_agrees_with_the_simulation(evals):
    sim, vllm = evals["sim"], evals["vllm"]
    assert sim["tau"] > 2  # a drafter that drafts: the comparison is not trivial
    assert vllm["tau"] == pytest.approx(sim["tau"], rel=0.05)
    print(f"tau: vllm {vllm['tau']:.3f}, sim {sim['tau']:.3f}, "
          f"engine pooled {vllm['engine_mean_acceptance_length']:.3f}")  # fmt: skip
    # the simulation inside the vLLM eval runs on vLLM's greedy output
    assert vllm["simulation"]["tau"] == pytest.approx(sim["tau"], rel=0.05)
    assert set(vllm["ddtree"]) == set(sim["ddtree"]) == {"8", "16", "32", "64"}
    for p in vllm["prompts"]:  # vLLM's rounds cover its output: the first token, then rounds
        assert sum(p["checkpoint"]["rounds"]) == p["new_tokens"] - 1
        assert p["checkpoint"]["unaccounted_tokens"] == 0


def test_the_result_says_where_vllm_and_the_simulation_part(evals):
    s, prompts = evals["vllm"]["simulation"], evals["vllm"]["prompts"]
    identical = [p["index"] for p in prompts if p["checkpoint"]["rounds_identical"]]
    assert s["prompts"] == PROMPTS and s["prompts_identical"] == len(identical)
    assert len(s["differences"]) == PROMPTS - len(identical)
    for p in prompts:
        engine, simulated = p["checkpoint"]["rounds"], p["checkpoint"]["simulated"]["rounds"]
        assert (engine == simulated) == p["checkpoint"]["rounds_identical"]
    if not s["differences"]:
        assert s["first_difference"] is None
        return
    first = s["first_difference"]
    assert first == s["differences"][0]
    p = prompts[first["prompt"]]
    assert first["where"] == p["where"]
    r = first["round"]
    got = p["checkpoint"]
    assert got["rounds"][:r] == got["simulated"]["rounds"][:r]
    assert first["vllm"]["produced"] == got["rounds"][r]
    assert first["simulation"]["produced"] == got["simulated"]["rounds"][r]
    print("first difference:", first)


def test_the_engine_output_equals_greedy_or_the_result_names_the_prompts(evals):
    greedy, prompts = evals["vllm"]["greedy"], evals["vllm"]["prompts"]
    differ = [p["where"] for p in prompts if not p["checkpoint"]["equals_greedy"]]
    assert greedy["prompts"] == PROMPTS and greedy["equal"] == PROMPTS - len(differ)
    assert [d["where"] for d in greedy["differ"]] == differ
    assert greedy["equal"] == PROMPTS  # measured: lossless on the tiny float32 target
    # vLLM's plain greedy output is Hugging Face's, token for token here
    assert [p["new_tokens"] for p in prompts] == [p["new_tokens"] for p in evals["sim"]["prompts"]]


def test_the_vllm_result_keeps_the_contract_and_its_fingerprint(evals, vllm_python):
    sim, vllm = evals["sim"], evals["vllm"]
    for key in ("tau", "ddtree", "per_position", "histogram", "n_prompts", "max_new_tokens",
                "checkpoint", "engine", "fingerprint", "checkpoint_sha256", "prompt_set",
                "engine_mean_acceptance_length", "tokens_per_s", "speedup"):  # fmt: skip
        assert key in vllm, key
    version = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300).stdout.strip()  # fmt: skip
    assert vllm["engine"] == {"name": "vllm", "version": version}
    assert sim["engine"]["name"] == "sim"
    assert vllm["fingerprint"]["engine"] == vllm["engine"]
    assert vllm["fingerprint"]["dtype"] == sim["fingerprint"]["dtype"] == "float32"
    same = {k: v for k, v in vllm["fingerprint"].items() if k != "engine"}
    assert same == {k: v for k, v in sim["fingerprint"].items() if k != "engine"}
    assert vllm["checkpoint_sha256"] == sim["checkpoint_sha256"]
    assert vllm["n_prompts"] == PROMPTS and vllm["max_new_tokens"] == NEW_TOKENS
    assert len(vllm["per_position"]) == 7 and sum(vllm["histogram"]) == vllm["rounds"]
    tps = vllm["tokens_per_s"]
    assert tps["spec"] > 0 and tps["plain"] > 0
    assert vllm["speedup"] == pytest.approx(tps["spec"] / tps["plain"])
    assert vllm["engine_mean_acceptance_length"] >= 1
    assert evals["stdout"] == "" and "Traceback" not in evals["stderr"]
    assert "vllm: plain:" in evals["stderr"] and "vllm: checkpoint:" in evals["stderr"]


def group_of(pgid: int) -> list[int]:
    """The living processes of process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_bytes().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def test_a_killed_evaluator_leaves_no_engine_behind(vllm_python, tiny_dense, tmp_path):
    """SIGKILL of `eval --engine vllm` while its engine starts (vLLM's engine core in its own
    process, as a user's eval runs it): the kernel tells the engine program (PR_SET_PDEATHSIG),
    which ends its whole process group, the engine core with it; its record names the group."""
    ckpt = trained_drafter(tiny_dense) / "checkpoints" / f"step_{STEPS}"
    records = tmp_path / "engines"
    argv = [sys.executable, "-m", "workload.eval", "--config", str(tiny_dense / "run.yaml"),
            "--checkpoint", str(ckpt), "--max-prompts", "2", "--max-new-tokens", "8",
            "--engine", "vllm", "--vllm-python", vllm_python, "--out", str(tmp_path / "o.json")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DFLASHOPS_ENGINE_DIR": str(records)}
    evaluator = subprocess.Popen(argv, env=env, cwd=WORKLOAD.parent, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while True:  # until the engine program has started vLLM's engine core (a second process)
        assert evaluator.poll() is None and time.monotonic() < deadline, "no engine started"
        recorded = list(records.glob("*.json"))
        pgid = json.loads(recorded[0].read_text())["pgid"] if recorded else None
        if pgid and len(group_of(pgid)) >= 2:
            break
        time.sleep(0.2)
    os.kill(evaluator.pid, signal.SIGKILL)
    evaluator.wait()
    t0 = time.monotonic()
    while group_of(pgid):
        assert time.monotonic() - t0 < 30, f"the engine outlived its evaluator: {group_of(pgid)}"
        time.sleep(0.05)
    print(f"evaluator SIGKILLed: its engine group gone in {time.monotonic() - t0:.2f}s")
