"""One module per verb: its options (typer) and one call into runs/ or a target.

VERBS is what `dflashops --help` and shell completion show of each verb without importing its
module (the module loads only when its verb runs: dflashops/verbs.py). Its order is the order
of `--help`. tests/operator/test_verbs.py checks each short help against the verb's own.
"""

from __future__ import annotations

from typing import NamedTuple


class Verb(NamedTuple):
    module: str  # under dflashops.commands
    help: str  # the first paragraph of the verb's help, as `--help` lists it


VERBS: dict[str, Verb] = {
    "exec": Verb("exec_cmd", "Run ARGV on TARGET exactly as given: no shell unless ARGV is one."),
    "shell": Verb("shell", "Open an interactive shell in TARGET."),
    "push": Verb(
        "push",
        "Copy a file or a directory into TARGET (only what differs there), every sent file "
        "checked there against what was read here (CRC-32 and size; sha256 with --checksum).",
    ),
    "run-script": Verb(
        "run_script",
        "Copy SCRIPT into TARGET as a file and run it there; its exit code becomes ours.",
    ),
    "setup": Verb(
        "setup",
        "Make the target's venv if missing, install requirements with pip there, sync workload/.",
    ),
    "doctor": Verb(
        "doctor", "Check every requirement of a run on TARGET, one line each; exit 0 when ready."
    ),
    "fetch-model": Verb(
        "fetch_model",
        "Download a hub model inside the target, verified against the hub's hashes.",
    ),
    "fetch-prompts": Verb(
        "fetch_prompts",
        "Download benchmark prompt sets inside the target, verified: files for eval --prompts.",
    ),
    "launch": Verb(
        "launch", "Start a training run in a detached tmux session on one target or several."
    ),
    "status": Verb(
        "status", "Runs across the inventory: state, step, loss, acc, streak, dds8, tok/s, ETA."
    ),
    "logs": Verb("logs", "Print a run's console.log (everything the trainer printed)."),
    "attach": Verb("attach", "Attach this terminal to a run's tmux session."),
    "stop": Verb("stop", "Ask a run's trainer to save a checkpoint and stop; wait until it has."),
    "resume": Verb("resume", "Start a run again from its newest complete checkpoint."),
    "ckpts": Verb(
        "ckpts",
        "List a run's checkpoints: step, complete or not, size (and --verify their hashes).",
    ),
    "check": Verb(
        "check",
        "Train-to-serve parity: the chat template and kwargs of the run's data, its training, "
        "its eval results and serving (as said, else the engine's defaults); the drafter's "
        "block size, mask token, taps, layers, layer types and dtype against the target and "
        "the engine. Exit 2 on any mismatch.",
    ),
    "compare": Verb(
        "compare", "Compare runs' metrics at the same steps, across targets and archives."
    ),
    "diff": Verb("diff", "Show the runs' resolved configs side by side, with the recipe audit."),
    "archive": Verb(
        "archive",
        "Move a finished run to the target's archive/ (every node's), pruning checkpoints.",
    ),
    "pull-ckpt": Verb(
        "pull_ckpt", "Copy a run's checkpoint to <ws>/ckpts/RUN/step_STEP on TARGET, verified."
    ),
    "export": Verb(
        "export", "Export a checkpoint for serving: vLLM and SGLang load the directory as it is."
    ),
    "eval": Verb(
        "eval_cmd",
        "Evaluate a run's checkpoints on a target, as a job: tau, DDTree tau, per position.",
    ),
    "evals": Verb(
        "evals", "List stored eval results: tau, DDTree tau per budget, the reference's, the date."
    ),
    "watch": Verb(
        "watch",
        "Alarms on a run: tau (or acc, streak) too close to a baseline's, or not rising.",
    ),
    "datagen": Verb(
        "datagen",
        "Generate training replies with the target model, as a job on one target or several.",
    ),
    "hosts": Verb("hosts", "Hosts and targets of the inventory."),
}
