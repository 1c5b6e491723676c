"""The failure paths of launch and its kin on the fake Proxmox bed (real sshd, faithful pct, ns
containers), with the stand-in trainer (test_runs_local) so each case takes seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import STAND_IN_TRAINER

pytestmark = pytest.mark.testbed


def stand_in(ct) -> str:
    """The stand-in trainer inside a container, as its python."""
    path = Path(ct.host_path("/workspace/stand-in"))
    path.write_text(STAND_IN_TRAINER)
    path.chmod(0o755)
    return "/workspace/stand-in"


def test_a_stopped_container_elsewhere_does_not_block_a_launch(testbed, make_container, tmp_path):
    train = make_container("pve1")
    parked = make_container("pve2", start=False)  # a template or a parked CT, as on any node
    python = stand_in(train)
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"train": train, "parked": parked},
        extra_defaults={"python": python},
    )  # fmt: skip
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 0\n")

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=inv, home=tmp_path, timeout=120)

    launched = cli("launch", "parked-ok", "--host", "train", "--config", str(cfg))
    assert launched.code == 0, launched.err
    warnings = [line for line in launched.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "parked" in warnings[0], launched.err
    assert json.loads(cli("--json", "status", "parked-ok").out)["state"] == "running"
    assert cli("stop", "parked-ok", "--kill").code == 0

    refused = cli("launch", "parked-no", "--host", "parked", "--config", str(cfg))
    assert refused.code == 3, refused.err
    assert "parked" in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err
