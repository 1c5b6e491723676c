"""Command line of the helper processes: `run_fakepve.py COMMAND HOST_JSON ...`."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    command, host_json, *rest = argv
    if command == "pct":
        from . import pct

        return pct.main(host_json, rest)
    from . import launch, state

    host = state.HostConfig.load(host_json)
    if command == "host":
        launch.host_exec_sshd(host, rest[0])
    ct = state.load_ct(host, int(rest[0]))
    if ct is None:
        sys.stderr.write(f"no container {rest[0]} on {host.name}\n")
        return 2
    try:
        if command == "ct-start":
            launch.start_container(host, ct, from_host=False)
        elif command == "ct-stop":
            launch.stop_container(host, ct, from_host=False)
        else:
            sys.stderr.write(f"unknown command {command}\n")
            return 2
    except launch.StartError as err:
        sys.stderr.write(f"{err}\n")
        return 1
    return 0
