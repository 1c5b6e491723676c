"""The run's record in its directory: `train_log.jsonl` and its metrics (`state.json` is
common/run_state.py), W&B, and
the progress line on the console.

`METRICS` is the one list of what a log line holds after `step` and `time` (CONTRACTS §3), in
the order written and shown, with how the progress line shows each: a new metric is one line
here (and its value in `log_record`). Rank 0 writes; the other ranks' objects are disabled.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workload.common.layout import ALERTS_DIR, LOG_NAME
from workload.config import RunConfig
from workload.train.metrics import finalize
from workload.train.step import Run, StepSums, holdout_sums, noise_std, reduce_sums

ALERT_LEVELS = ("INFO", "WARN", "ERROR")


@dataclass(frozen=True)
class Metric:
    key: str  # in train_log.jsonl and W&B
    label: str  # on the progress line
    fmt: str  # format spec on the progress line
    every_line: bool = True  # False: only on some lines (val_* at log.val_every), shown there


METRICS: tuple[Metric, ...] = (
    Metric("loss", "loss", ".4f"),
    Metric("acc", "acc", ".3f"),
    Metric("streak", "streak", ".2f"),
    Metric("dds8", "dds8", ".2f"),
    Metric("lr", "lr", ".2e"),
    Metric("noise", "noise", ".3f"),
    Metric("grad_norm", "gnorm", ".2f"),
    Metric("tok_s", "tok/s", ".0f"),
    Metric("epoch", "epoch", ".2f"),
    Metric("kept", "kept", ".3f"),
    Metric("val_loss", "val_loss", ".4f", every_line=False),
    Metric("val_acc", "val_acc", ".3f", every_line=False),
    Metric("val_streak", "val_streak", ".2f", every_line=False),
    Metric("val_dds8", "val_dds8", ".2f", every_line=False),
)


class MetricLog:
    """train_log.jsonl: one JSON object a line, flushed at once; rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = run_dir / LOG_NAME
        self.enabled = enabled
        self.file = self.path.open("a") if enabled else None

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def truncate_log(path: Path, last_step: int) -> None:
    """Keep only the lines up to `last_step` (resuming rewinds the log to the checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class Wandb:
    """W&B logging of the same keys when log.wandb.project is set (rank 0 only)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool, run_id: str | None) -> None:
        self.run = None
        w = cfg.log.wandb
        if not (enabled and w.project):
            return
        import wandb

        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.name or run_dir.name,
            mode=w.mode,
            dir=str(run_dir),
            config=cfg.to_dict(),
            id=run_id,
            resume="allow",
        )

    @property
    def location(self) -> tuple[str | None, str | None]:
        """(run id, URL or, offline, the local run directory)."""
        if self.run is None:
            return None, None
        url = getattr(self.run, "url", None)
        return self.run.id, url or str(Path(self.run.dir).parent)

    def send_alerts(self, run_dir: Path) -> list[str]:
        """Each alert request in run_dir/alerts/ sent once as a W&B alert, then renamed
        ID.sent (a resume never sends it again; one W&B refused is ID.failed); what to say of
        each. Without W&B: nothing."""
        if self.run is None:
            return []
        said = []
        for path in sorted((run_dir / ALERTS_DIR).glob("*.json")):
            try:
                req = json.loads(path.read_text())
                title, text = str(req["title"]), str(req["text"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a request of ours (or half gone): left as it is
            level = str(req.get("level") or "WARN").upper()
            try:
                self.run.alert(title=title, text=text,
                               level=level if level in ALERT_LEVELS else "WARN")  # fmt: skip
            except Exception as exc:  # W&B's own failure: said, never the run's end
                os.replace(path, path.with_suffix(".failed"))
                said.append(f"wandb: alert not sent ({exc}): {title}")
                continue
            os.replace(path, path.with_suffix(".sent"))
            said.append(f"wandb: alert sent: {title}")
        return said

    def log(self, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k not in ("step", "time")},
                         step=record["step"])  # fmt: skip

    def finish(self, exit_code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def val_values(sums: dict[str, float]) -> dict[str, float]:
    """val_loss, val_acc, val_streak, val_dds8 from `step.holdout_sums`."""
    out = {"val_loss": _ratio(sums["loss"], sums["weight"])}
    out.update((f"val_{k}", v) for k, v in finalize(sums).items())
    return out


def log_record(
    run: Run,
    step: int,
    interval: StepSums,
    seconds: float,
    lr: float,
    *,
    validating: bool = False,
) -> dict[str, Any]:
    """The log line of the interval that ends at `step` (its sums reduced over ranks); with
    `validating`, the val_* metrics of a pass over the held-out data too."""
    sums = reduce_sums(interval, run.device)
    rank_steps = max(sums["steps"], 1.0)  # steps of the interval x ranks
    values: dict[str, Any] = {"loss": sums["loss"] / rank_steps, **finalize(sums)}
    values.update(
        lr=lr,
        noise=noise_std(run.cfg, step - 1),
        epoch=run.stream.epoch,
        grad_norm=sums["grad_norm"] / rank_steps,
        tok_s=sums.get("tokens", 0.0) / max(seconds, 1e-9),
        kept=_ratio(sums["slots_kept"], sums["slots_supervised"]),
    )
    if validating:
        values.update(val_values(holdout_sums(run)))
    record: dict[str, Any] = {"step": step, "time": time.time()}
    record.update((m.key, values[m.key]) for m in METRICS if m.key in values)
    record.update((k, v) for k, v in values.items() if k not in record)  # dds{b} of other budgets
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}


def progress_line(r: dict[str, Any], total: int) -> str:
    """`step 8/600 loss 1.2345 acc 0.512 ...`: the console's view of a log line."""

    def shown(m: Metric) -> str:
        v = r.get(m.key)
        return f"{m.label} " + ("-" if v is None else format(v, m.fmt))

    parts = [shown(m) for m in METRICS if m.every_line or m.key in r]
    return f"step {r['step']}/{total} " + " ".join(parts)
