"""Time to a run's first step: `launch --host any` and a queued launch against `launch --host a`.

Run: python bench/placement_latency.py [--runs 5]. Needs root (the bed makes namespaces).
Two containers on two fake Proxmox hosts (a on pve1, b on pve2), the stand-in trainer of
tests/operator/rundirs.py as their python (a step every 0.2 s: where a run goes is the point,
not what it trains). Three cases, alternated, each repeat with new run names:

1. `launch R --host a`: from the command's start to R's first train_log.jsonl line;
2. `launch R --host any`, a busy with another run and b free (so it passes a over): the same;
3. a and b busy, `launch R --host any --queue` (timed to its return), then `stop` of the run
   holding the target R queued on: from the holder's end (the `finished` time its trainer
   wrote in state.json) to R's first line, the queue's own part (the waiter reads its target
   every 2 s, so up to 2 s of it is the poll; the stop comes after a random pause of 0-2 s, so
   that it falls anywhere in the poll's period, as a user's would). Also shown: from the stop's
   start, and from its return (`stop` returns once it has read the holder stopped: the waiter
   may have started R by then, so that one can be below 0).

The first line's time is the `time` the trainer wrote in it (the containers share this
machine's clock), read from the run directory through the bed (host_path), not by `status`.
Every run is stopped and archived before the next case. Prints median, min and max per case,
where each run went, and the medians of 2 and 3 against 1's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from _bed import bed, dflashops_argv, home_env

from tests.operator.rundirs import STAND_IN_TRAINER
from tests.testbed import TestBedError

STAND_IN = "/root/stand-in"
VMIDS = {"a": ("pve1", 981), "b": ("pve2", 982)}
POLL_S = 2.0  # the queue's waiter reads its target this often (remote/queuewait.py)
FIRST_LINE_S = 120  # the most a run may take to log its first step
CASES = {
    "any": "2 launch --host any (a busy) -> first step",
    "queue": "3 holder's end -> queued first step",
}
Times = tuple[float, str, dict[str, float]]  # to the first step, where it ran, other times


class Bench:
    def __init__(self, tb, inventory: Path, config: Path, env: dict[str, str]) -> None:
        self.cts = {name: tb[host][vmid] for name, (host, vmid) in VMIDS.items()}
        self.inventory, self.config, self.env = inventory, str(config), env
        self.pause = random.Random(0)

    def cli(self, *args: str) -> tuple[float, str]:
        """Run `dflashops ARGS`; (wall-clock time at its return, its stdout)."""
        done = subprocess.run(dflashops_argv(self.inventory, *args), capture_output=True,
                              env=self.env, timeout=300)  # fmt: skip
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-2000:]
            raise SystemExit(f"placement_latency: dflashops {' '.join(args)}: exit "
                             f"{done.returncode}\n{tail}")  # fmt: skip
        return time.time(), done.stdout.decode(errors="replace")

    def launch(self, run: str, host: str, *more: str) -> float:
        return self.cli("launch", run, "--host", host, "--config", self.config, *more)[0]

    def where(self, run: str) -> str:
        """The container holding RUN's directory."""
        found = [n for n, ct in self.cts.items() if self.run_dir(ct, run).exists()]
        if len(found) != 1:
            raise SystemExit(f"placement_latency: run {run} is on {found or 'no container'}")
        return found[0]

    @staticmethod
    def run_dir(ct, run: str) -> Path:
        return ct.host_path(f"/workspace/runs/{run}")

    def first_step(self, run: str) -> tuple[float, str]:
        """(the time in RUN's first train_log.jsonl line, the container it ran on)."""
        deadline = time.monotonic() + FIRST_LINE_S
        while time.monotonic() < deadline:
            for name, ct in self.cts.items():
                log = self.run_dir(ct, run) / "train_log.jsonl"
                line = log.read_text().partition("\n")[0] if log.exists() else ""
                if line.endswith("}"):
                    return json.loads(line)["time"], name
            time.sleep(0.02)
        raise SystemExit(f"placement_latency: run {run} logged no step in {FIRST_LINE_S} s")

    def done_with(self, *runs: str) -> None:
        for run in runs:
            self.cli("stop", run)
        for run in runs:
            self.cli("archive", run)

    # --- the cases ---------------------------------------------------------------------
    def named(self, tag: str) -> Times:
        run = f"named-{tag}"
        began = time.time()
        returned = self.launch(run, "a")
        first, where = self.first_step(run)
        self.done_with(run)
        return first - began, where, {"returned": returned - began}

    def any(self, tag: str) -> Times:
        holder, run = f"anyhold-{tag}", f"any-{tag}"
        self.launch(holder, "a")
        began = time.time()
        returned = self.launch(run, "any")
        first, where = self.first_step(run)
        self.done_with(run, holder)
        return first - began, where, {"returned": returned - began}

    def queue(self, tag: str) -> Times:
        holders = {"a": f"qhold-a-{tag}", "b": f"qhold-b-{tag}"}
        for name, holder in holders.items():
            self.launch(holder, name)
        run = f"queued-{tag}"
        began = time.time()
        returned = self.launch(run, "any", "--queue")
        waits_on = self.where(run)
        holder = holders[waits_on]
        time.sleep(self.pause.uniform(0, POLL_S))  # any phase of the waiter's poll
        stopping = time.time()
        stopped, _ = self.cli("stop", holder)
        first, where = self.first_step(run)
        if where != waits_on:
            raise SystemExit(f"placement_latency: {run} queued on {waits_on}, ran on {where}")
        state = self.run_dir(self.cts[waits_on], holder) / "state.json"
        ended = json.loads(state.read_text())["finished"]
        self.done_with(run, holders["b" if waits_on == "a" else "a"])
        self.cli("archive", holder)
        return first - ended, where, {"returned": returned - began,
                                      "from stop's start": first - stopping,
                                      "from stop's return": first - stopped}  # fmt: skip


def make_bed(stack: ExitStack):
    try:
        tb = stack.enter_context(bed({host: [vmid] for host, vmid in VMIDS.values()}))
        for host, vmid in VMIDS.values():
            tb[host][vmid].run(["sh", "-c", f"cat > {STAND_IN} && chmod +x {STAND_IN}"],
                               input=STAND_IN_TRAINER.encode(), check=True)  # fmt: skip
    except (TestBedError, OSError, subprocess.CalledProcessError) as err:
        sys.exit(f"placement_latency: cannot make the test bed: {err}")
    return tb


def row(label: str, values: list[float]) -> str:
    return (f"{label:<50} {statistics.median(values):8.3f} {min(values):8.3f} "
            f"{max(values):8.3f}")  # fmt: skip


EXTRA = (  # (case, key of its other times, label)
    ("queue", "from stop's start", "  3 from the holder's stop started"),
    ("queue", "from stop's return", "  3 from the holder's stop returned (may be < 0)"),
    ("named", "returned", "  1 launch --host a returned"),
    ("any", "returned", "  2 launch --host any returned"),
    ("queue", "returned", "  3 launch --host any --queue returned"),
)


def report(times: dict[str, list[Times]]) -> None:
    print(f"{'seconds, ' + str(len(times['named'])) + ' runs each':<50} "
          f"{'median':>8} {'min':>8} {'max':>8}")  # fmt: skip
    print(row("1 launch --host a -> first step", [t for t, _, _ in times["named"]]))
    for case, label in CASES.items():
        print(row(label, [t for t, _, _ in times[case]]))
    for case, key, label in EXTRA:
        print(row(label, [other[key] for _, _, other in times[case]]))
    base = statistics.median(t for t, _, _ in times["named"])
    for case, label in CASES.items():
        ratio = statistics.median(t for t, _, _ in times[case]) / base
        print(f"ratio {label.split(' ', 1)[0]} / 1 (medians): {ratio:5.2f}x")
    for case, runs in times.items():
        print(f"where ({case}): {' '.join(w for _, w, _ in runs)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    if runs < 1:
        print(f"placement_latency: --runs {runs}: expected a count of 1 or more", file=sys.stderr)
        sys.exit(2)
    with ExitStack() as stack:
        tb = make_bed(stack)
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        inventory = tb.write_inventory(
            tmp / "hosts.yaml",
            {name: spec for name, spec in VMIDS.items()},
            extra_defaults={"python": STAND_IN},
        )
        config = tmp / "c.yaml"
        config.write_text("seed: 0\n")
        bench = Bench(tb, inventory, config, home_env(tmp))
        order = ["named", "any", "queue"]
        for case in order:  # warm: the code sent to each target, the CLI's bytecode cached
            getattr(bench, case)("warm")
        times: dict[str, list[Times]] = {case: [] for case in order}
        for i in range(runs):
            for case in order if i % 2 == 0 else order[::-1]:
                times[case].append(getattr(bench, case)(str(i)))
                print(f"repeat {i + 1}/{runs} {case}: {times[case][-1][0]:.3f} s",
                      file=sys.stderr)  # fmt: skip
        report(times)


if __name__ == "__main__":
    main()
