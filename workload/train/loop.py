"""`python -m workload.train --config RUN.yaml --run-dir DIR [--resume] [--set key=value]...`

Trains a DFlash drafter against a frozen target, online, in one process per device. Per step:
batch -> frozen target forward (hidden states, no grad) -> teacher labels from the final logits
-> features of the configured target layers -> uniform noise on the fc inputs only -> drafter
over all anchor blocks -> logits through the target's frozen lm_head (chunked) -> loss ->
backward -> clip -> AdamW -> cosine schedule with warmup.

One process on CPU and `torchrun --nproc_per_node 8` (or multi-node through torchrun's
rendezvous) are the same code path: a process group (gloo on CPU, nccl on GPU, with an explicit
timeout) and DDP over the drafter only, whose AdamW states are sharded over the ranks (ZeRO-1)
when there are several; the frozen target is replicated on every rank, loaded straight onto its
device. Rank 0 writes the run directory: train_log.jsonl, state.json, audit.json,
resolved.yaml, checkpoints/ (written in the background while the ranks train on); every rank
keeps ranks/rank_<R>.json (a heartbeat) and, but rank 0, ranks/rank_<R>.log (its output).
SIGINT/SIGTERM (to rank 0 alone is enough) finish the current step on every rank, save a
checkpoint and exit 0; a second signal exits now.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import AUDIT_NAME, PLAN_NAME, RESOLVED_CONFIG
from workload.common.rank_files import Heartbeat, env_rank, process_start_ticks, redirect_output
from workload.common.run_state import RunState
from workload.common.stop_flag import StopFlag
from workload.config import (
    AuditItem,
    ConfigError,
    RunConfig,
    UsageError,
    audit_json,
    dump,
    load_config,
)
from workload.drafter.attention import FLEX_SHAPES, flex_compiled, resolve_impl
from workload.plan import memory as plan
from workload.plan import step_time as step_plan
from workload.train.build_run import setup
from workload.train.comm import LINK_PROBE_BYTES, measure_link_gbps
from workload.train.distributed import Dist, DistSetupError, any_rank, init_distributed
from workload.train.regrid import regrid
from workload.train.runlog import (
    LOG_NAME,
    MetricLog,
    Wandb,
    log_record,
    progress_line,
    truncate_log,
)
from workload.train.save_restore import (
    BackgroundWriter,
    choose_checkpoint,
    restore,
    save_checkpoint,
)
from workload.train.step import Run, StepSums, train_step

clock = time.monotonic  # seconds of a log interval (tests replace it)


# ---------------------------------------------------------------- stop requests


# ---------------------------------------------------------------- the run


def train(
    cfg: RunConfig, run_dir: Path, *, resume: bool = False, stop_after: int | None = None
) -> int:
    """Run (or resume) training in `run_dir`; returns the exit code (0 also when stopped).
    `stop_after`: stop (with a checkpoint) after this step, as if asked to."""
    owns_group = not dist.is_initialized()
    stop = StopFlag()
    beat: Heartbeat | None = None
    status, exit_code = "failed", 1
    try:
        d = init_distributed(cfg.dist)
        used = d.main and (run_dir / LOG_NAME).exists() and not resume
        if any_rank(used, d):  # rank 0's file system decides, every rank stops
            raise UsageError(
                f"{run_dir / LOG_NAME} exists: this run directory was used; "
                "pass --resume to continue it, or choose a new --run-dir"
            )
        beat = Heartbeat(run_dir, d.rank, d.local_rank, d.world)
        beat.update(status="starting")
        state = RunState(run_dir, d.main)
        if d.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            state.update(pid=os.getpid(), pid_start=process_start_ticks(), started=time.time(),
                         finished=None, exit_code=None, status="starting",
                         world_size=d.world)  # fmt: skip
        try:
            status = _train(cfg, run_dir, resume, d, state, stop, stop_after, beat)
        except UsageError:
            state.update(status="failed", finished=time.time(), exit_code=2)
            raise
        except BaseException:
            state.update(status="failed", finished=time.time(), exit_code=1)
            raise
        state.update(status=status, finished=time.time(), exit_code=0)
        exit_code = 0
        return 0
    except (UsageError, DistSetupError):
        exit_code = 2
        raise
    finally:
        if beat is not None:
            beat.update(status=status if exit_code == 0 else "failed", exit_code=exit_code)
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
        stop.restore()  # after the group is gone: a stop arriving as the run ends is no failure


def prepare(cfg: RunConfig, run_dir: Path, d: Dist, say) -> Run:
    """The run's pieces, with the recipe audit and the memory plan said and written (rank 0:
    audit.json, resolved.yaml, plan.json)."""
    run, items = setup(cfg, d, say=say, run_dir=run_dir)
    ours = [i for i in items if i.level != "peer"]
    for item in ours:
        say(f"recipe audit: {item.line()}")
    if not ours:
        say("recipe audit: every setting matches the recipe")
    peers = [i.key for i in items if i.level == "peer"]
    if peers:
        say(f"recipe audit: where the peers' trainers default otherwise (audit.json says why): "
            f"{', '.join(peers)}")  # fmt: skip
    hardware = plan.hardware_of(d.device)
    measured = measure_link_gbps(d)  # every rank takes part; None on one node
    if measured is not None:
        say(f"link: {measured:.1f} Gb/s between the nodes (a {LINK_PROBE_BYTES >> 20} MiB "
            "broadcast from rank 0, best of 3); the step-time plan uses it")  # fmt: skip
        hardware.link_gbps, hardware.link_measured = measured, True
    if d.main:
        memory = plan.estimate(cfg, run.target.config, d.world, device=d.device.type,
                               gpu_memory=plan.device_memory(d.device), nnodes=d.nnodes,
                               hardware=hardware)  # fmt: skip
        slower = scale_out_item(cfg, memory)
        if slower is not None:
            say(f"recipe audit: {slower.line()}")
            items.append(slower)
        write_json_atomic(run_dir / AUDIT_NAME, audit_json(items))
        dump(cfg, run_dir / RESOLVED_CONFIG)
        for line in memory.lines():
            say(f"memory plan: {line}")
        write_json_atomic(run_dir / PLAN_NAME, memory.to_json())
    return run


def scale_out_item(cfg: RunConfig, memory: plan.Plan) -> AuditItem | None:
    """A warning in the audit when the plan says the other nodes make a step slower than one
    node would be (step_plan.verdict); None on one node or when they pay."""
    t = memory.time
    if t is None or t.one_node_s is None or t.pays:
        return None
    line = step_plan.verdict(t, memory.nnodes)
    return AuditItem("optim.grad_accum", cfg.optim.grad_accum, None, line, "warn")


def resume_from(run: Run, run_dir: Path, say) -> tuple[int, dict[str, float], float]:
    """Restore rank 0's newest complete checkpoint on every rank (step 0 when there is none)
    and rewind the log to it: (step, this rank's log interval so far, its seconds)."""
    step, interval, elapsed = 0, {}, 0.0
    latest = choose_checkpoint(run_dir, run.dist)
    if latest is None:
        say("resume: no complete checkpoint; starting at step 0")
    else:
        step, interval, elapsed = restore(run, latest, say=say)
        say(f"resume: restored {latest} (step {step})")
    if run.dist.main:
        truncate_log(run_dir / LOG_NAME, step)
    return step, interval, elapsed


def first_step_line(run: Run, since: float) -> str:
    """The first step's time (from `since`), which holds the compiles of flex attention and
    its block masks (on GPU every rank stalls on them once), and the shapes compiled."""
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    seconds = clock() - since
    if resolve_impl(run.cfg.attention, run.device) != "flex":
        return f"first step: {seconds:.1f}s (attention chunked: nothing compiled)"
    shapes = len(FLEX_SHAPES)
    how = "compiled" if flex_compiled(run.device) else "run eagerly"
    return (
        f"first step: {seconds:.1f}s, with flex attention and block masks {how} for "
        f"{shapes} shape(s) (one per layer kind; later steps reuse them){cache_note()}"
    )


def cache_note() -> str:
    """'; compile cache: 4 graph(s) from the cache, 0 compiled' (TORCHINDUCTOR_CACHE_DIR,
    which launch puts in the workspace), or '' when nothing went through inductor."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    hits, misses = inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]
    if not hits + misses:
        return ""
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
    return f"; compile cache ({where}): {hits} graph(s) from the cache, {misses} compiled"


def _train(
    cfg: RunConfig,
    run_dir: Path,
    resume: bool,
    d: Dist,
    state: RunState,
    stop: StopFlag,
    stop_after: int | None,
    beat: Heartbeat,
) -> str:
    def say(msg: str) -> None:
        if d.main:
            print(msg, flush=True)

    via = os.environ.get("GLOO_SOCKET_IFNAME") or "the default interface"
    print(f"rank {d.rank}/{d.world}: pid {os.getpid()} on {socket.gethostname()}, device "
          f"{d.device}, collectives on {via}", flush=True)  # fmt: skip

    move = regrid(cfg, run_dir, d, say) if resume else None  # another world size: same batch
    run = prepare(cfg, run_dir, d, say)
    step, interval, elapsed = resume_from(run, run_dir, say) if resume else (0, {}, 0.0)
    moved = move.log_keys() if move is not None else {}  # on the first log line after it
    log = MetricLog(run_dir, d.main)
    wb = Wandb(cfg, run_dir, d.main, state.read().get("wandb_id") if resume else None)
    wandb_id, wandb_url = wb.location
    state.update(
        status="running", last_step=step, total_steps=run.total_steps, wandb_id=wandb_id,
        wandb_url=wandb_url,
    )  # fmt: skip
    beat.update(status="running", step=step)
    if wandb_url:
        say(f"wandb: {wandb_url}")

    status, exit_code = "finished", 1
    t_interval = clock() - elapsed
    writer = BackgroundWriter()  # rank 0's checkpoint writes
    interval = StepSums(d.device, interval)
    started = step
    try:
        while step < run.total_steps:
            t_step = clock()
            loss, grad_norm, lr = train_step(run, step, interval)
            if step == started:
                say(first_step_line(run, t_step))
            step += 1
            for key, value in (("loss", loss), ("grad_norm", grad_norm), ("steps", 1.0)):
                interval.add(key, value)
            last = step == run.total_steps
            every = cfg.log.val_every
            validating = run.holdout is not None and every is not None and step % every == 0
            if step == 1 or step % cfg.log.log_every == 0 or last or validating:
                record = log_record(run, step, interval, clock() - t_interval, lr,
                                    validating=validating)  # fmt: skip
                record.update(moved)
                moved = {}
                log.write(record)
                wb.log(record)
                for line in wb.send_alerts(run_dir):
                    say(line)
                say(progress_line(record, run.total_steps))
                state.update(last_step=step)
                beat.update(step=step)
                interval, t_interval = StepSums(d.device), clock()
            stopping = any_rank(stop.requested or step == stop_after, d)
            if step % cfg.checkpoint.every == 0 or last or stopping:
                save_checkpoint(run, run_dir, step, interval, clock() - t_interval, writer)
                say(f"checkpoint: step_{step} saving")
            if stopping:
                status = "stopped"
                say(f"stopped at step {step} on request")
                break
        writer.join()  # the last checkpoint is complete before the run says it ended
        exit_code = 0
    finally:
        writer.wait()  # a write in flight completes even when the run fails
        log.close()
        for line in wb.send_alerts(run_dir):  # asked for as the run ends
            say(line)
        wb.finish(exit_code)
        state.update(last_step=step)
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workload.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="run config (YAML)")
    p.add_argument("--run-dir", required=True, help="where logs, state and checkpoints go")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop after this step with a checkpoint, as if asked to (resumable)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set loss.gamma=7 (YAML-typed)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        redirect_output(Path(args.run_dir), env_rank()[0])
    except OSError as exc:
        print(f"error: --run-dir {args.run_dir}: cannot write this rank's log: {exc.strerror}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # console.log gets progress lines, not tqdm bars
    try:
        cfg = load_config(args.config, args.set)
        code = train(cfg, Path(args.run_dir), resume=args.resume, stop_after=args.stop_after)
        for sig in (signal.SIGINT, signal.SIGTERM):  # the run has ended: a late stop is no failure
            signal.signal(sig, signal.SIG_IGN)
        return code
    except (ConfigError, UsageError, DistSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
