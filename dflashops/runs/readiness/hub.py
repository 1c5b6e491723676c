"""A hub repository (a model, or a dataset's files) downloaded inside a target by its own
huggingface_hub (remote/hub_fetch.py), verified file by file against the hub's hashes.

`fetch(machine, HubFetch(...))` is the one call: the token travels on the helper's stdin, its
progress lines (bytes, rate, file; fetching and hashing) stream to our stderr, and the call's
deadline is one of progress: it fails only once nothing has moved for `machine.timeout`
seconds (the helper stops itself a little before, removing its partial files). DEST holds one
repository: another one there is refused (exit 2); the files of an earlier commit that the
new one lacks are removed; a file that does not match is removed with the hub's record of it,
so that the next call fetches it again.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from dataclasses import dataclass
from typing import Any

from dflashops import context, remote
from dflashops.errors import NoAnswerError, NotFoundError, OpsError, UnreachableError, UsageError
from dflashops.targets.base import Machine

HUB_DIR = "hf"  # <workspace>/hf/ORG/NAME: a repository's default place in a target
REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*\Z")  # the hub's: ORG/NAME


@dataclass(frozen=True)
class HubFetch:
    repo: str  # ORG/NAME
    dest: str  # a directory in the target
    revision: str = "main"
    token: str | None = None
    repo_type: str = "model"  # or "dataset"
    files: tuple[str, ...] | None = None  # these files only (None: the whole repository)


def check_repo(repo: str) -> str:
    if not REPO_ID.match(repo) or ".." in repo:
        raise UsageError(f"{repo}: not a hub repository id; give ORG/NAME, e.g. Qwen/Qwen3-8B")
    return repo


def default_dest(workspace: str, repo: str) -> str:
    """<workspace>/hf/ORG/NAME: one place per repository (NAME alone would mix org1/X and
    org2/X)."""
    return posixpath.join(workspace, HUB_DIR, *repo.split("/"))


def fetch(machine: Machine, request: HubFetch) -> dict[str, Any]:
    """Run the download; its answer: {"repo", "commit", "files", "bytes", "fetched",
    "checked", "bad": [names that did not match, removed], "removed": [files an earlier
    commit had], "extra": [files no listing names, left alone]} (empty under --dry-run)."""
    payload = {
        "repo": request.repo,
        "revision": request.revision,
        "dest": request.dest,
        "token": request.token,
        "repo_type": request.repo_type,
        "files": list(request.files) if request.files is not None else None,
        "deadline": machine.timeout,
    }
    argv = remote.argv("hub_fetch.py")
    argv[0] = machine.target.python
    try:
        result = machine.run(argv, stdin=json.dumps(payload).encode(),
                             stderr=context.stream_sink(sys.stderr))  # fmt: skip
    except NoAnswerError as exc:
        raise UnreachableError(
            f"{machine.name}: {request.repo}: nothing moved for {exc.seconds:g} s (no byte "
            "from the hub, no file hashed); the next run removes what was partial "
            "(--timeout SECONDS waits longer)"
        ) from None
    if machine.dry_run:
        return {}
    if not result.ok:
        failed = {2: UsageError, 3: UnreachableError, 4: NotFoundError}.get(
            result.returncode, OpsError
        )
        raise failed(f"{machine.name}: {request.repo}: {result.error_text}")
    return json.loads(result.stdout)
