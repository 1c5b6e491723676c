"""The trainer on tiny targets: teacher isolation, learning, exact resume, DDP, signals, W&B."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.workload.drafters import REPO, TEMPLATE, build_settings, trained_drafter
from workload.common.layout import STATE_NAME
from workload.config import load_config
from workload.drafter import checkpoint as ckpt
from workload.train import loop as T
from workload.train import save_restore
from workload.train import step as S

# A small, fast configuration of the tiny template (the tests' runs take seconds per step).
SMALL = [
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.max_length=128",
    "data.num_anchors=8",
    "optim.batch_size=2",
    "optim.max_steps=8",
    "log.log_every=2",
    "checkpoint.every=4",
    "checkpoint.keep_last=5",
]


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group for in-process runs (train() leaves an existing one alone)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return T.init_distributed()


def tiny_config(build: Path, *overrides: str):
    return load_config(TEMPLATE, [*build_settings(build), *overrides])


def config(build: Path, *overrides: str):
    return tiny_config(build, *SMALL, *overrides)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / T.LOG_NAME).read_text().splitlines()]


def read_state(run_dir: Path) -> dict:
    return json.loads((run_dir / STATE_NAME).read_text())


def cli(build: Path, run_dir: Path, *args: str, launcher=(sys.executable,), **kw):
    small = [a for item in (*build_settings(build), *SMALL) for a in ("--set", item)]
    cmd = [*launcher, "-m", "workload.train", "--config", str(TEMPLATE),
           "--run-dir", str(run_dir), *small, *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, **kw)


# ---------------------------------------------------------------- the teacher


def _step_inputs(run: T.Run, batch, monkeypatch) -> dict:
    """Run one micro step and capture the labels the loss saw and the drafter's fc inputs."""
    seen: dict = {}
    real = S.objective

    def spy(hidden, lm_head, labels, valid, obj, **kw):
        seen["labels"], seen["valid"] = labels.clone(), valid.clone()
        return real(hidden, lm_head, labels, valid, obj, **kw)

    monkeypatch.setattr(S, "objective", spy)
    handle = run.ddp.module.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("features", args[0].clone())
    )
    try:
        S.micro_step(run, batch, 0, S.StepSums(run.device))
    finally:
        handle.remove()
    return seen


def test_teacher_labels_do_not_depend_on_noise_or_fc_layers(tiny_dense, group, monkeypatch):
    clean = config(tiny_dense, "noise.start=0", "noise.end=0")
    noisy = config(tiny_dense, "noise.start=0.5", "noise.end=0.5", "drafter.fc_layers=all_but_last")
    run_a, _ = T.setup(clean, group, say=lambda m: None)
    run_b, _ = T.setup(noisy, group, say=lambda m: None)
    batch = S.trim_padding(run_a.stream.next_batch())
    a = _step_inputs(run_a, batch, monkeypatch)
    b = _step_inputs(run_b, batch, monkeypatch)
    assert a["valid"].sum() > 10
    assert torch.equal(a["labels"], b["labels"])
    assert torch.equal(a["valid"], b["valid"])
    # the runs did differ where they should: the fc inputs (fewer layers, noised)
    h = run_a.drafter.config.hidden_size
    assert a["features"].shape[-1] == 3 * h and b["features"].shape[-1] == 2 * h
    noise = b["features"] - a["features"][..., : 2 * h]
    assert 0.4 < noise.abs().max() <= 0.5


def test_noise_reaches_the_drafter_under_bf16_autocast():
    """bf16 features near 20 (a bf16 step is 0.125 there): the noise must not round away,
    neither when it is added nor when the drafter's fc reads the features."""
    from transformers import Qwen3Config

    from workload.drafter.model import DFlashDrafter, build_drafter_config

    target = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=4, vocab_size=128, intermediate_size=96)  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(target, num_layers=1, block_size=4,
                                                 mask_token_id=3, target_layer_ids=[0, 1]))  # fmt: skip
    features = (20 + torch.rand(2, 8, 128)).to(torch.bfloat16)
    noised = S.add_noise(features, 0.05)
    applied = noised - features.float()
    assert (applied != 0).float().mean() > 0.99 and applied.abs().max() <= 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        seen = drafter.project_context(noised)
        clean = drafter.project_context(S.add_noise(features, 0.0))
    with torch.no_grad():  # fp32 throughout: what the logged noise promises
        want = drafter.project_context(noised)
        want_clean = drafter.project_context(features.float())
    assert torch.equal(seen, want) and torch.equal(clean, want_clean)
    assert (seen - clean).abs().max() > 0


def test_ranks_draw_independent_noise_and_anchor_streams(tiny_dense, group):
    """No rank's anchor stream may be another rank's noise stream (both are CPU generators
    on CPU; seeds seed*1000+r and seed*1000+r+1 made rank r's anchors rank r-1's noise)."""
    cfg = config(tiny_dense)
    streams = []
    for rank in range(3):
        d = T.Dist(rank, 3, 0, torch.device("cpu"))
        run, _ = T.setup(cfg, d, say=lambda m: None)
        streams.append(torch.rand(8))  # this rank's noise stream
        streams.append(torch.rand(8, generator=run.anchor_gen))  # its anchor stream
    firsts = {tuple(s.tolist()) for s in streams}
    assert len(firsts) == len(streams)


def test_old_run_teacher_from_the_final_layer_equals_the_logits_teacher(tiny_dense, group):
    # hidden_states[-1] of HF is post-norm: teacher last_layer on layer N-1 must match logits.
    ids = "drafter.target_layer_ids=[1, 2, 5]"
    old = config(tiny_dense, ids, "drafter.fc_layers=all_but_last", "loss.teacher=last_layer")
    new = config(tiny_dense, ids)
    run_old, items = T.setup(old, group, say=lambda m: None)
    run_new, _ = T.setup(new, group, say=lambda m: None)
    batch = S.trim_padding(run_new.stream.next_batch())
    assert torch.equal(
        S.target_forward(run_old, batch).greedy, S.target_forward(run_new, batch).greedy
    )
    assert "loss.teacher" in {i.key for i in items}


# ---------------------------------------------------------------- drafter.init_from


def _start_drafter(path: Path, run: T.Run, *, mask, **settings) -> str:
    """Save a drafter for run's target with the run's layers and block, and `settings`."""
    from workload.drafter.model import DFlashDrafter, build_drafter_config

    d = run.cfg.drafter
    kw = {"num_layers": d.num_layers, "block_size": d.block_size, **settings}
    config = build_drafter_config(run.target.config, mask_token_id=0, target_layer_ids=run.fc_ids,
                                  **kw)  # fmt: skip
    config.dflash_config["mask_token_id"] = mask
    DFlashDrafter(config).save_pretrained(path)
    return f"drafter.init_from={path}"


def test_init_from_refuses_a_start_drafter_that_disagrees(tiny_dense, group, tmp_path):
    run, _ = T.setup(config(tiny_dense), group, say=lambda m: None)
    mask = run.cfg.drafter.mask_token_id
    start = _start_drafter(tmp_path / "start", run, mask=mask + 1,
                           layer_types=["sliding_attention"], sliding_window=16)  # fmt: skip
    with pytest.raises(T.UsageError) as info:
        T.setup(config(tiny_dense, start), group, say=lambda m: None)
    message = str(info.value)
    assert "\n" not in message
    assert f"drafter.mask_token_id {mask} (start drafter: {mask + 1})" in message
    assert "drafter.layer_types ['full_attention']" in message
    assert "drafter.sliding_window None (start drafter: 16)" in message
    assert "block_size" not in message and "num_layers" not in message


def test_init_from_takes_the_mask_token_it_lacks_and_gives_its_own(tiny_dense, group, tmp_path):
    run, _ = T.setup(config(tiny_dense), group, say=lambda m: None)
    mask = run.cfg.drafter.mask_token_id
    # a start drafter with mask null (a SpecForge-style init config) takes the config's
    start = _start_drafter(tmp_path / "no_mask", run, mask=None)
    resumed, _ = T.setup(config(tiny_dense, start), group, say=lambda m: None)
    assert resumed.drafter.mask_token_id == mask
    resumed.drafter.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["dflash_config"]["mask_token_id"] == mask
    # a config with mask null takes the start drafter's
    start = _start_drafter(tmp_path / "mask", run, mask=mask)
    taken, _ = T.setup(config(tiny_dense, start, "drafter.mask_token_id=null"), group,
                       say=lambda m: None)  # fmt: skip
    assert taken.cfg.drafter.mask_token_id == taken.drafter.mask_token_id == mask


# ---------------------------------------------------------------- packed rows


def _sliding_target(impl: str):
    """A random Qwen3 target whose first layer has a sliding window of 4 (as gpt-oss has)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=4, vocab_size=128, intermediate_size=96, sliding_window=4,
                      use_sliding_window=True, max_window_layers=4,
                      layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def _packed_run(build: Path | None, impl: str, group) -> T.Run:
    packed = [f"target.attn_implementation={impl}", "data.pack=true", "data.max_length=96"]
    if build is not None:
        run, _ = T.setup(config(build, *packed), group, say=lambda m: None)
        return run
    from types import SimpleNamespace

    from workload.data.chat import Example

    g = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(12):
        n = int(torch.randint(5, 30, (1,), generator=g))
        examples.append(
            Example(torch.randint(2, 127, (n,), generator=g).tolist(), [0, 0] + [1] * (n - 2))
        )
    cfg = load_config(TEMPLATE, ["target.path=in-memory", "data.path=in-memory",
                                 "drafter.mask_token_id=127", *SMALL, *packed])  # fmt: skip
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1, mask_token_id=None)
    run, _ = T.setup(cfg, group, say=lambda m: None, target=_sliding_target(impl),
                     tokenizer=tok, examples=examples)  # fmt: skip
    return run


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("target", ["tiny_dense", "sliding"])
def test_packed_rows_give_each_document_its_own_forward(target, impl, group, request):
    """Features and teacher tokens of a packed row equal those of each document run alone."""
    build = request.getfixturevalue("tiny_dense") if target == "tiny_dense" else None
    if impl == "flex_attention" and group.device.type == "cpu":
        # transformers' flex path on CPU (torch 2.13): inductor C++ compile errors, and NaN for
        # some unpacked lengths (8, 24, 40 seen); a run says so before it loads anything more
        with pytest.raises(T.UsageError, match="flex_attention is not supported on CPU"):
            _packed_run(build, impl, group)
        return
    run = _packed_run(build, impl, group)
    batch = S.trim_padding(run.stream.next_batch())
    view = S.target_forward(run, batch)
    body, head = S.decoder_body(run.target), run.target.get_output_embeddings()
    docs = 0
    for b in range(batch.input_ids.shape[0]):
        for doc in batch.doc_ids[b].unique().tolist():
            if doc < 0:
                continue
            at = (batch.doc_ids[b] == doc).nonzero()[:, 0]
            with torch.no_grad():
                alone = body(input_ids=batch.input_ids[b, at][None], output_hidden_states=True,
                             use_cache=False)  # fmt: skip
            features = S.select_target_features(alone.hidden_states, run.fc_ids)[0]
            torch.testing.assert_close(view.features[b, at], features, atol=1e-4, rtol=1e-4)
            assert torch.equal(
                view.greedy[b, at], S.greedy_tokens(alone.last_hidden_state, head)[0]
            )
            docs += 1
    assert docs >= 3  # rows did hold several documents


def test_packed_rows_refuse_attention_that_would_mix_documents(tiny_dense, group):
    from workload.config import ConfigError

    with pytest.raises(ConfigError, match="data.pack") as info:
        config(tiny_dense, "data.pack=true", "target.attn_implementation=flash_attention_2")
    assert "\n" not in str(info.value) and "sdpa" in str(info.value)


# ---------------------------------------------------------------- batches without an anchor


@pytest.mark.parametrize("attention", ["chunked", "dense"])  # flex has no CPU backward
def test_a_batch_without_an_eligible_anchor_is_a_zero_loss_step(tiny_dense, group, attention):
    """One supervised token per row: no anchor anywhere. The step must not crash, must add
    nothing, and must still give every parameter a gradient (what DDP's allreduce waits for)."""
    run, _ = T.setup(config(tiny_dense, f"attention={attention}"), group, say=lambda m: None)
    batch = S.trim_padding(run.stream.next_batch())
    batch.loss_mask[:] = False
    batch.loss_mask[:, -1] = True
    sums = S.StepSums(run.device)
    loss = S.micro_step(run, batch, 0, sums)  # its loss sums: no slot, no weight
    assert (loss.total.item(), loss.weight.item()) == (0.0, 0.0)
    assert all(p.grad is not None and not p.grad.any() for p in run.drafter.parameters())
    added = sums.to_dict()
    assert added["blocks"] == 0 and added["acc_count"] == 0 and added["dds8_sum"] == 0
    run.optimizer.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in run.drafter.state_dict().items()}
    run.stream.next_batch = lambda: batch  # two whole steps through DDP on such batches
    for step in range(2):
        loss_value, grad_norm, _ = T.train_step(run, step, S.StepSums(run.device))
        assert (loss_value.item(), grad_norm.item()) == (0.0, 0.0)
    assert all(torch.equal(before[k], v) for k, v in run.drafter.state_dict().items())


# ---------------------------------------------------------------- run directory rules


def test_refuses_a_used_run_dir_and_bad_config(tiny_dense, tmp_path, group):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / T.LOG_NAME).write_text('{"step": 1, "time": 0}\n')
    (run_dir / STATE_NAME).write_text('{"pid": 1}')
    with pytest.raises(T.UsageError, match="--resume"):
        T.train(config(tiny_dense), run_dir)
    assert read_state(run_dir) == {"pid": 1}
    assert T.main(["--config", str(tiny_dense / "run.yaml"), "--run-dir", str(tmp_path / "x"),
                   "--set", "loss.type=kll"]) == 2  # fmt: skip


def test_module_entry_point_bad_data_is_one_line_and_exit_2(tiny_dense, tmp_path):
    good = (tiny_dense / "data.jsonl").read_text().splitlines()[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        good + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    run_dir = tmp_path / "run"
    done = cli(tiny_dense, run_dir, "--set", f"data.path={bad}", timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {bad}:2: conversation has no assistant turn"
    ]
    assert (read_state(run_dir)["status"], read_state(run_dir)["exit_code"]) == ("failed", 2)


@pytest.mark.parametrize(
    "setting, named",
    [
        ("target.path={tmp}/no-model", "target.path: {tmp}/no-model"),
        ("data.path={tmp}/no-data.jsonl", "{tmp}/no-data.jsonl: cannot read the data"),
        ("drafter.init_from={tmp}/no-drafter", "drafter.init_from: {tmp}/no-drafter/config.json"),
    ],
)
def test_missing_paths_are_one_line_and_exit_2(tiny_dense, tmp_path, group, capsys, setting, named):
    sets = [a for item in (*build_settings(tiny_dense), *SMALL) for a in ("--set", item)]
    argv = ["--config", str(TEMPLATE), "--run-dir", str(tmp_path / "run"), *sets,
            "--set", setting.format(tmp=tmp_path)]  # fmt: skip
    assert T.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + named.format(tmp=tmp_path)), err
    assert read_state(tmp_path / "run")["exit_code"] == 2


# ---------------------------------------------------------------- resume


def _weights(run_dir: Path, step: int) -> dict:
    return load_file(str(ckpt.step_dir(run_dir, step) / "model.safetensors"))


class _StepClock:
    """Every training step takes exactly one second of the trainer's clock."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        real = T.train_step

        def step(*args, **kwargs):
            self.now += 1.0
            return real(*args, **kwargs)

        monkeypatch.setattr(T, "train_step", step)
        monkeypatch.setattr(T, "clock", lambda: self.now)


@pytest.mark.slow
def test_resume_continues_exactly(tiny_dense, tmp_path, group, monkeypatch):
    """8 steps in one go == 3 steps, stop (between log steps), resume, 5 steps: log and weights,
    tok_s included (the interval in progress at the stop is carried over, with its seconds)."""
    _StepClock(monkeypatch)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert T.train(config(tiny_dense), straight) == 0
    assert T.train(config(tiny_dense), split, stop_after=3) == 0
    assert read_state(split)["status"] == "stopped"
    assert ckpt.latest_complete(split) == ckpt.step_dir(split, 3)
    assert T.train(config(tiny_dense), split, resume=True) == 0
    a, b = read_log(straight), read_log(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 4, 6, 8]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "acc", "streak", "dds8", "grad_norm", "lr", "epoch", "noise", "tok_s"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-7), (ra["step"], key)
    wa, wb = _weights(straight, 8), _weights(split, 8)
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    print(f"\nresume: largest weight difference {worst:.3g}")
    assert worst <= 1e-6, worst
    state = read_state(split)
    assert (state["status"], state["exit_code"], state["last_step"]) == ("finished", 0, 8)
    assert state["total_steps"] == 8


# ---------------------------------------------------------------- processes


_CHOOSE = """
import sys
from pathlib import Path
from workload.train import loop as T
d = T.init_distributed()
print("chose", T.choose_checkpoint(Path(sys.argv[d.rank + 1]), d).name)
"""


def _choose_on_two_ranks(dirs: list[Path]) -> list[str]:
    """Each of two gloo ranks calls choose_checkpoint on its own run directory (as on
    node-local disks); returns what each printed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, "-c", _CHOOSE, *map(str, dirs)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    return [p.communicate(timeout=120)[0].strip() for p in procs]


def _fake_checkpoints(run_dir: Path, *steps: int) -> None:
    for step in steps:
        ckpt.save(run_dir, step, lambda tmp, s=step: (tmp / "weights").write_text(str(s)))


@pytest.mark.slow
def test_resume_picks_rank_0s_checkpoint_on_every_rank(tmp_path):
    """Rank 0's newest complete checkpoint is the one every rank resumes, whatever the other
    ranks' disks hold (node-local disks: `restore` sends them what they lack; the whole resume
    on two nodes is in test_train_ranks)."""
    rank0, rank1 = tmp_path / "node0", tmp_path / "node1"
    _fake_checkpoints(rank0, 2, 4)
    _fake_checkpoints(rank1, 2, 4, 6)  # a newer one rank 0 cannot see
    (ckpt.step_dir(rank1, 4) / ckpt.MANIFEST).unlink()  # and rank 1's copy of step_4 incomplete
    assert _choose_on_two_ranks([rank0, rank1]) == ["chose step_4", "chose step_4"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_dense, tmp_path):
    run_dir = tmp_path / "run"
    cmd_args = ["--set", "optim.max_steps=1000", "--set", "checkpoint.every=1000"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    # the build's own run.yaml, as `python -m workload.tiny` wrote it (the contract's path)
    sets = [a for s in SMALL for a in ("--set", s)]
    cmd = [sys.executable, "-m", "workload.train", "--config", str(tiny_dense / "run.yaml"),
           "--run-dir", str(run_dir), *sets, *cmd_args]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.time() + 180
    while not (run_dir / T.LOG_NAME).exists() or not (run_dir / T.LOG_NAME).read_text():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=180)[0].decode()
    assert proc.returncode == 0, out
    state = read_state(run_dir)
    assert (state["status"], state["exit_code"]) == ("stopped", 0)
    latest = ckpt.latest_complete(run_dir)
    assert latest is not None and ckpt.step_of(latest) == state["last_step"] < 1000
    assert "stopping after this step" in out


@pytest.mark.slow
def test_torchrun_two_ranks_on_cpu_and_resume_between_log_steps(tiny_dense, tmp_path):
    """2 ranks, 4 steps == 2 ranks, stop at 3, resume, 1 step: the log line of step 4 sums
    both ranks' steps 3 and 4 once each (rank 0 alone carries the saved interval)."""
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2")  # fmt: skip
    straight, split = tmp_path / "straight", tmp_path / "split"
    runs = [(straight, []), (split, ["--stop-after", "3"]), (split, ["--resume"])]
    for run_dir, args in runs:
        done = cli(tiny_dense, run_dir, "--set", "optim.max_steps=4", *args, launcher=launcher,
                   timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("resume: restored") == 1  # rank 0 alone prints
    records = read_log(straight)
    assert [r["step"] for r in records] == [r["step"] for r in read_log(split)] == [1, 2, 4]
    for key in ("loss", "acc", "streak", "dds8", "grad_norm", "lr", "epoch"):
        assert read_log(split)[-1][key] == pytest.approx(records[-1][key], rel=1e-5), key
    assert read_state(straight)["world_size"] == 2
    wa, wb = _weights(straight, 4), _weights(split, 4)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
    state = save_restore.load_training_state(ckpt.step_dir(straight, 4))
    assert len(state["rng"]) == 2


@pytest.mark.slow
def test_wandb_offline_run_lands_in_state(tiny_dense, tmp_path, group, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = config(tiny_dense, "optim.max_steps=2", "log.wandb.project=dflash-tests")
    assert T.train(cfg, run_dir) == 0
    state = read_state(run_dir)
    where = Path(state["wandb_url"])
    assert where.is_dir() and list(where.glob("run-*.wandb")), state
    assert state["wandb_id"]


# ---------------------------------------------------------------- learning


def _learns(build: Path, run_dir: Path, steps: int, *extra: str) -> tuple[dict, dict]:
    cfg = tiny_config(build, f"optim.max_steps={steps}", f"checkpoint.every={steps}", *extra)
    assert T.train(cfg, run_dir) == 0
    records = read_log(run_dir)
    first, last = records[0], records[-1]
    print(f"\n{build.name}: step 1 {first} -> step {last['step']} {last}")
    return first, last


@pytest.mark.slow
def test_dense_drafter_learns(tiny_dense):
    """The tiny template's 200 steps (the drafter test_eval_vllm evaluates, trained once)."""
    records = read_log(trained_drafter(tiny_dense))
    first, last = records[0], records[-1]
    print(f"\n{tiny_dense.name}: step 1 {first} -> step {last['step']} {last}")
    assert first["step"] == 1
    assert last["acc"] > first["acc"] + 0.3
    assert last["streak"] > first["streak"] + 1.0
    assert last["loss"] < first["loss"] / 2


@pytest.mark.slow
def test_hybrid_drafter_learns(tiny_hybrid, tmp_path, group):
    first, last = _learns(tiny_hybrid, tmp_path / "run", 100)  # measured: acc 0.67, streak 2.2
    assert last["acc"] > first["acc"] + 0.2
    assert last["streak"] > first["streak"] + 0.5
