"""Pure: whether two fingerprints name one model (issue #33). A fingerprint is what the server
says of itself (the same on every host) and, after a dot, the model file's content digest when
the proxy that computed it could read the file ("" when not). Two proxies, one that reads the
file and one on a host without it, must agree; two proxies that both read it must also agree
on its content, which tells apart two finetunes the server describes alike."""

from __future__ import annotations


def compose(server: str, content: str) -> str:
    return f"{server}.{content}"


def _parts(fingerprint: str) -> tuple[str, str]:
    server, _, content = fingerprint.partition(".")
    return server, content


def same_model(a: str, b: str) -> bool:
    """True when the server parts are equal and the content parts are too wherever both are
    known. A fingerprint of the older form (no dot: it held the proxy's own path, inode and
    mtime) equals no new one: its snapshots are refused as "model changed", never restored."""
    (server_a, content_a), (server_b, content_b) = _parts(a), _parts(b)
    return server_a == server_b and (not content_a or not content_b or content_a == content_b)
