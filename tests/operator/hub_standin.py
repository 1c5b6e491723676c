"""A stand-in for the Hugging Face hub on a loopback port: the endpoints huggingface_hub's
model_info and snapshot_download call (model info with file metadata; HEAD and GET of
/REPO/resolve/COMMIT/FILE with ranges), for one model repository held in memory. It records
each request's Range, can stall a file's first transfer halfway (to test a resume), and can
serve a file whose bytes do not match the hashes it lists (to test the check)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    def __init__(self, repo: str, files: dict[str, bytes], lfs: set[str], token: str) -> None:
        self.repo, self.files, self.lfs, self.token = repo, files, lfs, token
        self.served: dict[str, bytes] = dict(files)  # what GET sends (tests may spoil one)
        self.ranges: list[tuple[str, str | None]] = []
        self.stall_once: set[str] = set()  # files whose first GET stops halfway and hangs
        self.release = threading.Event()
        self.auth: list[str | None] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def info(self) -> dict:
        siblings = []
        for name, data in self.files.items():
            entry = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
            if name in self.lfs:
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        return {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "private": True,
                "siblings": siblings}  # fmt: skip

    def tree(self) -> list[dict]:
        """The repository's files as /api/models/REPO/tree/REV lists them (one page)."""
        listed = []
        for entry in self.info()["siblings"]:
            item = {"type": "file", "path": entry["rfilename"], "size": entry["size"],
                    "oid": entry["blobId"]}  # fmt: skip
            if "lfs" in entry:
                item["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"],
                               "pointerSize": 134}  # fmt: skip
            listed.append(item)
        return listed

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

            def _file(self) -> str | None:
                head = f"/{hub.repo}/resolve/"
                if not self.path.startswith(head):
                    return None
                rev, _, name = self.path[len(head) :].partition("/")
                return name if rev in (COMMIT, "main") and name in hub.files else None

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                api = f"/api/models/{hub.repo}/"
                if self.path.startswith((api + "revision/", api + "tree/")):
                    if not self._allowed():
                        return
                    tree = self.path.startswith(api + "tree/")
                    body = json.dumps(hub.tree() if tree else hub.info()).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                if not self._allowed():
                    return
                name = self._file()
                if name is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = hub.served[name]
                real = hub.files[name]
                etag = hashlib.sha256(real).hexdigest() if name in hub.lfs else blob_id(real)
                start = 0
                wanted = self.headers.get("Range")
                if body:
                    hub.ranges.append((name, wanted))
                if wanted and wanted.startswith("bytes="):
                    start = int(wanted[6:].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                if name in hub.stall_once:
                    hub.stall_once.discard(name)
                    self.wfile.write(data[start : start + (len(data) - start) // 2])
                    self.wfile.flush()
                    hub.release.wait(60)  # a hub that stops answering halfway
                    return
                self.wfile.write(data[start:])

        return Handler
