"""Host syncs of one training step on the tiny target: how often the host waits for values.

    python bench/host_syncs.py [--tiny DIR] [--chunks 64,4] [--baseline-tree PATH]

Counts, in one training step after a warm-up step, every operation that makes the host wait for
a device's values: reading a scalar (`item`, `float`, `int`, `bool`, a tensor as an index: aten
`_local_scalar_dense`), `tolist`/`numpy`, and the operations whose output shape depends on values
(`nonzero`, boolean-mask indexing and assignment, `masked_select`, `unique`, ...). On a CPU every
such read is cheap; on a GPU each one waits for all the work queued before it. The count is per
call site, so the reads of host-side batch tensors (which would not wait on a GPU) can be told
from the rest.

Each setting (`--chunks`: the loss's blocks per chunk; a smaller value means more chunks of
logits) runs in its own process with the code of the current tree, and with the code of
`--baseline-tree` (e.g. a `git worktree add /tmp/base cef2b58`) when given.
`--tiny DIR`: a `python -m workload.tiny --out` build (default: the tests' cached tiny dense).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests' small run (see tests/workload/test_train.py): 2 rows of 128 tokens, block 4
SMALL = ["drafter.num_layers=1", "drafter.block_size=4", "data.max_length=128",
         "data.num_anchors=8", "optim.batch_size=2", "optim.grad_accum=1"]  # fmt: skip


# ---------------------------------------------------------------- counting


def _sync_ops() -> set:
    import torch

    aten = torch.ops.aten
    names = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "repeat_interleave", "equal", "is_nonzero", "allclose")  # fmt: skip
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


class HostSyncs:
    """`with HostSyncs() as syncs:` counts the host reads of device values inside the block in
    `syncs.sites`, a Counter of "file:function op" (the innermost frame outside torch)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> HostSyncs:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_dispatch_counter(self))
        self._stack.enter_context(_method_counter(self, ("tolist", "numpy")))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def record(self, op: str) -> None:
        self.sites[f"{_site()} {op}"] += 1


@contextlib.contextmanager
def _dispatch_counter(syncs: HostSyncs) -> Iterator[None]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten, sync_ops = torch.ops.aten, _sync_ops()
    masked = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
              aten._index_put_impl_.default}  # fmt: skip

    def bool_index(args: tuple) -> bool:
        return len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] or ())
        )

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = getattr(func, "overloadpacket", None)
            if packet in sync_ops:
                syncs.record(packet.__name__)
            elif func in masked and bool_index(args):
                syncs.record(f"{packet.__name__}[bool]")
            return func(*args, **(kwargs or {}))

    with Mode():
        yield


@contextlib.contextmanager
def _method_counter(syncs: HostSyncs, names: tuple[str, ...]) -> Iterator[None]:
    import torch

    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name: str, real):
        @functools.wraps(real)
        def counted(self, *args, **kwargs):
            syncs.record(name)
            return real(self, *args, **kwargs)

        return counted

    for name, real in saved.items():
        setattr(torch.Tensor, name, wrap(name, real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


def _site() -> str:
    """`file:function` of the innermost caller outside torch and this file, followed by the
    innermost torch function on the way when there is one (e.g. the optimizer's)."""
    frame, inner = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" in path:
            if inner is None and _public(path):
                inner = f"{_short(path)}:{frame.f_code.co_name}"
        elif path != __file__:
            outer = f"{_short(path)}:{frame.f_code.co_name}"
            return outer if inner is None else f"{outer} > {inner}"
        frame = frame.f_back
    return "?"


def _public(path: str) -> bool:
    """A torch file worth naming (not dispatch, dynamo or tensor-method plumbing)."""
    return "/torch/_" not in path and not Path(path).name.startswith(("_", "overrides"))


def _short(path: str) -> str:
    return "/".join(Path(path).parts[-2:])


# ---------------------------------------------------------------- one step (child process)


def count_step(tiny: Path, chunk_blocks: int, overrides: list[str]) -> dict:
    """Set up the tiny run, take one warm-up step and count the host syncs of the next one.
    Works with the trainer before the step moved to workload/train/step.py (dict sums) and after."""
    import importlib

    import torch
    import torch.distributed as dist

    from workload.config import load_config
    from workload.train import loop as T
    from workload.train import loss as L

    try:
        step_mod = importlib.import_module("workload.train.step")
    except ImportError:
        step_mod = T
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config(tiny / "run.yaml", [*SMALL, *overrides])
    run, _ = T.setup(cfg, T.init_distributed(), say=lambda m: None)
    seen = {"chunks": 0, "blocks": 0}

    def objective(*args, on_logits=None, **kwargs):
        def hook(logits, labels, valid):
            seen["chunks"] += 1
            seen["blocks"] += logits.shape[0]
            on_logits(logits, labels, valid)

        return L.objective(*args, chunk_blocks=chunk_blocks, on_logits=hook, **kwargs)

    step_mod.objective = objective
    new_sums = getattr(step_mod, "StepSums", None)
    T.train_step(run, 0, new_sums(run.device) if new_sums else {})  # warm-up
    seen.update(chunks=0, blocks=0)
    sums = new_sums(run.device) if new_sums else {}
    with HostSyncs() as syncs:
        T.train_step(run, 1, sums)
    torch.cuda.synchronize() if run.device.type == "cuda" else None
    return {"chunk_blocks": chunk_blocks, **seen, "syncs": syncs.total, "sites": dict(syncs.sites)}


def in_child(tree: Path, tiny: Path, chunk_blocks: int, overrides: list[str]) -> dict:
    spec = json.dumps({"tiny": str(tiny), "chunk_blocks": chunk_blocks, "overrides": overrides})
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True,
                          text=True, env=env, cwd=tree, check=False)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{tree}: child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def default_tiny() -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "workload"))
    from conftest import FIXTURE_BUILDS, cached_tiny

    return cached_tiny(FIXTURE_BUILDS["dense"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", help="a `python -m workload.tiny --out` directory")
    p.add_argument("--chunks", default="64,4", help="blocks per loss chunk, one run each")
    p.add_argument("--baseline-tree", help="a checkout of the code to compare with")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        out = count_step(Path(spec["tiny"]), spec["chunk_blocks"], spec["overrides"])
        print(json.dumps(out))
        return
    tiny = Path(a.tiny) if a.tiny else default_tiny()
    trees = [("current", ROOT)]
    if a.baseline_tree:
        trees.insert(0, ("baseline", Path(a.baseline_tree).resolve()))
    print(f"tiny target {tiny}; one training step after a warm-up; settings {SMALL + a.set}")
    print(f"{'tree':<10}{'blocks/chunk':>13}{'chunks':>8}{'blocks':>8}{'host syncs':>12}")
    results = []
    for name, tree in trees:
        for chunk_blocks in (int(c) for c in a.chunks.split(",")):
            r = in_child(tree, tiny, chunk_blocks, a.set)
            results.append((name, r))
            print(f"{name:<10}{chunk_blocks:>13}{r['chunks']:>8}{r['blocks']:>8}{r['syncs']:>12}")
    for name, r in results:
        print(f"\n{name}, {r['chunk_blocks']} blocks per chunk ({r['chunks']} chunks):")
        for site, n in sorted(r["sites"].items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:5d}  {site}")


if __name__ == "__main__":
    main()
