"""The OpenFeature Remote Evaluation Protocol (OFREP) over HTTP, read-only, answered from a ``Resolver``.

    POST /ofrep/v1/evaluate/flags/{key}   one flag: 200 {key, value, reason, variant, metadata}
    POST /ofrep/v1/evaluate/flags         every flag: 200 {flags: [...]} with an ETag; If-None-Match -> 304
    GET  /ofrep/v1/configuration          what this server supports (booleans; polling)

The request body is ``{"context": {...}}`` (optional; flag states do not depend on it). Errors carry OFREP's
``errorCode`` and ``errorDetails``: an unknown flag is 404 FLAG_NOT_FOUND; a body that is not JSON is 400
PARSE_ERROR, a context that is not an object 400 INVALID_CONTEXT; a ledger that does not verify or cannot be
read (the resolver's failure rule) is 500 GENERAL on every flag and on bulk, never a 304 and never a value.
Values are booleans: OFREP requests name no type (its ADR 3), so a client asking for another type reports
its own TYPE_MISMATCH.

Built on aiohttp, one asyncio loop; a rebuild of the snapshot (after the ledger or workspace changed) runs in
a worker thread, and requests that arrive meanwhile wait for that one rebuild.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from ..errors import GatekeeperError
from ..identity import digest
from ..listen import bind
from .resolve import FlagNotFound, Resolution, Resolver, Snapshot

PREFIX = "/ofrep/v1"
DEFAULT_LISTEN = "127.0.0.1:8016"
MIN_POLL_MS = 1000  # what /configuration tells polling clients: a poll of an unchanged ledger is cheap


def evaluation(r: Resolution) -> dict[str, Any]:
    return {"key": r.key, "value": r.value, "reason": r.reason, "variant": r.variant, "metadata": r.metadata}


def etag(snapshot: Snapshot) -> str:
    return f'"{snapshot.version[:32]}"'


def not_modified(if_none_match: str | None, tag: str) -> bool:
    """RFC 9110's weak comparison against a list of entity tags, or ``*``."""
    if not if_none_match:
        return False
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or tag in (t[2:] if t.startswith("W/") else t for t in tags)


class Ofrep:
    """The aiohttp application: its handlers read one ``Resolver``."""

    def __init__(self, resolver: Resolver):
        self.resolver = resolver
        self._bulk: tuple[str, bytes] = ("", b"")  # (snapshot version, its bulk body), made once per version

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=1 << 20)
        app.router.add_post(f"{PREFIX}/evaluate/flags/{{key}}", self.single)
        app.router.add_post(f"{PREFIX}/evaluate/flags", self.bulk)
        app.router.add_get(f"{PREFIX}/configuration", self.configuration)
        return app

    async def snapshot(self) -> Snapshot:
        # The cheap check runs here; only a rebuild (verify, engine identity) leaves the event loop.
        snapshot = self.resolver.fresh()
        if snapshot is None:
            snapshot = await asyncio.get_running_loop().run_in_executor(None, self.resolver.snapshot)
        return snapshot

    async def single(self, request):
        from aiohttp import web

        key = request.match_info["key"]
        if (bad := await _bad_request(request)) is not None:
            return web.json_response({"key": key, **bad}, status=400)
        try:
            resolution = (await self.snapshot()).resolve(key).for_key(await _targeting_key(request))
        except FlagNotFound as e:
            return web.json_response({"key": key, "errorCode": e.code, "errorDetails": str(e)}, status=404)
        except GatekeeperError as e:
            return web.json_response({"key": key, "errorCode": "GENERAL", "errorDetails": str(e)}, status=500)
        return web.json_response(evaluation(resolution))

    async def bulk(self, request):
        from aiohttp import web

        if (bad := await _bad_request(request)) is not None:
            return web.json_response(bad, status=400)
        snapshot = await self.snapshot()
        if snapshot.error is not None:  # never a 304 here: a client's cached "on" must not stand
            return web.json_response({"errorCode": "GENERAL", "errorDetails": snapshot.error}, status=500)
        tag = etag(snapshot)
        if any(r.share < 1 for r in snapshot.flags.values()):  # a rollout: the values depend on the targeting key
            targeting = await _targeting_key(request)
            tag = tag[:-1] + "-" + digest([targeting])[:12] + '"'
            if not_modified(request.headers.get("If-None-Match"), tag):
                return web.Response(status=304, headers={"ETag": tag})
            return web.json_response({"flags": [evaluation(r.for_key(targeting)) for r in snapshot.flags.values()]},
                                     headers={"ETag": tag})
        if not_modified(request.headers.get("If-None-Match"), tag):
            return web.Response(status=304, headers={"ETag": tag})
        if self._bulk[0] != snapshot.version:
            flags = [evaluation(r) for r in snapshot.flags.values()]
            self._bulk = (snapshot.version, json.dumps({"flags": flags}).encode())
        return web.Response(body=self._bulk[1], content_type="application/json", headers={"ETag": tag})

    async def configuration(self, request):
        from aiohttp import web

        return web.json_response({"name": "gatekeeper", "capabilities": {
            "cacheInvalidation": {"polling": {"enabled": True, "minPollingIntervalMs": MIN_POLL_MS}},
            "flagEvaluation": {"supportedTypes": ["boolean"]}}})


async def _bad_request(request) -> dict[str, str] | None:
    """The OFREP error for a body that is not ``{"context": {...}}`` (either part may be left out), else None."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except ValueError as e:
        return {"errorCode": "PARSE_ERROR", "errorDetails": f"the request body is not JSON ({e}); send {{\"context\": {{...}}}}"}
    if not isinstance(body, dict):
        return {"errorCode": "PARSE_ERROR", "errorDetails": "the request body is not a JSON object; send {\"context\": {...}}"}
    if "context" in body and body["context"] is not None and not isinstance(body["context"], dict):
        return {"errorCode": "INVALID_CONTEXT", "errorDetails": "'context' is not an object of attributes"}
    return None


async def _targeting_key(request) -> str | None:
    """The evaluation context's ``targetingKey`` (a checked body), or None."""
    raw = await request.read()
    context = (json.loads(raw) if raw.strip() else {}).get("context") or {}
    key = context.get("targetingKey")
    return key if isinstance(key, str) and key else None


def serve(resolver: Resolver, listen: str = DEFAULT_LISTEN,
          ready: Callable[[str, Snapshot], None] | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM. The first snapshot (verify, engine identity) is made before the address is
    announced, so a client's first request is answered at once."""
    from aiohttp import web

    sock = bind(listen, DEFAULT_LISTEN)
    try:
        first = resolver.snapshot()
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def printed(*_args: Any) -> None:
        if ready is not None:
            ready(url, first)

    web.run_app(Ofrep(resolver).app(), sock=sock, print=printed, access_log=None, handle_signals=True,
                shutdown_timeout=5)
