"""A neighbour on the path between the follower and the checkpoint server (as one with root on
the bridge gets by ARP): a relay on loopback, run as its own process, that passes each signed
request on untouched, keeps the real proof, and rewrites answers by its rules, each rule once
(then it passes answers through). Stdlib only.

argv: UPSTREAM_PORT RULES_JSON PORT_FILE LOG_FILE. RULES_JSON: [{"path": "/file", "name":
the query's name (absent: any), "do": ACTION, "forge": NAME}, ...] in order; ACTION is one of
- "drop": the request never reaches the server, the connection closed;
- "proof": the answer's X-Proof made non-ASCII;
- "manifest": the manifest's line of the file "forge" names given a forged digest (and size);
- "sizes": every size the manifest's answer gives made 1 TiB;
- "status": a 200 made a 404 with the server's own words for it;
- "file": the body replaced by as many forged bytes.
Where it changes a body it gives the answer the changed body's X-Digest and Content-Length,
as a careful forger would. It writes its port to PORT_FILE and each rule it used, a line, to
LOG_FILE.
"""

import hashlib
import json
import os
import socket
import sys
import threading
import urllib.parse

FORGED = b"forged weights "


def read_head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    return data


def read_all(sock):
    parts = []
    while chunk := sock.recv(1 << 20):
        parts.append(chunk)
    return b"".join(parts)


def split(answer):
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = [line.split(": ", 1) for line in lines]
    return status, headers, body


def join(status, headers, body):
    head = "\r\n".join([status, *(f"{k}: {v}" for k, v in headers)])
    return head.encode("latin-1") + b"\r\n\r\n" + body


def set_header(headers, key, value):
    for pair in headers:
        if pair[0].lower() == key.lower():
            pair[1] = value


def header(headers, key):
    return next((v for k, v in headers if k.lower() == key.lower()), None)


def forged_manifest(body, name):
    """The manifest's answer with NAME's line given the digest of forged bytes: as JSON
    {"manifest", "sizes"}, or as the bare text the follower used to read."""
    digest = hashlib.sha256(FORGED).hexdigest()

    def rewrite(text):
        return "".join(f"{digest}  {name}\n" if line.endswith(f"  {name}") else line + "\n"
                       for line in text.splitlines())  # fmt: skip

    try:
        doc = json.loads(body)
    except ValueError:
        return rewrite(body.decode()).encode()
    doc["manifest"] = rewrite(doc["manifest"])
    doc["sizes"][name] = len(FORGED)
    return json.dumps(doc).encode()


def huge_sizes(body, headers):
    try:
        doc = json.loads(body)
    except ValueError:  # the old way: the sizes in a header of their own
        sizes = json.loads(header(headers, "X-Sizes") or "{}")
        set_header(headers, "X-Sizes", json.dumps({n: 1 << 40 for n in sizes}))
        return body
    doc["sizes"] = {n: 1 << 40 for n in doc["sizes"]}
    return json.dumps(doc).encode()


def rewritten(rule, answer):
    action = rule["do"]
    status, headers, body = split(answer)
    if action == "proof":
        set_header(headers, "X-Proof", "\u00e9" * 64)
        return join(status, headers, body)
    if action == "file":
        body = (FORGED * (len(body) // len(FORGED) + 1))[: len(body)]
        return join(status, headers, body)
    if action == "manifest":
        body = forged_manifest(body, rule["forge"])
    elif action == "sizes":
        body = huge_sizes(body, headers)
    elif action == "status":
        status, body = "HTTP/1.0 404 Not Found", b"not in that checkpoint's manifest\n"
    set_header(headers, "X-Digest", hashlib.sha256(body).hexdigest())
    set_header(headers, "Content-Length", str(len(body)))
    return join(status, headers, body)


class Relay:
    def __init__(self, upstream, rules, log):
        self.upstream, self.rules, self.log = upstream, rules, log
        self.lock = threading.Lock()

    def rule_for(self, request):
        target = request.split(b" ", 2)[1].decode("latin-1")
        url = urllib.parse.urlsplit(target)
        name = dict(urllib.parse.parse_qsl(url.query)).get("name")
        with self.lock:
            for rule in self.rules:
                if rule["path"] == url.path and rule.get("name") in (None, name):
                    self.rules.remove(rule)
                    with open(self.log, "a") as f:
                        f.write(f"{rule['do']} {target}\n")
                    return rule
        return None

    def serve(self, client):
        with client:
            request = read_head(client)
            if request is None:
                return
            rule = self.rule_for(request)
            if rule and rule["do"] == "drop":
                return
            with socket.create_connection(("127.0.0.1", self.upstream), timeout=60) as up:
                up.sendall(request)
                answer = read_all(up)
            if rule:
                answer = rewritten(rule, answer)
            client.sendall(answer)


def main():
    upstream, rules, port_file, log = sys.argv[1:5]
    relay = Relay(int(upstream), json.loads(rules), log)
    listener = socket.create_server(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(listener.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=relay.serve, args=(client,), daemon=True).start()


if __name__ == "__main__":
    main()
