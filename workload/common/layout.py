"""The names of the files and directories the workload writes and reads, spelled once:
a run directory (CONTRACTS §2, §3), a checkpoint (§4), a dataset made by datagen (§7)."""

from __future__ import annotations

# a run directory: <workspace>/runs/<run>/
RUN_CONFIG = "run.yaml"
LOG_NAME = "train_log.jsonl"  # the metrics, one JSON object a line
STATE_NAME = "state.json"  # pid, status, exit code
RESOLVED_CONFIG = "resolved.yaml"  # the config with every default filled in, written at start
AUDIT_NAME = "audit.json"  # the recipe audit
PLAN_NAME = "plan.json"  # the memory and step-time plan
RANKS_DIR = "ranks"  # every rank's rank_<R>.log (its output) and rank_<R>.json (a heartbeat)
ALERTS_DIR = "alerts"  # W&B alert requests from `dflashops watch` (ID.json; ID.sent once sent)
CHECKPOINTS_DIR = "checkpoints"

# a checkpoint: checkpoints/step_<N>/
STEP_PREFIX = "step_"  # N not zero-padded
MANIFEST = "MANIFEST.sha256"  # sha256sum format, every other file; written last
WEIGHTS_NAME = "model.safetensors"  # one file, never shards
DRAFTER_CONFIG = "config.json"
MODULE_NAME = "dflash.py"  # config.json's auto_map: {"AutoModel": "dflash.DFlashDraftModel"}
TRAINING_STATE = "training_state.pt"  # optimizer, scheduler, RNG, data position
OPTIMIZER_DIR = "optimizer"  # under zero1: rank_<R>.pt, each rank's AdamW states

# a dataset made by datagen: <workspace>/data/<name>/
DATASET_MANIFEST = "manifest.json"


def step_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint."""
    return f"{STEP_PREFIX}{step}"


def rank_name(rank: int, suffix: str) -> str:
    """A rank's file: `rank_<R>.log`, `rank_<R>.json` under RANKS_DIR, `rank_<R>.pt` under
    OPTIMIZER_DIR."""
    return f"rank_{rank}{suffix}"
