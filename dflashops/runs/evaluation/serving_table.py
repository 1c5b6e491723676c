"""The table of a serving result (`eval --serve`): per concurrency, tokens/s with the drafter and
without, TTFT and TPOT (p50/p99), speedup (± its spread over --repeat); beside it the --vs
subject and the difference; below, the hardware each was measured on (a --vs subject on other
hardware is marked, never differenced), the benchmark's warnings and the prompts' overlap with
the training data."""

from __future__ import annotations

from typing import Any

from dflashops.inventory import Target
from dflashops.render import console, metric, table


def _ms(part: dict[str, Any], key: str) -> str:
    q = part.get(key) or {}
    return f"{_num(q.get('p50'))}/{_num(q.get('p99'))}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _signed(value: float | None, fmt: str = "+.1f") -> str:
    return "-" if value is None else format(value, fmt)


def rows(name: str, result: dict[str, Any]) -> list[list[str]]:
    out = []
    for c, entry in sorted((result.get("serve") or {}).items(), key=lambda kv: int(kv[0])):
        spec, plain = entry.get("spec") or {}, entry.get("plain") or {}
        spread = (entry.get("spread") or {}).get("speedup")
        speedup = _x(entry.get("speedup")) + ("" if spread is None else f"±{spread:.2f}")
        out.append([name, c, metric(spec.get("output_tokens_per_s"), "tok_s"),
                    metric(plain.get("output_tokens_per_s"), "tok_s"), speedup,
                    _ms(spec, "ttft_ms"), _ms(plain, "ttft_ms"), _ms(spec, "tpot_ms"),
                    _ms(plain, "tpot_ms")])  # fmt: skip
    return out


def diff_rows(diff: dict[str, Any]) -> list[list[str]]:
    out = []
    for c, d in sorted((diff.get("serve") or {}).items(), key=lambda kv: int(kv[0])):
        ttft, tpot = d.get("ttft_ms") or {}, d.get("tpot_ms") or {}
        out.append(["difference", c, _signed(d.get("output_tokens_per_s")), "",
                    _signed(d.get("speedup"), "+.2f"),
                    f"{_signed(ttft.get('p50'))}/{_signed(ttft.get('p99'))}", "",
                    f"{_signed(tpot.get('p50'))}/{_signed(tpot.get('p99'))}", ""])  # fmt: skip
    return out


def show_serve(run: str, step: int, dest: Target, out: str, result: dict[str, Any]) -> None:
    grid = table("DRAFTER", "CONC", "SPEC TOK/S", "PLAIN TOK/S", "SPEEDUP", "SPEC TTFT p50/p99",
                 "PLAIN TTFT p50/p99", "SPEC TPOT p50/p99", "PLAIN TPOT p50/p99")  # fmt: skip
    subjects = [(f"{run} step_{step}", result)]
    vs = result.get("vs") if isinstance(result.get("vs"), dict) else None
    if vs is not None and result.get("vs_axis") == "engine":
        subjects = [(f"{run} step_{step} in {engine_label(result)}", result),
                    (f"{run} step_{step} in {engine_label(vs)}", vs)]  # fmt: skip
    elif vs is not None:
        other = "" if hardware_of(vs) == hardware_of(result) else " [other hardware]"
        subjects.append((vs_name(vs) + other, vs))
    for name, r in subjects:
        for row in rows(name, r):
            grid.add_row(*row)
    if isinstance(result.get("diff"), dict):
        for row in diff_rows(result["diff"]):
            grid.add_row(*row)
    c = console()
    c.print(grid)
    for name, r in subjects:
        c.print(f"{name}: tau {metric(r.get('tau'), 'streak')}; by category "
                + _pairs(r.get("tau_by_category")) + "; by prompt length "
                + _pairs(r.get("tau_by_length")) + "; per position "
                + " ".join(metric(x, "acc") for x in r.get("per_position") or []))  # fmt: skip
    if vs is not None and "diff" not in result:
        why = result.get("diff_refused") or ["the fingerprints differ"]
        c.print("no difference computed: the fingerprints differ: " + "; ".join(why))
    if vs is not None and hardware_of(vs) != hardware_of(result):
        c.print(f"{vs_name(vs)} was measured on {describe(hardware_of(vs))}: beside this one, "
                "not differenced")  # fmt: skip
    for line in result.get("warnings") or []:
        c.print(f"warning: {line}")
    overlap = overlap_note(result.get("training_overlap"))
    if overlap:
        c.print(overlap)
    engine = result.get("engine") or {}
    repeat = result.get("repeat") or 1
    means = f"; each figure the mean of {repeat} passes, ±: their spread" if repeat > 1 else ""
    c.print(f"{result.get('n_prompts', '?')} prompts, max {result.get('max_new_tokens', '?')} "
            f"new tokens, vLLM {engine.get('version', '?')} on {describe(hardware_of(result))}; "
            f"TTFT/TPOT in ms{means}; tau = 1 + accepted/drafts from the server's counters; "
            f"result: {dest.name}:{out}")  # fmt: skip


def hardware_of(result: dict[str, Any]) -> dict[str, Any] | None:
    found = (result.get("fingerprint") or {}).get("hardware")
    return found if isinstance(found, dict) else None


def describe(found: dict[str, Any] | None) -> str:
    """'NVIDIA H100 80GB HBM3 x1 (driver 550.54.15, CUDA 12.8)', 'CPU: ... (2 cores), no GPU',
    or 'unknown hardware' (a result written before the hardware was kept)."""
    if found is None:
        return "unknown hardware"
    if found.get("device") == "cpu":
        return f"CPU: {found.get('cpu', '?')} ({found.get('cpu_count', '?')} cores), no GPU"
    return (f"{found.get('gpu', '?')} x{found.get('gpu_count', '?')} (driver "
            f"{found.get('driver') or '?'}, CUDA {found.get('cuda') or '?'})")  # fmt: skip


def overlap_note(found: dict[str, Any] | None) -> str | None:
    """What the prompts' check against the training data found, where it is worth a line."""
    if not isinstance(found, dict):
        return None
    if "not_checked" in found:
        return f"the prompts were not checked against the training data: {found['not_checked']}"
    if not found.get("overlapping"):
        return None
    forced = " (--force)" if found.get("forced") else ""
    return (f"{found['overlapping']} of {found.get('prompts', '?')} prompts are verbatim in the "
            f"training data{forced}: " + ", ".join(found.get("where") or []))  # fmt: skip


def engine_label(result: dict[str, Any]) -> str:
    """'vllm 0.32.0', or 'vllm-0.31 (vllm 0.31.1)' for a named second environment."""
    engine = result.get("engine") if isinstance(result.get("engine"), dict) else {}
    version = f"{engine.get('name', 'vllm')} {engine.get('version', '?')}"
    where = engine.get("environment")
    return f"{where} ({version})" if where else version


def vs_name(vs: dict[str, Any]) -> str:
    """'v4 step_2000' for a run's checkpoint copy (<ws>/ckpts/RUN/step_N), else the path's
    last two parts."""
    path = str(vs.get("checkpoint") or "vs")
    parts = path.rstrip("/").split("/")
    if len(parts) > 1 and parts[-1].startswith("step_") and parts[-1][5:].isdigit():
        return f"{parts[-2]} {parts[-1]}"
    return "/".join(parts[-2:]) if len(parts) > 1 else path


def _pairs(values: dict[str, Any] | None) -> str:
    if not values:
        return "-"
    return ", ".join(f"{k} {metric(v, 'streak')}" for k, v in values.items())
