# A hub model downloaded inside the target by the target's python with huggingface_hub
# (resumable: an interrupted file goes on from its .incomplete part), then every file checked
# against the hub's hashes (LFS files by sha256, the others by their git blob id).
# stdin: {"repo", "revision", "dest", "token" (or null)}; the token never is on a command line;
# optional "repo_type" ("dataset": fetch-prompts) and "allow" (patterns: only those files).
# stdout: {"commit", "files", "bytes", "bad": [names that do not match], "names"}. Exit 3: not there.
import fnmatch
import hashlib
import json
import os
import sys


def digest(path, lfs):
    h = hashlib.sha256() if lfs else hashlib.sha1()
    if not lfs:
        h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    req = json.loads(sys.stdin.read())
    # asked to fetch: an HF_HUB_OFFLINE of the target's environment (or ours) does not apply;
    # huggingface_hub reads it as it is imported
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # either one makes the hub offline
        os.environ.pop(name, None)
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        print(f"no huggingface_hub in {sys.executable}", file=sys.stderr)
        sys.exit(4)
    token = req.get("token") or False
    kind, allow = req.get("repo_type") or "model", req.get("allow")
    try:
        info = HfApi().repo_info(
            req["repo"], repo_type=kind, revision=req["revision"], files_metadata=True, token=token
        )
        snapshot_download(req["repo"], repo_type=kind, revision=info.sha, local_dir=req["dest"],
                          token=token, allow_patterns=allow)  # fmt: skip
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        sys.exit(3)
    except Exception as exc:  # noqa: BLE001 (the hub library's own: one line, not a traceback)
        print(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}", file=sys.stderr)
        sys.exit(1)
    bad, size = [], 0
    siblings = [s for s in info.siblings
                if not allow or any(fnmatch.fnmatch(s.rfilename, p) for p in allow)]  # fmt: skip
    for s in siblings:
        path = os.path.join(req["dest"], s.rfilename)
        want = s.lfs.sha256 if s.lfs else s.blob_id
        if not os.path.isfile(path) or digest(path, bool(s.lfs)) != want:
            bad.append(s.rfilename)
        else:
            size += os.path.getsize(path)
    names = [s.rfilename for s in siblings]
    print(json.dumps({"commit": info.sha, "files": len(siblings), "bytes": size, "bad": bad,
                      "names": names}))  # fmt: skip


main()
