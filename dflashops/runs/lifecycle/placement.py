"""Where a job runs: its nodes (one torchrun each, node 0 first: it hosts the rendezvous) and
their processes, and the torchrun command line of a node.

One node: `torchrun --nproc-per-node N` with a c10d rendezvous of its own on 127.0.0.1 (what
--standalone does, without resolving "localhost"). Several: the same on each node with a c10d
rendezvous hosted by node 0 (`--rdzv-conf is_host=...`, so no node needs to resolve another's
hostname) and each node's own `--local-addr`. Every node has the run directory at the same
path; node 0 holds train_log.jsonl, state.json and checkpoints.
"""

from __future__ import annotations

import secrets as random_tokens
import time
from dataclasses import dataclass, field
from typing import Any

from dflashops.errors import UsageError
from dflashops.inventory import Target
from dflashops.runs.reading.view import Kind

RDZV_JOIN_S = 600  # how long node 0 waits for the others to join (rendezvous)
LOOPBACK = "127.0.0.1"  # a one-node run's address: its ranks talk over lo


@dataclass(frozen=True)
class Node:
    index: int
    target: Target
    nproc: int


@dataclass
class Placement:
    """A job's nodes (a run's: one torchrun each, node 0 first: it hosts the rendezvous), with
    its kind, name and id, and what its kind adds to its state.json."""

    kind: Kind
    run: str  # the job's name
    run_id: str
    nodes: list[Node]
    port: int | None = None  # the rendezvous port on node 0 (several nodes only)
    state: dict[str, Any] = field(default_factory=dict)  # state.json's keys of its kind
    exclusive: bool = False  # its claim also settles its targets' GPUs with other launches

    @property
    def world(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def multi(self) -> bool:
        return len(self.nodes) > 1

    def dir(self, node: Node) -> str:
        return self.kind.dir(node.target, self.run)

    def describe(self) -> str:
        per = ", ".join(f"{n.target.name} x{n.nproc}" for n in self.nodes)
        return f"{self.world} rank(s): {per}"

    def lived(self, from_step: int) -> dict[str, Any]:
        """One entry of state.json's "history": where the job runs from `from_step` on."""
        return {"targets": [n.target.name for n in self.nodes],
                "nproc": [n.nproc for n in self.nodes], "world_size": self.world,
                "from_step": from_step, "time": time.time()}  # fmt: skip

    def record(self) -> list[dict[str, Any]]:
        """The nodes as run records list them (state.json's "nodes")."""
        return [
            {"target": n.target.name, "address": n.target.node_address, "nproc": n.nproc}
            for n in self.nodes
        ]


def new_run_id() -> str:
    return random_tokens.token_hex(8)


def nproc_of(target: Target, override: int | None, reported: int | None) -> int:
    """--nproc, else the inventory's gpus, else what nvidia-smi reports there, else 1."""
    for value in (override, target.gpus, reported):
        if value:
            return value
    return 1


def place(
    kind: Kind,
    run: str,
    targets: list[Target],
    *,
    nproc: int | None,
    reported: dict[str, int | None],
    run_id: str | None = None,
) -> Placement:
    """The run's nodes; several need an address each and the same number of processes."""
    nodes = [Node(i, t, nproc_of(t, nproc, reported.get(t.name))) for i, t in enumerate(targets)]
    if len(nodes) > 1:
        for node in nodes:
            if node.target.kind == "local":
                raise UsageError(
                    f"--host: {node.target.name} is the local target; a run over several "
                    "targets needs targets that reach each other (pct or ssh targets)"
                )
            if not node.target.node_address:
                raise UsageError(
                    f"--host: target {node.target.name} has no 'address' in the inventory; a run "
                    "over several targets needs one per target (its IP on the bridge, where the "
                    f"others reach it), e.g. targets.{node.target.name}.address: 10.1.2.200"
                )
        counts = {n.target.name: n.nproc for n in nodes}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{k} {v}" for k, v in counts.items())
            raise UsageError(
                f"--host: the targets would run different numbers of processes ({shown}); "
                "pass --nproc N for all of them"
            )
    return Placement(kind, run, run_id or new_run_id(), nodes)


def torchrun(placement: Placement, node: Node) -> list[str]:
    """torchrun on `node`, up to the program it runs (`-m MODULE ARGS...` follows)."""
    target = node.target
    head = [target.python, "-m", "torch.distributed.run", "--nproc-per-node", str(node.nproc)]
    head += ["--max-restarts", "0", "--monitor-interval", "1"]
    if placement.multi:
        first = placement.nodes[0].target.node_address
        is_host = "true" if node.index == 0 else "false"
        head += [
            "--nnodes", str(len(placement.nodes)),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{first}:{placement.port}",
            "--rdzv-id", f"{placement.run}-{placement.run_id}",
            "--rdzv-conf", f"is_host={is_host},join_timeout={RDZV_JOIN_S}",
            "--local-addr", str(target.node_address),
        ]  # fmt: skip
    else:  # what --standalone does, on 127.0.0.1 instead of "localhost": a container need not
        # resolve any name (a minimal one may have no /etc/hosts at all)
        head += [
            "--nnodes", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{LOOPBACK}:0",
            "--rdzv-id", f"{placement.run}-{placement.run_id}",
            "--local-addr", LOOPBACK,
        ]  # fmt: skip
    return head
