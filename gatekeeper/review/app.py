"""The review app over HTTP: every page as HTML and, at the same address plus ``.json``, as JSON.

    /flags                      each flag, its evidence, what a flip still needs, the commands to run
    /live                       each flag's live evidence from the guard after its flip, and any rollback
    /evaluations                the list, filtered (?flag= &verdict= &since= &until=) and paged (?before=ID)
    /evaluations/REF            one evaluation (?cases=differs|regressed|improved|unchanged)
    /evaluations/REF/cases/ID   one case, flag off beside flag on (ID percent-encoded: tiny%2Fa)
    /compare/A/B                two evaluations case by case, A the reference
    /integrity                  ``ledger verify`` and the checkpoints
    /entries/HASH               a permalink: the page of the record that ledger entry holds

REF, A and B are an evaluation id or the hash of its ledger entry (or its first 12+ digits).

Safe to run on a workstation: only GET and HEAD are routed (nothing can write), a request whose Host is not
one this server serves is refused (DNS rebinding), as is any request from another origin (an ``Origin`` that is
not ours, or a ``Sec-Fetch-Site: cross-site`` that is not a top-level navigation); every response carries a
strict Content-Security-Policy (no script at all, only this server's own stylesheet and icon, no framing), and
templates escape everything the ledger holds.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Callable, Literal, Mapping, TypedDict

from ..errors import GatekeeperError
from ..listen import bind as listening
from ..listen import loopback, parse_listen
from . import charts, pages
from .source import NotFound, Source

HERE = Path(__file__).parent
DEFAULT_LISTEN = "127.0.0.1:8017"
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cross-Origin-Opener-Policy": "same-origin",
           "Cross-Origin-Resource-Policy": "same-origin", "Cache-Control": "no-store"}
STATIC = {"review.css": "text/css", "favicon.svg": "image/svg+xml"}


def templates():
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    from ..gate.guard import scope_of

    env.globals.update(charts=charts, num=_num, pct=_pct, scope_of=scope_of)
    env.filters["quoted"] = lambda text: json.dumps(text, ensure_ascii=False)  # a token's text, whitespace visible
    return env


def _num(x: object) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


class ErrorPage(TypedDict):
    """A page that could not be made: its status and why, under the integrity badge."""

    page: Literal["error"]
    status: int
    error: str
    integrity: pages.Badge


class Review:
    """The aiohttp application over one ``Source``; ``hosts`` are the Host headers it serves (``name:port``)."""

    def __init__(self, source: Source, hosts: set[str]):
        self.source, self.hosts = source, {h.lower() for h in hosts}
        self.env = templates()

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self.guard])
        r = app.router
        r.add_get("/", self.home)
        r.add_get("/flags{ext:(\\.json)?}", self.page(lambda q, m: pages.flags(self.source), "flags"))
        r.add_get("/live{ext:(\\.json)?}", self.page(lambda q, m: pages.live(self.source), "live"))
        r.add_get("/integrity{ext:(\\.json)?}", self.page(lambda q, m: pages.integrity(self.source), "integrity"))
        r.add_get("/evaluations{ext:(\\.json)?}", self.page(lambda q, m: pages.evaluations(self.source, q), "evaluations"))
        r.add_get("/evaluations/{ref:[0-9A-Fa-f]+}{ext:(\\.json)?}",
                  self.page(lambda q, m: pages.evaluation(self.source, m["ref"], q.get("cases") or "all"), "evaluation"))
        r.add_get("/evaluations/{ref:[0-9A-Fa-f]+}/cases/{case:.+}",
                  self.page(lambda q, m: pages.case(self.source, m["ref"], m["case"]), "case"))
        r.add_get("/compare/{a:[0-9A-Fa-f]+}/{b:[0-9A-Fa-f]+}{ext:(\\.json)?}",
                  self.page(lambda q, m: pages.compare(self.source, m["a"], m["b"]), "compare"))
        r.add_get("/compare", self.compare_form)
        r.add_get("/entries/{hash:[0-9A-Fa-f]+}", self.entry)
        r.add_get("/static/{name}", self.static)
        r.add_get("/favicon.ico", lambda request: self.static(request, "favicon.svg"))
        return app

    # -- the safeguards ---------------------------------------------------------------------------

    def refusal(self, request) -> str | None:
        """Why this request is refused, or None. Every route only reads, so this guards what is read and by whom."""
        if request.method not in ("GET", "HEAD"):
            return f"{request.method} is not served: the review app only reads"
        host = (request.headers.get("Host") or "").lower()
        if host not in self.hosts:
            return (f"Host {host!r} is not served here (serving {', '.join(sorted(self.hosts))}); a page that reaches "
                    "this server under another name is refused")
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() not in {f"http://{h}" for h in self.hosts}:
            return f"a request from {origin!r} is refused: only pages of this server may ask it"
        site, mode = request.headers.get("Sec-Fetch-Site"), request.headers.get("Sec-Fetch-Mode")
        if site == "cross-site" and mode != "navigate":
            return "a cross-site request is refused: only pages of this server may ask it"
        return None

    @property
    def guard(self):
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            why = self.refusal(request)
            if why is not None:
                status = 405 if why.endswith("only reads") else 403
                response = web.Response(status=status, text=why + "\n", headers={"Allow": "GET, HEAD"})
            else:
                try:
                    response = await handler(request)
                except web.HTTPException as e:
                    response = e
            response.headers.update(HEADERS)
            return response

        return guard

    # -- pages ------------------------------------------------------------------------------------

    def page(self, build: Callable[[dict[str, str], dict[str, str]], pages.Page], template: str):
        from aiohttp import web

        async def handler(request):
            match = dict(request.match_info)
            as_json = bool(match.pop("ext", ""))
            if template == "case" and match["case"].endswith(".json"):
                as_json, match["case"] = True, match["case"][: -len(".json")]
            loop = asyncio.get_running_loop()
            data: pages.Page | ErrorPage
            try:  # the ledger is read off the event loop: one slow page never stalls the others
                data = await loop.run_in_executor(None, build, dict(request.query), match)
                status = 200
            except NotFound as e:
                data, status = self._error(404, str(e)), 404
            except pages.BadRequest as e:
                data, status = self._error(400, str(e)), 400
            except GatekeeperError as e:
                data, status = self._error(500, str(e)), 500
            if as_json:
                return web.Response(text=json.dumps(data, indent=1, default=str), status=status,
                                    content_type="application/json")
            html = await loop.run_in_executor(None, self.render, data["page"], data)
            return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")

        return handler

    def _error(self, status: int, message: str) -> ErrorPage:
        try:
            badge = pages.badge(self.source)
        except Exception:  # noqa: BLE001 - the error page must render even when the ledger cannot be read
            badge = {"ok": False, "problem": "the ledger could not be read", "problems": 1, "entries": None, "head": None}
        return {"page": "error", "status": status, "error": message, "integrity": badge}

    def render(self, template: str, data: Mapping[str, object]) -> str:
        return self.env.get_template(f"{template}.html").render(data=data, **data)

    async def home(self, request):
        from aiohttp import web

        raise web.HTTPFound("/flags")

    async def compare_form(self, request):
        """The compare form's GET (?a=&b=): to the compare page's own address."""
        from aiohttp import web

        a, b = request.query.get("a", "").strip(), request.query.get("b", "").strip()
        if not (a.isalnum() and b.isalnum()):
            raise web.HTTPBadRequest(text="give two evaluations: ?a=ID&b=ID (ids or entry hashes)\n")
        raise web.HTTPFound(f"/compare/{a}/{b}")

    async def entry(self, request):
        from aiohttp import web

        loop = asyncio.get_running_loop()
        try:
            entry = await loop.run_in_executor(None, self.source.entry, request.match_info["hash"])
        except NotFound as e:
            raise web.HTTPNotFound(text=f"{e}\n") from None
        if entry["evaluation_id"] is not None:
            raise web.HTTPSeeOther(f"/evaluations/{entry['evaluation_id']}")
        raise web.HTTPSeeOther("/flags" if entry["flag"] else "/integrity")

    async def static(self, request, name: str | None = None):
        from aiohttp import web

        name = name or request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text="no such file\n")
        return web.Response(body=(HERE / "static" / name).read_bytes(), content_type=STATIC[name])


# --- serving -----------------------------------------------------------------------------------------


def bind(listen: str, allow_remote: bool) -> socket.socket:
    """The listening socket. A non-loopback address is refused unless ``allow_remote``: anyone who reaches it
    reads the evidence (outputs, identities, operators), and the app has no login."""
    host, _ = parse_listen(listen, DEFAULT_LISTEN)
    if not loopback(host) and not allow_remote:
        raise GatekeeperError(f"--listen {listen}: {host} is not a loopback address, and anyone who can reach it could "
                              "read the ledger's evidence (model outputs, identities, operators); the app has no login. "
                              "Pass --allow-remote to serve it there anyway, or listen on 127.0.0.1")
    return listening(listen, DEFAULT_LISTEN)


def served_hosts(sock: socket.socket, extra: list[str]) -> set[str]:
    """The Host headers a browser sends to reach this socket: its address, loopback's names, and the names given."""
    host, port = sock.getsockname()[:2]
    names = {f"[{host}]" if ":" in host else host, *extra}
    if loopback(host):
        names |= {"localhost", "127.0.0.1", "[::1]"}
    elif host in ("0.0.0.0", "::"):
        names |= {socket.gethostname(), socket.getfqdn()}
    return {f"{n}:{port}" for n in names}


def serve(source: Source, sock: socket.socket, hosts: set[str], ready: Callable[[str], None]) -> None:
    """Serve until Ctrl-C or SIGTERM. The first integrity check runs before the address is announced."""
    from aiohttp import web

    try:
        source.view()
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    web.run_app(Review(source, hosts).app(), sock=sock, print=lambda *_: ready(url), access_log=None,
                handle_signals=True, shutdown_timeout=5)
