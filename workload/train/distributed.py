"""Process groups of a training run: which interface, which timeout, and the control traffic.

Every run has a process group, torchrun's or a one-process one: nccl on GPU, gloo on CPU,
with an explicit timeout (`dist.timeout_s`), so a peer that died or hangs ends the run instead
of leaving it waiting. Beside it a gloo group on the CPU carries the control traffic (stop
flags, the checkpoint to resume, RNG states, optimizer shards): those exchanges never sync a
GPU stream. On CPU the main group is gloo already and is used for both.

On multi-node runs the launcher sets DFLASHOPS_NODE_ADDR to the node's address; the
collectives are pinned to the interface that owns it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME),
since gloo otherwise resolves the hostname, which containers often map to 127.0.1.1.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workload.common.rank_files import NODE_ADDR_ENV
from workload.config import DistConfig

IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PIECE_BYTES = 64 << 20  # the most one send or broadcast carries: well under a second on 1 GbE
POLL_S = 1.0  # while a rank works alone, the others hear from it this often
_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union


class DistSetupError(Exception):
    """The node's network setup cannot carry the run (one line, exit 2)."""


# ---------------------------------------------------------------- the node's interface


def interface_addresses() -> list[tuple[str, str]]:
    """(interface label, IPv4 address) of every address on this machine's interfaces, secondary
    and aliased addresses included (SIOCGIFCONF)."""
    buf = array.array("B", bytes(_IFREQ_SIZE * 512))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("iL", len(buf), buf.buffer_info()[0])
        length = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, request))[0]
    raw = buf.tobytes()[:length]
    found = []
    for at in range(0, length, _IFREQ_SIZE):
        name = raw[at : at + 16].split(b"\0", 1)[0].decode()
        found.append((name, socket.inet_ntoa(raw[at + 20 : at + 24])))
    return found


def interface_of(address: str) -> str | None:
    """The interface that holds the IPv4 `address`, or None."""
    for name, held in interface_addresses():
        if held == address:
            return name
    return None


def pin_interface(env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """When NODE_ADDR_ENV is set, point gloo's and nccl's sockets (those not set already) at
    the interface holding that address. Returns the interface set, else None."""
    address = env.get(NODE_ADDR_ENV)
    missing = [key for key in IFNAME_ENVS if not env.get(key)]
    if not address or not missing:
        return None
    try:
        socket.inet_aton(address)
        name = interface_of(address) if address.count(".") == 3 else None
    except OSError:
        name = None
    if name is None:
        raise DistSetupError(
            f"{NODE_ADDR_ENV}={address}: no network interface of this node has that IPv4 "
            f"address; set it to this node's address, or set {' and '.join(IFNAME_ENVS)}"
        )
    for key in missing:
        env[key] = name
    return name


# ---------------------------------------------------------------- groups


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    control: Any = None  # the CPU (gloo) group for control traffic; None: the default group
    nodes: tuple[int, ...] = ()  # the node (torchrun's GROUP_RANK) of each rank; () = one node

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def nnodes(self) -> int:
        return len(set(self.nodes)) or 1

    def node_ranks(self) -> list[list[int]]:
        """The ranks of each node, nodes in order of their first rank."""
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(self.nodes or [0] * self.world):
            by_node.setdefault(node, []).append(rank)
        return list(by_node.values())


def _device(local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def init_distributed(cfg: DistConfig | None = None) -> Dist:
    """A process group in every case: torchrun's environment, else a one-process group.
    An existing group (e.g. a test's) is used as it is."""
    cfg = cfg or DistConfig()
    timeout = timedelta(seconds=cfg.timeout_s)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_initialized():
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = _device(local)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":  # a failed collective raises instead of hanging past the timeout
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            pin_interface()
            dist.init_process_group(backend, timeout=timeout)
        else:
            local = 0
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)  # fmt: skip
    control = None
    if dist.get_backend() != "gloo":
        control = dist.new_group(backend="gloo", timeout=timeout)
    d = Dist(dist.get_rank(), dist.get_world_size(), local, device, control)
    if d.world > 1:
        nodes: list[Any] = [None] * d.world
        dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", 0)), group=control)
        d.nodes = tuple(nodes)
    return d


def node_group(d: Dist, timeout: timedelta | None = None) -> Any:
    """A process group of this rank's node (every rank creates every node's group, in order,
    as new_group requires); None when the ranks are all on one node (the default group)."""
    if d.nnodes == 1:
        return None
    mine = None
    for ranks in d.node_ranks():
        group = dist.new_group(ranks, timeout=timeout)
        if d.rank in ranks:
            mine = group
    return mine


# ---------------------------------------------------------------- control traffic (CPU)


def any_rank(flag: bool, d: Dist) -> bool:
    """True on every rank when `flag` is true on some rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.control)
    return bool(t.item())


def broadcast_int(value: int, d: Dist) -> int:
    """Rank 0's `value` on every rank."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0, group=d.control)
    return int(t.item())


def gather_to_main(obj: Any, d: Dist) -> list[Any] | None:
    """Every rank's `obj` (picklable, small) on rank 0, in rank order; None elsewhere."""
    out: list[Any] | None = [None] * d.world if d.main else None
    dist.gather_object(obj, out, dst=0, group=d.control)
    return out


@dataclass(frozen=True)
class _Slot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().to("cpu").contiguous())
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _pieces(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Views of (contiguous) `tensors`, in order, of at most PIECE_BYTES each: what one send or
    broadcast carries. Sender and receiver cut the same shapes the same way."""
    for t in tensors:
        flat = t.view(-1)
        step = max(1, PIECE_BYTES // max(1, t.element_size()))
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]


def _empty_like_slots(skeleton: Any) -> list[torch.Tensor]:
    slots: list[_Slot] = []
    _collect_slots(skeleton, slots)
    return [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]


def send_state(obj: Any, dst: int, d: Dist) -> None:
    """Send a nest of dicts/lists holding tensors to rank `dst` over the control group: the
    structure pickled, then each tensor as it is (no pickled copy), in pieces."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(obj, tensors)
    dist.send_object_list([skeleton], dst=dst, group=d.control)
    for piece in _pieces(tensors):
        dist.send(piece, dst=dst, group=d.control)


def recv_state(src: int, d: Dist) -> Any:
    """What `send_state` sent from rank `src`, with every tensor on the CPU."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=d.control)
    tensors = _empty_like_slots(box[0])
    for piece in _pieces(tensors):
        dist.recv(piece, src=src, group=d.control)
    return _fill(box[0], tensors)


def broadcast_object(obj: Any, d: Dist) -> Any:
    """Rank 0's `obj` (picklable, small) on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=d.control)
    return box[0]


def broadcast_tensors(tensors: Sequence[torch.Tensor], d: Dist) -> None:
    """Rank 0's values of `tensors` (contiguous, on the device, the same shapes on every rank)
    into every rank's, in place, over the main group, in pieces."""
    for piece in _pieces(tensors):
        dist.broadcast(piece, src=0)


# ---------------------------------------------------------------- work on one rank, bounded waits


class PeerFailed(Exception):
    """Another rank failed while this one waited for it (its own output says why)."""


def _start(job: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = job()
        except BaseException as exc:  # noqa: BLE001 - raised by the caller after the polls
            box["error"] = exc

    thread = threading.Thread(target=work, name="rank work", daemon=True)
    thread.start()
    return thread, box


def run_polled(job: Callable[[], Any] | None, d: Dist, what: str) -> Any:
    """Run this rank's `job` (None: nothing) in a thread while every rank tells the others each
    POLL_S whether it is still working; returns the job's value once every rank is done. No
    rank waits in one collective for much more than POLL_S, however long a job takes. A job's
    error is raised on its rank, and PeerFailed (naming `what`) on the others."""
    thread, box = _start(job or (lambda: None))
    while any_rank(thread.is_alive(), d):
        thread.join(POLL_S)
    if any_rank("error" in box, d):
        if "error" in box:
            raise box["error"]
        raise PeerFailed(f"another rank failed while {what} (see its output)")
    return box["value"]


_WORKING, _DONE, _FAILED = -1, -2, -3


def hand_out(make: Callable[[int], Any] | None, wanting: Sequence[int], d: Dist) -> Any:
    """Rank 0 makes what each rank in `wanting` gets (`make(r)`, in a thread, one rank after
    the other, so it holds one at a time) and sends it to that rank over the control group,
    in pieces; that rank returns it, every other rank None. Every rank takes part: before each
    step rank 0 broadcasts what comes next (still making / a piece for rank r / done), so no
    rank waits in one collective for much longer than POLL_S or one piece, however large the
    states and however many ranks want them."""
    if d.main:
        for r in wanting:
            _send_made(lambda r=r: make(r), r, d)
        broadcast_int(_DONE, d)
        return None
    skeleton: Any = None
    tensors: list[torch.Tensor] = []
    pieces: Iterator[torch.Tensor] = iter(())
    while (code := broadcast_int(0, d)) != _DONE:
        if code == _FAILED:
            raise PeerFailed("rank 0 failed to read what it hands out (see its output)")
        if code != d.rank:
            continue
        if skeleton is None:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=0, group=d.control)
            skeleton, tensors = box[0], _empty_like_slots(box[0])
            pieces = _pieces(tensors)
        else:
            dist.recv(next(pieces), src=0, group=d.control)
    return None if skeleton is None else _fill(skeleton, tensors)


def _send_made(make: Callable[[], Any], dst: int, d: Dist) -> None:
    """Rank 0's side of `hand_out` for rank `dst`."""
    thread, box = _start(make)
    while thread.is_alive():
        broadcast_int(_WORKING, d)
        thread.join(POLL_S)
    if "error" in box:
        broadcast_int(_FAILED, d)
        raise box["error"]
    tensors: list[torch.Tensor] = []
    skeleton = _strip(box.pop("value"), tensors)
    broadcast_int(dst, d)
    dist.send_object_list([skeleton], dst=dst, group=d.control)
    for piece in _pieces(tensors):
        broadcast_int(dst, d)
        dist.send(piece, dst=dst, group=d.control)


def _collect_slots(obj: Any, slots: list[_Slot]) -> None:
    if isinstance(obj, _Slot):
        slots.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, slots)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, slots)
