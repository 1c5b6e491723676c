"""The names of a workspace's layout (CONTRACTS §2-4, §6), spelled once for the whole operator:
its own modules import them from here, and the helper programs get this file in front of them
(stdlib only, as shared.py) when they import it.

<ws>/runs/RUN/ (archive/RUN/ once archived): run.yaml, launch.json, state.json, console.log,
train_log.jsonl, checkpoints/step_N/ (complete once its MANIFEST.sha256 is written);
<ws>/ckpts/RUN/step_N/: a pulled copy; <ws>/evals/RUN/step_N.json and serve_N.json: results.
"""

import posixpath

RUNS = "runs"  # <ws>/runs/RUN: a training run
ARCHIVE = "archive"  # <ws>/archive/RUN: an archived run
CKPTS = "ckpts"  # <ws>/ckpts/RUN/step_N: a checkpoint copied in by pull-ckpt
EVALS = "evals"  # <ws>/evals/RUN/: eval results, eval jobs, continuous evals
PROMPTS = "prompts"  # <ws>/prompts/SET/: benchmark prompts fetched by fetch-prompts
CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints/step_N
MANIFEST = "MANIFEST.sha256"  # a checkpoint's, written last (CONTRACTS §4)
STATE_FILE = "state.json"  # a job's state: pid, tmux, times, exit code
TRAIN_LOG = "train_log.jsonl"  # the trainer's metrics (CONTRACTS §3)
CONSOLE_LOG = "console.log"  # everything a job's program printed
RUN_CONFIG = "run.yaml"  # the resolved run config, written once by launch
RESOLVED_CONFIG = "resolved.yaml"  # the trainer's: every key, defaults filled in
AUDIT_FILE = "audit.json"  # the trainer's recipe audit
PLAN_FILE = "plan.json"  # the trainer's memory and step-time plan, the link it measured
LAUNCH_FILE = "launch.json"  # what the launcher runs, written at every start
RUN_LOCK = ".lock"  # a run dir's lock: every change to it (remote/runctl.py, the queue's waiter)
NODE_FILE = "node.json"  # the launcher's and the torchrun agent's processes (pid, start)
EXIT_CODE_FILE = "exit_code"  # the job's exit code, written by its launcher as it ends
COMPILE_CACHE = "dflashops/compile-cache"  # <ws>/...: torch's compile caches, every run's
TRAINING_STATE = "training_state.pt"  # a checkpoint's optimizer state: only a resume reads it
OPTIMIZER_DIR = "optimizer"  # under zero1, checkpoint/optimizer/rank_<R>.pt: the same
# an export (`dflashops export`): the checkpoint's drafter files with these beside them
CHAT_TEMPLATE = "chat_template.jinja"  # the chat template it was trained with
MODEL_CARD = "README.md"  # what it is, what it measured, how to serve it
TOKENIZER_CONFIG = "tokenizer_config.json"  # a target's: its chat_template when no .jinja
ENGINES_DIR = "engines"  # JOB_DIR/engines/PGID.json: the engine groups its evaluator started


def step_name(step):
    """A checkpoint's directory name: step_N, N not zero-padded."""
    return f"step_{step}"


def run_path(ws, run, where=RUNS):
    return posixpath.join(ws, where, run)


def ckpt_copy_path(ws, run, step):
    return posixpath.join(ws, CKPTS, run, step_name(step))


def eval_result_path(ws, run, step):
    return posixpath.join(ws, EVALS, run, f"step_{step}.json")


def serve_result_path(ws, run, step):
    return posixpath.join(ws, EVALS, run, f"serve_{step}.json")
