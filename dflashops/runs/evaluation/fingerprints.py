"""The settings behind a τ (an eval result's `fingerprint`, CONTRACTS §6), compared.

Two results are comparable when their fingerprints are equal, key by key, with the target
compared by its digest (the same model copied to another path is the same target). A serving
result's fingerprint names its hardware (GPU model and count, driver, CUDA; or the CPU): results
on other hardware, or one that does not say (written before), differ there and are not compared. A result
without a fingerprint (written before fingerprints) has unknown settings: it is comparable with
nothing. `differs` names the keys that differ, as `evals`, `compare --tau` and the plot show them.
"""

from __future__ import annotations

from typing import Any

# fingerprint key -> the short name shown in tables
SHORT = {
    "prompts_sha256": "prompts",
    "chat_template_sha256": "template",
    "chat_template_kwargs": "template_kwargs",
    "temperature": "temperature",
    "max_new_tokens": "max_new_tokens",
    "block_size": "block_size",
    "target.digest": "target",
    "engine.name": "engine",
    "engine.version": "engine_version",
    "dtype": "dtype",
    "hardware.device": "device",  # a serving result's machine (workload/eval/hardware.py)
    "hardware.gpu": "gpu",
    "hardware.gpu_count": "gpu_count",
    "hardware.driver": "driver",
    "hardware.cuda": "cuda",
    "hardware.cpu": "cpu",
    "hardware.cpu_count": "cpu_count",
}
IGNORED = {"target.path"}  # informational: where the target lies on that machine
UNKNOWN = "no fingerprint"


def fingerprint_of(result: dict[str, Any] | None) -> dict[str, Any] | None:
    found = (result or {}).get("fingerprint")
    return found if isinstance(found, dict) else None


def flat(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """One level of nesting spelled out: {"engine": {"name": n}} -> {"engine.name": n}."""
    out: dict[str, Any] = {}
    for key, value in fingerprint.items():
        if isinstance(value, dict) and key != "chat_template_kwargs":
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def differs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str] | None:
    """The short names of the keys where results a and b were measured differently; [] when
    equal; None when either has no fingerprint (unknown settings)."""
    fa, fb = fingerprint_of(a), fingerprint_of(b)
    if fa is None or fb is None:
        return None
    x, y = flat(fa), flat(fb)
    keys = [k for k in dict.fromkeys([*x, *y]) if k not in IGNORED and x.get(k) != y.get(k)]
    return [SHORT.get(k, k) for k in keys]


def mark(found: list[str] | None) -> str:
    """'' (same settings), '≠prompts,engine' or '?' (unknown)."""
    if found is None:
        return "?"
    return "≠" + ",".join(found) if found else ""


def not_comparable(found: list[str] | None) -> str:
    return f"not comparable: {UNKNOWN}" if found is None else f"not comparable: {', '.join(found)}"


def prompt_group(result: dict[str, Any]) -> tuple[str, str]:
    """(key, label) of a result's prompt set: its prompts' sha256 and name."""
    fp = fingerprint_of(result)
    if fp is None or not fp.get("prompts_sha256"):
        return "", "unknown prompts (results without a fingerprint)"
    sha = str(fp["prompts_sha256"])
    named = result.get("prompt_set") if isinstance(result.get("prompt_set"), dict) else {}
    name = named.get("name") or named.get("path") or "prompts"
    count = named.get("n_prompts", result.get("n_prompts"))
    return sha, f"{name} (sha256 {sha[:12]}, {count if count is not None else '?'} prompts)"
