"""Runs inside a target under remote/launcher.py (stdlib only): one node of a datagen job.

argv: JOB_DIR. Reads JOB_DIR/datagen.json, written by `dflashops datagen`: {"argv": {target:
[...]}, ...}, and becomes this target's argv (exec, never through a shell) with this node's
`--nnodes N --node-rank I` (launch.json's "nodes" and "node"): the generator, `python -m
workload.datagen ... --out JOB_DIR`, under a one-node torchrun where the node runs several
processes. The generator keeps to the contract of every job's program (state.json,
SIGTERM: a clean stop after its current chunk); run again (`resume`), it repeats no finished
chunk, so a resume runs the same argv.
"""

import json
import os
import sys

from dflashops.remote.layout import LAUNCH_FILE


def main():
    job_dir = sys.argv[1]
    with open(os.path.join(job_dir, LAUNCH_FILE), encoding="utf-8") as f:
        launch = json.load(f)
    with open(os.path.join(job_dir, "datagen.json"), encoding="utf-8") as f:
        argv = json.load(f)["argv"][launch["target"]]
    argv = [*argv, "--nnodes", str(len(launch["nodes"])), "--node-rank", str(launch["node"])]
    sys.stdout.flush()
    os.execvp(argv[0], argv)


main()
