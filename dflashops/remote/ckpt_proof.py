"""Put in front of the checkpoint server and the follower (stdlib only): how each request and
each answer between them is signed with the token they share, and checked.

A request carries "X-Nonce" (fresh, hex), "X-Time" (the server's clock, whole seconds, as the
follower knows it) and "Authorization: DFO MAC('request', NONCE, TIME, METHOD, PATH)"; the
server takes it once, and only within WINDOW_S of its clock. Its answer carries "X-Time" (the
server's clock), "X-Digest" (the sha256 of the body; of a checkpoint file, the one its
manifest gives) and "X-Proof: MAC('answer', NONCE, STATUS, TIME, DIGEST)": status, time and
body are under the token, and the checkpoint's files under its manifest's digests.
"""

import hashlib
import hmac
import re

WINDOW_S = 300  # a request is good this long either side of the server's clock
HEX = re.compile(r"\A[0-9a-f]{32,64}\Z")
STAMP = re.compile(r"\A[0-9]{1,12}\Z")


def mac(token, *fields):
    """HMAC-SHA256 of the fields, one a line, under the token (hex)."""
    text = "\n".join(str(f) for f in fields)
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def request_mac(token, nonce, stamp, method, target):
    return mac(token, "request", nonce, stamp, method, target)


def answer_mac(token, nonce, status, stamp, digest):
    return mac(token, "answer", nonce, status, stamp, digest)


def same_mac(given, want):
    """Whether `given` (any text from the wire: a non-ASCII or missing value is simply not it)
    is the MAC `want`, compared in constant time."""
    if not isinstance(given, str) or not HEX.match(given):
        return False
    return hmac.compare_digest(given.encode(), want.encode())


def stamp_of(text):
    """A time stamp from the wire as a number, or None when it is not whole ASCII seconds."""
    return int(text) if isinstance(text, str) and STAMP.match(text) else None
