"""CORS for the Ollama surface, as Ollama answers it (gin-contrib/cors with its default
origins): a browser's preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`)
gets 204 and the allowed methods and headers for an allowed origin, 403 otherwise; an answer
to an allowed origin carries `Access-Control-Allow-Origin`. Pure: which origins are allowed is
an input (`allowed(origin) -> bool`), so the trust options (issue #21) decide it; the default
is Ollama's own default, loopback origins and local app schemes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

from .origins import origin_allowed

ALLOW_METHODS = "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
# What Ollama allows: the usual request headers and those the OpenAI SDKs send.
ALLOW_HEADERS = ("Authorization,Content-Type,User-Agent,Accept,X-Requested-With,"
                 "X-Stainless-Lang,X-Stainless-Package-Version,X-Stainless-Os,"
                 "X-Stainless-Arch,X-Stainless-Retry-Count,X-Stainless-Runtime,"
                 "X-Stainless-Runtime-Version,X-Stainless-Async,X-Stainless-Helper-Method,"
                 "X-Stainless-Poll-Helper,X-Stainless-Custom-Poll-Interval,"
                 "X-Stainless-Timeout")
MAX_AGE_S = "43200"  # 12 h, gin-contrib/cors' default
# flow.metadata: the CORS headers an Ollama route's answer gets, decided on its request (by the
# browser guard, else the Ollama surface); a None value removes that header (llama-server's
# own `*`). The keeper's responseheaders, which every answer meets, puts them on.
ANSWER_KEY = "slotkeeper_cors"
Allowed = Callable[[str], bool]


def loopback_origin(origin: str) -> bool:
    """Ollama's default OLLAMA_ORIGINS (loopback hosts on any port, local app schemes, browser
    extensions): the one origin rule, origins.origin_allowed, with nothing added."""
    return origin_allowed(origin)


def is_preflight(method: str, origin: str, request_method: str) -> bool:
    """A CORS preflight: OPTIONS with Origin and Access-Control-Request-Method."""
    return method == "OPTIONS" and bool(origin) and bool(request_method)


def preflight(origin: str, allowed: Allowed = loopback_origin) -> tuple[int, dict[str, str]]:
    """The status and headers of the answer to a preflight from `origin`."""
    if not allowed(origin):
        return 403, {}
    return 204, {"Access-Control-Allow-Origin": origin,
                 "Access-Control-Allow-Methods": ALLOW_METHODS,
                 "Access-Control-Allow-Headers": ALLOW_HEADERS,
                 "Access-Control-Max-Age": MAX_AGE_S,
                 "Vary": "Origin"}


def answer_headers(origin: str, allowed: Allowed = loopback_origin) -> dict[str, str]:
    """The CORS headers an ordinary answer to `origin` gets ({} without an allowed origin)."""
    if not origin or not allowed(origin):
        return {}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}


def put_answer_headers(headers: MutableMapping[str, str],
                       decided: Mapping[str, str | None] | None) -> None:
    """Put the CORS headers decided on the request (ANSWER_KEY) on its answer; a None value
    removes that header."""
    for name, value in (decided or {}).items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
