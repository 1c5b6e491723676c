"""The `local` target: subprocesses on this machine, under the target's workspace."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from dflashops.targets.base import Machine, Process


class LocalProcess:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        try:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                start_new_session=False,
            )
            self.failed: int | None = None
        except FileNotFoundError:
            self.popen, self.failed = None, 127
            self.message = f"{argv[0]}: command not found\n".encode()
        except PermissionError:
            self.popen, self.failed = None, 126
            self.message = f"{argv[0]}: permission denied\n".encode()

    @classmethod
    def failed_start(cls, code: int, message: str) -> LocalProcess:
        proc = cls.__new__(cls)
        proc.popen, proc.failed, proc.message = None, code, (message + "\n").encode()
        return proc

    def write(self, data: bytes | memoryview) -> None:
        if self.popen:
            self.popen.stdin.write(data)
            self.popen.stdin.flush()  # a short line may be waited for (a push's offer)

    def stdin_pipe(self) -> int | None:
        return self.popen.stdin.fileno() if self.popen else None

    def close_stdin(self) -> None:
        if self.popen:
            with contextlib.suppress(BrokenPipeError):
                self.popen.stdin.close()

    def read_stdout(self, size: int) -> bytes:
        return self.popen.stdout.read1(size) if self.popen else b""

    def read_stderr(self, size: int) -> bytes:
        if not self.popen:
            message, self.message = self.message, b""
            return message
        return self.popen.stderr.read1(size)

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.popen:
            return self.failed or 0
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return 128 - code if code < 0 else code

    def kill(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.kill()


class LocalMachine(Machine):
    def base_env(self, env: dict[str, str]) -> dict[str, str]:
        merged = dict(os.environ)
        merged.update(self.target.env)
        merged.update(env)
        return merged

    def wrap(self, argv: list[str], env: dict[str, str], cwd: str | None) -> list[str]:
        return [*self.env_argv(env, cwd or self.target.workspace), *argv]

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None, *, bulk: bool = False
    ) -> Process:
        if cwd is None:  # the workspace is where commands run (a read names its own cwd)
            Path(self.target.workspace).mkdir(parents=True, exist_ok=True)
        workdir = cwd or self.target.workspace
        if not Path(workdir).is_dir():  # as `env -C` reports it on the other kinds
            return LocalProcess.failed_start(125, f"env: cannot change directory to '{workdir}'")
        return LocalProcess(argv, self.base_env(env), workdir)
