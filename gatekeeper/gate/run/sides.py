"""Which server each side of a served evaluation reaches, and the checks that the two sides are what
the flag says they are, made before anything is written.

A session of an http profile talks to ``url_on`` when the prefix cache is on and to ``url`` otherwise.
So for every flag but the cache, a declared change that moves the flag-on side to another server sets
``url``; a change that sets only ``url_on`` while the cache is off would leave both sides on one server,
and an evaluation would compare that server with itself (a false PASS found on a real server release).
A side may also be a server gatekeeper starts (``serve``, ``serve_on``): two sides that start the same command
compare that server with itself just the same.
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

from ...errors import GatekeeperError
from ...workspace import EngineProfile
from .plans import Plan

DEPLOYMENT = ("url", "url_on", "serve", "serve_on")  # the profile fields that say which server a side reaches


def reaches(profile: EngineProfile, cache: bool) -> list[str] | None:
    """The base URLs a session of ``profile`` sends its requests to (a started server's as the field that starts
    it: its port changes per run); None for an in-process engine."""
    if profile.adapter != "http":
        return None
    started = profile.started("on" if cache else "off")
    return [started[0]] if started else profile.replicas("on" if cache else "off")


def _shared(a: EngineProfile, side_a: str, b: EngineProfile, side_b: str) -> str | None:
    """What two sides both reach (a URL, or the command both start), or None where they reach different servers."""
    x, y = a.started(side_a), b.started(side_b)
    if x is not None or y is not None:
        return f"the server `{' '.join(x[1].command)}` starts" if x and y and x[1] == y[1] else None
    return same_server(a.replicas(side_a), b.replicas(side_b))


def address(url: str) -> tuple[frozenset[str], int, str]:
    """Where a base URL lands: the host's addresses (so localhost and 127.0.0.1 are one), port, path."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    try:
        found = frozenset(str(a[4][0]) for a in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP))
    except (OSError, UnicodeError):
        found = frozenset()
    return found or frozenset([host]), port, parts.path.rstrip("/")


def same_server(a: list[str], b: list[str]) -> str | None:
    """A URL of ``b`` that lands where one of ``a`` does (the same host address, port and path), or None."""
    mine = [address(u) for u in a]
    for url in b:
        hosts, port, path = address(url)
        if any(hosts & h and port == p and path == q for h, p, q in mine):
            return url
    return None


def check(p: Plan) -> None:
    """Exit 2 unless each side of ``p`` reaches the server its flag says: the prefix cache needs a flag-on
    deployment or a switch; a declared change of the deployment must move the flag-on side to another server."""
    off, on = p.configs["off"], p.configs["on"]
    if p.exercises_cache and off.profile.adapter == "http" and not off.profile.cache_switch \
            and _shared(off.profile, "off", off.profile, "on"):
        raise GatekeeperError(
            f"{off.profile.where}: prefix_cache compares the server with its prefix cache off and on, and this profile "
            "names one server and no switch: set 'url_on' (or 'serve_on') to the deployment with its cache on, or "
            "'cache_switch' to the request field that turns the cache off and on (llama.cpp: cache_prompt)")
    change = p.policy.change
    if change is None or p.exercises_cache:
        return
    touched = [f for f in DEPLOYMENT if f in {f.split('.')[0] for f in change.fields()}]  # serve.command: serve
    a = reaches(off.profile, off.cache)
    if not touched or a is None or on.profile.adapter != "http":
        return
    shared = _shared(off.profile, "on" if off.cache else "off", on.profile, "on" if on.cache else "off")
    if shared is None:
        return
    where = f"policies/{p.flag}.yaml: field 'change"
    if touched in (["url_on"], ["serve_on"]) and not on.cache:
        assert change.profile is not None  # the change sets url_on or serve_on
        field, given = touched[0], touched[0].removesuffix("_on")
        value = _url(change.profile[field]) if field == "url_on" else "{command: ...}"
        raise GatekeeperError(
            f"{where}.profile.{field}': with prefix_cache off, both sides send their requests to '{given}' "
            f"({', '.join(a)}), so the flag-on side would never reach the server '{field}' names; '{field}' is the "
            f"prefix cache's flag-on deployment. To make that server the flag-on side of {p.flag}, write "
            f"change: {{profile: {{{given}: {value}}}}}")
    raise GatekeeperError(
        f"{where}.profile.{touched[0]}': the flag-on side would reach {shared}, the server the flag-off side reaches "
        f"({', '.join(a)}): the evaluation would compare that server with itself; point the change at the flag-on "
        "deployment")


def reached(results: dict[str, Any]) -> list[str]:
    """The servers that answered a run's requests, as its case results record them."""
    return sorted({t["replica"] for r in results.values() for t in r["turns"] if t.get("replica")})


def _url(v: Any) -> str:
    return v if isinstance(v, str) else "[" + ", ".join(v) + "]"
