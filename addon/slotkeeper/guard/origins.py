"""Who may drive the proxy from a browser (issue #21): pure decisions on the `Host` and
`Origin` headers. No I/O and nothing of mitmproxy: guard.py applies them to flows.

- A management call (/api/sessions, /api/upstreams, /slotkeeper/metrics) must name the proxy in its
  `Host` header by an IP address or a name it listens as: a DNS-rebinding page reaches the
  proxy under a name of the attacker's (its `Host`), so it is refused even though it is "the
  same origin" to the browser.
- A changing management call refuses any `Origin` but the proxy's own, and any body but JSON:
  `fetch(url, {mode: "no-cors", method: "POST"})` from any page is a CORS "simple request"
  that a browser sends without asking, with a text/plain body at most.
- The Ollama routes check `Origin` like Ollama's OLLAMA_ORIGINS: loopback origins, app and
  browser-extension schemes, plus the configured list."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

# Ollama's defaults: these hosts on http/https with any port, and the schemes desktop apps,
# editors' webviews and local files load pages from. Browser extensions are allowed too.
_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")
OLLAMA_DEFAULT_ORIGINS: tuple[str, ...] = tuple(
    f"{scheme}://{host}{port}" for host in _DEFAULT_HOSTS for scheme in ("http", "https")
    for port in ("", ":*")
) + ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
_EXTENSION_SCHEMES = ("chrome-extension://", "moz-extension://", "safari-extension://",
                      "safari-web-extension://", "ms-browser-extension://")
JSON_TYPES = frozenset({"application/json"})


def split_host(host_header: str) -> tuple[str, str]:
    """(host, port) of a Host header: lower case, IPv6 brackets kept, a trailing dot dropped.
    ("", "") for an empty header."""
    value = host_header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = (value[:end + 1], value[end + 1:]) if end > 0 else (value, "")
        if rest and not rest.startswith(":"):
            return value, ""  # "[::1].evil.example" is a name, not an address
        return host, rest.removeprefix(":")
    host, _, port = value.partition(":") if value.count(":") == 1 else (value, "", "")
    return host.rstrip("."), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_allowed(host_header: str, names: Iterable[str]) -> bool:
    """May a management call that says `Host: host_header` be answered? An IP address
    cannot be rebound to anything (a page with that origin is served by that address), nor
    can `localhost` and `*.localhost` (browsers resolve them to loopback themselves); any
    other name only if it is one the proxy is known by (`names`: listen_host, the machine's
    own name, slotkeeper_api_hosts). No Host at all is no browser's request."""
    host, _ = split_host(host_header)
    if not host or _is_ip(host) or host == "localhost" or host.endswith(".localhost"):
        return True
    return host in {n.strip().lower().rstrip(".") for n in names if n}


def same_origin(origin: str, host_header: str) -> bool:
    """Is `origin` the proxy's own (the scheme and authority the request came to)? mitmweb
    and any page served elsewhere have another origin; "null" (a sandboxed frame, a
    file:// page) is nobody's."""
    origin = origin.strip().lower().rstrip("/")
    host = host_header.strip().lower()
    return bool(host) and origin in (f"http://{host}", f"https://{host}")


def is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() in JSON_TYPES


def mutation_refusal(method: str, origin: str | None, content_type: str,
                     has_body: bool, host_header: str) -> tuple[int, str] | None:
    """For a management call that changes something (not GET/HEAD/OPTIONS): None when it may
    go on, else (status, message). A browser can send POST with a text/plain body to any
    origin without a preflight; it cannot send application/json (a preflight we never
    answer), nor leave out or forge Origin on such a request."""
    if origin is not None and not same_origin(origin, host_header):
        return 403, (f"management calls from web pages are refused (Origin {origin[:100]!r} "
                     f"is not this proxy's)")
    if (method == "POST" or has_body) and not is_json(content_type):
        return 415, ("management calls that change something take a JSON body: send "
                     "'Content-Type: application/json' (and {} when there is nothing to say)")
    return None


@lru_cache(maxsize=64)
def _pattern(allowed: str) -> re.Pattern[str]:
    """An origin pattern, `*` matching any run of characters but "/" (an origin has no path),
    and `*` alone matching every origin."""
    value = allowed.strip().lower()
    if value == "*":
        return re.compile(".*")
    return re.compile("[^/]*".join(re.escape(p) for p in value.split("*")))


def origin_allowed(origin: str, extra: Sequence[str] = ()) -> bool:
    """Ollama's rule: may a page of `origin` use the Ollama routes? The defaults
    (OLLAMA_DEFAULT_ORIGINS, browser extensions) plus `extra` (slotkeeper_ollama_origins, as
    OLLAMA_ORIGINS adds to Ollama's). `*` alone in `extra` allows every origin."""
    value = origin.strip().lower()
    if value.startswith(_EXTENSION_SCHEMES):
        return True
    return any(_pattern(p).fullmatch(value) for p in (*OLLAMA_DEFAULT_ORIGINS, *extra) if p)
