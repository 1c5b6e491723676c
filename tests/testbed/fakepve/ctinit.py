"""Init process of a test container: reap adopted orphans forever, exit on SIGTERM/SIGINT.

Standalone on purpose: LXC containers run this file with their own /usr/bin/python3
(`lxc.init.cmd = /usr/bin/python3 /usr/sbin/dflashops-ctinit <ct dir>`).
"""

import os
import signal


def reap_forever() -> None:
    sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        info = signal.sigtimedwait(sigs, 60)
        if info is not None and info.si_signo != signal.SIGCHLD:
            os._exit(0)


if __name__ == "__main__":
    reap_forever()
