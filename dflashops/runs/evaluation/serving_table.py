"""The table of a serving result (`eval --serve`): per concurrency, tokens/s with the drafter and
without, TTFT and TPOT (p50/p99), speedup; beside it the --vs subject and the difference."""

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
        out.append([name, c, metric(spec.get("output_tokens_per_s"), "tok_s"),
                    metric(plain.get("output_tokens_per_s"), "tok_s"), _x(entry.get("speedup")),
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
        subjects.append((vs_name(vs), vs))
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
    engine = result.get("engine") or {}
    c.print(f"{result.get('n_prompts', '?')} prompts, max {result.get('max_new_tokens', '?')} "
            f"new tokens, vLLM {engine.get('version', '?')} on {result.get('engine_device', '?')}; "
            "TTFT/TPOT in ms; tau = 1 + accepted/drafts from the server's counters; "
            f"result: {dest.name}:{out}")  # fmt: skip


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
