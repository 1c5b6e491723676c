"""What resuming a run elsewhere or at another size costs (`resume RUN --nproc N`, a move to
another target): the bytes of its newest checkpoint, their time over the link between targets,
and the time to its first step, from the plan's sizes.

A checkpoint holds the drafter's weights as trained (fp32) and AdamW's two fp32 moments of
every parameter, whatever the sharding (one file per rank under zero1); the target is not in
it. Resuming at another size on the targets that hold it moves nothing over the network (every
rank reads the states of its own parameters from the shared or node-local files; on node-local
disks rank 0 sends the other nodes theirs); resuming on a target that lacks it copies it once
(pull-ckpt's verified copy). Before its first step a resumed run loads the target and pays the
first step's compiles again unless torch's compile caches are kept (launch keeps them in the
workspace: a run of the same shapes on that target reuses them).
"""

from __future__ import annotations

from typing import Any

FP32 = 4
ADAM_MOMENTS = 2
DISK_READ_GBS = 2.0  # GB/s: an NVMe read, assumed
# the first step of the 27B drafter shape on one H200 with nothing cached: bench/gpu_check.py
# (issue 33's note), all of it compiling flex attention and its block masks
FIRST_STEP_COMPILE_S = 265.0


def checkpoint_bytes(drafter_params: int) -> int:
    return (1 + ADAM_MOMENTS) * FP32 * drafter_params


def resume_cost(drafter_params: int, target_bytes: int, link_gbps: float) -> dict[str, Any]:
    """The checkpoint's bytes, its copy to another target over `link_gbps`, and the time to a
    resumed run's first step there without and with the compile cache (seconds)."""
    ckpt = checkpoint_bytes(drafter_params)
    copy_s = ckpt * 8 / (link_gbps * 1e9)
    load_s = (ckpt + target_bytes) / (DISK_READ_GBS * 1e9)
    return {"checkpoint_bytes": ckpt, "link_gbps": link_gbps, "copy_s": copy_s,
            "load_s": load_s, "compile_s": FIRST_STEP_COMPILE_S,
            "first_step_s": {"same targets": load_s + FIRST_STEP_COMPILE_S,
                             "another target": copy_s + load_s + FIRST_STEP_COMPILE_S,
                             "same targets, compile cache": load_s}}  # fmt: skip


def resume_line(cost: dict[str, Any]) -> str:
    gib = cost["checkpoint_bytes"] / 2**30
    first = cost["first_step_s"]
    return (
        f"resume elsewhere or at another size: checkpoint {gib:.1f} GiB (weights + AdamW "
        f"moments, fp32); at another size on its targets nothing crosses the network, to "
        f"another target it is copied once ({cost['copy_s']:.0f} s at {cost['link_gbps']:g} "
        f"Gb/s); first step after ~{cost['load_s']:.0f} s of loading (target and checkpoint at "
        f"{DISK_READ_GBS:g} GB/s) + {cost['compile_s']:.0f} s compiling (the 27B shape on an "
        f"H200, measured): ~{first['same targets']:.0f} s, ~{first['another target']:.0f} s "
        f"elsewhere; with the workspace's compile cache the compile is read back (not measured "
        f"on a GPU)"
    )
