"""`watch`'s W&B alert: only the trainer holds the live W&B run, so the operator asks it.

For a run whose run.yaml logs to W&B (log.wandb.project, mode not "disabled"), each alert is a
request written on the run's node 0 through remote/runctl.py ("alert": the text on stdin as
JSON, never on a command line) to <run dir>/alerts/ID.json, ID made from the alert's rule, metric
and step: a second `watch` raising the same alert asks nothing new. The trainer's rank 0 sends
each request at its next log step (and as it ends) with `wandb.run.alert` and renames it
ID.sent (workload/train/runlog.py), so it is sent once, a resume included. A run whose trainer is gone
gets no request: `watch` says so.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import yaml

from dflashops.errors import OpsError
from dflashops.remote import layout
from dflashops.runs.lifecycle.control import control
from dflashops.runs.reading.view import RunView
from dflashops.runs.watching.alarms import Alert
from dflashops.ssh.session import Session

UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
TITLE_MAX = 63  # W&B takes titles under 64 characters


def logs_to_wandb(view: RunView) -> bool:
    """Whether the run's run.yaml (read with the view) sends its metrics to W&B."""
    text = (view.raw.get("files") or {}).get(layout.RUN_CONFIG)
    try:
        data = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return False
    log = data.get("log") if isinstance(data, dict) else None
    w = log.get("wandb") if isinstance(log, dict) else None
    return isinstance(w, dict) and bool(w.get("project")) and w.get("mode") != "disabled"


def alert_id(alert: Alert) -> str:
    """A file name for the alert: its rule, metric and step (a digest keeps it unique)."""
    key = f"{alert.rule}\0{alert.metric}\0{alert.step}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    metric = UNSAFE.sub("_", alert.metric)[:40]
    return f"{alert.rule}-{metric}-step{alert.step}-{digest}"


def request_doc(alert: Alert, view: RunView) -> dict[str, str]:
    """The W&B alert: a short title (the rule, metric and step first), the whole message."""
    title = f"{alert.rule} {alert.metric} step {alert.step}: {view.name}"
    if len(title) > TITLE_MAX:
        title = title[: TITLE_MAX - 1] + "…"
    text = f"{view.name} (on {view.target}): {alert.message} [dflashops watch]"
    return {"title": title, "text": text, "level": "WARN"}


def request(session: Session, view: RunView, alert: Alert) -> str:
    """Ask the run's trainer to send the alert to W&B; what happened, in words."""
    machine = session.machine(session.inventory.target(view.target))
    try:
        answer = control(machine, "alert", view.dir, id=alert_id(alert),
                         alert=request_doc(alert, view))  # fmt: skip
    except OpsError as exc:
        return f"no W&B alert: {exc.message}"
    return outcome(answer, view)


def outcome(answer: dict[str, Any], view: RunView) -> str:
    if not answer.get("live"):
        return (f"no W&B alert: {view.name} is {view.state} (its trainer is gone, and only it "
                "can send one)")  # fmt: skip
    if answer.get("sent"):
        return "W&B alert: sent before (by an earlier watch)"
    if answer.get("written"):
        return "W&B alert: asked of the trainer (sent at its next log step)"
    return "W&B alert: asked before (the trainer sends it at its next log step)"
