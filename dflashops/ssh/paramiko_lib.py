"""paramiko, imported once and quietly: the one module of the SSH stack that names it at run
time (the others import it from here), so importing the stack costs nothing until a
connection is opened."""

from __future__ import annotations

import sys
import threading

_IMPORT_LOCK = threading.Lock()


def load_paramiko():  # noqa: ANN201
    """Import paramiko without the `invoke` package it pulls in (a third of its import time,
    used only for `Match exec`, which dflashops.ssh.config runs by the shell instead)."""
    with _IMPORT_LOCK:
        blocked = "invoke" not in sys.modules
        if blocked:
            sys.modules["invoke"] = None  # type: ignore[assignment]
        try:
            import paramiko
        finally:
            if blocked and sys.modules.get("invoke", 0) is None:
                del sys.modules["invoke"]
    return paramiko


def quiet_paramiko() -> None:
    """paramiko logs failures that we report ourselves, in one line; keep its logger quiet."""
    import logging

    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
