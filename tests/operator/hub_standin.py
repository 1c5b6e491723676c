"""A stand-in for the Hugging Face hub on a loopback port: the endpoints huggingface_hub's
repo_info and hf_hub_download call (repository info with file metadata; HEAD and GET of
/REPO/resolve/COMMIT/FILE with ranges), for model repositories held in memory or on disk (a
file's bytes, or a Path to serve them from). It records each request's Range, can stall a
file's first transfer halfway (to test a stall), can serve a file whose bytes do not match
the hashes it lists (to test the check), and can hold every transfer to `rate` bytes a
second (a slow link: the deadline of silence against a long transfer)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SLICE = 1 << 16  # sent at a time on a held link (1 MiB on a free one)

Data = bytes | Path


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def size_of(data: Data) -> int:
    return data.stat().st_size if isinstance(data, Path) else len(data)


def sha256_of(data: Data) -> str:
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    with data.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def pointer(sha: str, size: int) -> bytes:
    """An LFS file's pointer: what the hub's blob id of an LFS file is the id of."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()


class Repo:
    """One repository at its newest commit: files, which are LFS, their hashes (once)."""

    def __init__(self, files: dict[str, Data], lfs: set[str], commit: str, kind: str) -> None:
        self.files, self.lfs, self.commit, self.kind = dict(files), set(lfs), commit, kind
        self.prefix = "" if kind == "model" else f"{kind}s/"  # the hub's URLs: datasets/REPO
        self.served: dict[str, Data] = dict(files)  # what GET sends (tests may spoil one)
        self.etags = {}
        self.siblings = []
        for name, data in self.files.items():
            size = size_of(data)
            if name in self.lfs:
                sha = sha256_of(data)
                entry = {"rfilename": name, "size": size, "blobId": blob_id(pointer(sha, size)),
                         "lfs": {"sha256": sha, "size": size, "pointerSize": 134}}  # fmt: skip
                self.etags[name] = sha
            else:
                entry = {"rfilename": name, "size": size, "blobId": blob_id(data)}
                self.etags[name] = entry["blobId"]
            self.siblings.append(entry)


class Hub:
    def __init__(
        self,
        repo: str,
        files: dict[str, Data],
        lfs: set[str],
        token: str,
        rate: float | None = None,
    ) -> None:
        self.token, self.rate = token, rate  # rate: bytes a second of every transfer, or None
        self.repos: dict[str, Repo] = {}
        self.first = repo
        self.publish(repo, files, lfs, COMMIT)
        self.ranges: list[tuple[str, str | None]] = []
        self.stall_once: set[str] = set()  # files whose first GET stops halfway and hangs
        self.hang_listing = False  # the repository info never answered (until release)
        self.release = threading.Event()
        self.auth: list[str | None] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def publish(
        self, repo: str, files: dict[str, Data], lfs: set[str], commit: str, kind: str = "model"
    ) -> None:
        """REPO's main branch now at `commit` with these files (a new repository, or a new
        commit of one); `kind` "dataset" for a dataset's."""
        self.repos[repo] = Repo(files, lfs, commit, kind)

    @property
    def served(self) -> dict[str, Data]:
        """What GET sends of the first repository's files."""
        return self.repos[self.first].served

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def info(self, repo: str) -> dict:
        r = self.repos[repo]
        return {"id": repo, "modelId": repo, "sha": r.commit, "private": True,
                "siblings": r.siblings}  # fmt: skip

    def tree(self, repo: str) -> list[dict]:
        """The repository's files as /api/models/REPO/tree/REV lists them (one page)."""
        listed = []
        for entry in self.repos[repo].siblings:
            item = {"type": "file", "path": entry["rfilename"], "size": entry["size"],
                    "oid": entry["blobId"]}  # fmt: skip
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"],
                               "pointerSize": 134}  # fmt: skip
            listed.append(item)
        return listed

    def chunks(self, data: Data, start: int, end: int) -> Iterator[bytes]:
        """Bytes start..end of `data`, held to `rate`."""
        began, sent = time.monotonic(), 0
        f = data.open("rb") if isinstance(data, Path) else None
        try:
            if f:
                f.seek(start)
            step = SLICE if self.rate else 1 << 20
            for at in range(start, end, step):
                n = min(step, end - at)
                yield f.read(n) if f else data[at : at + n]
                sent += n
                if self.rate:
                    ahead = sent / self.rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
        finally:
            if f:
                f.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _allowed(self) -> bool:
                got = self.headers.get("Authorization")
                hub.auth.append(got)
                if got != f"Bearer {hub.token}":
                    self.send_response(401)
                    self.send_header("X-Error-Code", "GatedRepo")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return False
                return True

            def _api(self) -> tuple[str, bool] | None:
                """(repo, is a tree listing) of an API path of a repository we hold."""
                for repo, held in hub.repos.items():
                    api = f"/api/{held.kind}s/{repo}/"
                    if self.path.startswith((api + "revision/", api + "tree/")):
                        return repo, self.path.startswith(api + "tree/")
                return None

            def _file(self) -> tuple[Repo, str] | None:
                for repo, held in hub.repos.items():
                    head = f"/{held.prefix}{repo}/resolve/"
                    if self.path.startswith(head):
                        rev, _, name = self.path[len(head) :].partition("/")
                        if rev in (held.commit, "main") and name in held.files:
                            return held, name
                return None

            def _empty(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                api = self._api()
                if api is None:
                    self._serve(body=True)
                    return
                if not self._allowed():
                    return
                repo, tree = api
                if hub.hang_listing:
                    hub.release.wait(60)
                    return
                body = json.dumps(hub.tree(repo) if tree else hub.info(repo)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _serve(self, body: bool) -> None:
                if not self._allowed():
                    return
                found = self._file()
                if found is None:
                    self._empty(404)
                    return
                held, name = found
                data = held.served[name]
                size = size_of(data)
                start = 0
                wanted = self.headers.get("Range")
                if body:
                    hub.ranges.append((name, wanted))
                if wanted and wanted.startswith("bytes="):
                    start = int(wanted[6:].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", held.commit)
                self.send_header("ETag", f'"{held.etags[name]}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(size - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                end = size
                stall = name in hub.stall_once
                if stall:
                    hub.stall_once.discard(name)
                    end = start + (size - start) // 2
                try:
                    for chunk in hub.chunks(data, start, end):
                        self.wfile.write(chunk)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client went away (a fetch cut off)
                if stall:
                    hub.release.wait(60)  # a hub that stops answering halfway

        return Handler
