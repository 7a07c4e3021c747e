"""A pass-through in front of an OpenAI-compatible server that meters live traffic without changing it.

A team that already runs a pipeline against llama-server, ik_llama.cpp, vLLM, mlx_lm.server or
Ollama's OpenAI API points its client here instead: every request and response goes through
unchanged (bodies byte for byte, server-sent events passed on as they arrive, never buffered), and
each completion call adds one line to a local capture (``captures/capture.py``): ``stage``, ``stream``,
``t``, the rendered prompt (text, and token ids where the upstream tokenizes), and the call's
telemetry as the upstream reported it (``engines/served/telemetry.py``; absent figures left out, never 0).
``analyze`` on that file gives the per-stage prefill tax and the byte-stable prefix share, from
live traffic, before anything is built.

Built on aiohttp (server and client in one asyncio loop). Rendering (llama.cpp's
``/apply-template``, ``/tokenize``, ``/detokenize``) happens after the client has its answer, in
the background, so it never delays a call. Upstream down: 502 with a body that says so; no answer
in ``timeout`` seconds: 504; an upstream that dies mid-stream: the client's stream is cut (after
an SSE ``error`` event), so it sees an error rather than a short answer; the proxy keeps serving.

With ``--guard FLAG`` (``guarded.py``) the proxy also watches a flag that is on: a share of answered calls goes
again to the flag-off side after the client has its answer, and ``GET /metrics`` is the guard's (Prometheus).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import urlsplit

from ...engines.served.telemetry import Telemetry
from ...engines.served.telemetry import read as read_telemetry
from ...errors import GatekeeperError
from ...listen import bind, parse_listen
from ..captures.capture import CaptureWriter, check_path, metadata

if TYPE_CHECKING:
    import aiohttp

    from .guarded import Guarded

COMPLETIONS = {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"}
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
       "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
KEEP = 64 << 20  # bytes of a non-streamed answer kept to read its telemetry; larger answers pass unread


def _error(status: int, kind: str, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": f"gatekeeper proxy: {message}", "type": kind, "code": status}},
                             status=status)


EXAMPLE = "127.0.0.1:8081"  # what --listen looks like


def check_upstream(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise GatekeeperError(f"--upstream {url!r}: give the server's base URL, e.g. http://127.0.0.1:8080")
    return url.rstrip("/")


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass
class Call:
    """What one completion request says about itself, read from its headers and JSON body."""

    t: float
    path: str
    stage: str
    stream: str
    messages: list | None = None
    prompt: Any = None

    @classmethod
    def of(cls, t: float, path: str, headers, body: bytes) -> "Call | None":
        try:
            d = json.loads(body) if body else None
        except ValueError:
            d = None
        if not isinstance(d, dict):
            return None  # not a JSON completion: forwarded, not captured
        model = d.get("model") if isinstance(d.get("model"), str) and d.get("model") else "default"
        messages = d.get("messages") if isinstance(d.get("messages"), list) else None
        stage = headers.get("X-Gatekeeper-Stage")
        if not stage:
            first = (messages or [{}])[0]
            system = _text(first.get("content")) if isinstance(first, dict) and first.get("role") == "system" else ""
            stage = f"{model}/{hashlib.sha256(system.encode()).hexdigest()[:12]}" if system else model
        stream = headers.get("X-Gatekeeper-Stream") or (str(d["user"]) if isinstance(d.get("user"), (str, int)) else "default")
        return cls(t, path, stage, stream, messages, d.get("prompt"))


def key_of(headers, call: Call) -> str:
    """A request's rollout key (gate/state/rollout.py): the X-Gatekeeper-Key header, else its stream (the
    X-Gatekeeper-Stream header or the request's ``user``), else its first user message or its prompt: one conversation,
    one side."""
    if key := headers.get("X-Gatekeeper-Key"):
        return key
    if call.stream != "default":
        return call.stream
    users = [m.get("content") for m in call.messages or [] if isinstance(m, dict) and m.get("role") == "user"]
    return json.dumps(users[0] if users else call.prompt, sort_keys=True)


class Tap:
    """Reads telemetry off a response as it passes: the last SSE event carrying ``timings`` or
    ``usage``, or a whole JSON answer. Keeps no more than it needs."""

    def __init__(self, sse: bool):
        self.sse, self.buffer, self.kept, self.last = sse, b"", 0, None

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            self.kept += len(chunk)
            self.buffer = self.buffer + chunk if self.kept <= KEEP else b""
            return
        self.buffer += chunk
        *events, self.buffer = self.buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            if b'"timings"' in event or b'"usage"' in event:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        try:
                            self.last = json.loads(line[5:])
                        except ValueError:
                            pass

    def telemetry(self) -> Telemetry:
        if not self.sse and self.buffer and self.kept <= KEEP:
            try:
                return read_telemetry(json.loads(self.buffer))
            except ValueError:
                return Telemetry()
        return read_telemetry(self.last)


class Proxy:
    def __init__(self, upstream: str, capture: str | Path | None, *, no_text: bool = False, timeout: float = 600.0,
                 guard: Guarded | None = None):
        self.upstream = check_upstream(upstream)
        self.writer = CaptureWriter(capture) if capture is not None else None
        self.guard = guard
        self.t0 = time.perf_counter()
        self.no_text, self.timeout = no_text, float(timeout)
        self.salt = os.urandom(16)  # digests on --no-text lines cannot be looked up against known prompts
        self.can = {"/apply-template": True, "/tokenize": True, "/detokenize": True}
        self.pending: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None  # opened on the app's startup

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        if self.guard is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        import aiohttp

        # A fresh connection per call: a kept-alive one can be closed by the server (its keep-alive timeout) just
        # as a POST goes out on it, which aiohttp does not retry, so the client would get a 502 for nothing.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=min(10.0, self.timeout), sock_read=self.timeout),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        if self.guard is not None:
            self.ticking = asyncio.get_running_loop().create_task(self.guard.tick())

    async def _close(self, app) -> None:
        if self.guard is not None:
            self.ticking.cancel()
            await self.guard.close()
        if self.pending:
            await asyncio.wait(self.pending, timeout=30)
        assert self.session is not None  # _open ran on startup
        await self.session.close()
        if self.writer is not None:
            self.writer.close()

    def now(self) -> float:
        return self.writer.now() if self.writer is not None else round(time.perf_counter() - self.t0, 6)

    async def metrics(self, request):
        from aiohttp import web

        assert self.guard is not None  # the route exists only with a guard
        return web.Response(text=self.guard.metrics(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def handle(self, request):
        import aiohttp
        from aiohttp import web

        t, began = self.now(), time.monotonic()
        body = await request.read()
        call = Call.of(t, request.path, request.headers, body) if request.method == "POST" and request.path in COMPLETIONS else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        # after a rollback every request goes to the flag-off side; during a rollout, those whose key is not yet in its share
        on = self.guard is None or (self.guard.current() and (call is None or self.guard.serves(key_of(request.headers, call))))
        guard = self.guard if call is not None and on else None  # the guard compares what the flag-on side served
        url = (self.upstream if on or self.guard is None else self.guard.other) + request.raw_path
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        def offer(status: int, answer: bytes | None, sse: bool, error: str | None = None) -> None:
            """The guard sees every completion call once it has ended, failed ones too (a failure is evidence)."""
            if guard is not None and call is not None:
                guard.offer(self.session, request.path, call.stage, {"Content-Type": "application/json", **auth}, body,
                            status, answer, sse, error, seconds=time.monotonic() - began)

        try:
            upstream = await self.session.request(request.method, url, headers=headers, data=body or None,
                                                  allow_redirects=False)
        except asyncio.TimeoutError:
            self._record(call, 504, Telemetry(), "upstream timeout")
            offer(0, None, False, f"no answer within {self.timeout:g} s")
            return _error(504, "upstream_timeout", f"{url} did not answer within {self.timeout:g} s; "
                          "the server is busy or stuck (raise --timeout if it is just slow)")
        except aiohttp.ClientError as e:
            self._record(call, 502, Telemetry(), "upstream unreachable")
            offer(0, None, False, f"unreachable ({type(e).__name__})")
            return _error(502, "upstream_unreachable", f"cannot reach {self.upstream} ({e}); start the server "
                          "or fix --upstream")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP or k.lower() == "content-length":  # same bytes, so the same length
                    response.headers.add(k, v)
            sse = upstream.content_type == "text/event-stream"
            tap = Tap(sse) if call is not None else None
            answer: bytearray | None = bytearray() if guard is not None and guard.on else None
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    try:
                        await response.write(chunk)
                    except ConnectionResetError:  # the client went away; dropping the answer cancels it upstream
                        return response
                    if tap is not None:
                        tap.feed(chunk)
                    if answer is not None:
                        if len(answer) + len(chunk) <= KEEP:
                            answer += chunk
                        else:
                            answer = None  # too long to keep: not shadowed (counted as unreadable)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                self._record(call, upstream.status, tap.telemetry() if tap else Telemetry(), f"upstream failed mid-answer: {e}")
                if sse:
                    message = {"error": {"message": f"gatekeeper proxy: {self.upstream} failed mid-stream ({e})",
                                         "type": "upstream_failed", "code": 502}}
                    await response.write(b"data: " + json.dumps(message).encode() + b"\n\n")
                if request.transport is not None:
                    request.transport.close()  # no end of body: the client sees an incomplete answer
                offer(upstream.status, None, sse, f"failed mid-answer ({type(e).__name__})")
                return response
            await response.write_eof()
        self._record(call, upstream.status, tap.telemetry() if tap else Telemetry(), None)
        offer(upstream.status, bytes(answer) if answer is not None else None, sse)  # the client has its whole answer
        return response

    # --- the capture -----------------------------------------------------------------------------
    def _record(self, call: Call | None, status: int, telemetry: Telemetry, error: str | None) -> None:
        if call is None or self.writer is None:
            return
        duration = round(self.writer.now() - call.t, 6)  # now: the answer has ended (or failed)
        task = asyncio.get_running_loop().create_task(self._write(call, duration, status, telemetry, error))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _post(self, path: str, body: dict) -> Any:
        """llama.cpp's text endpoints, straight to the upstream; None where it has none (asked once)."""
        if not self.can[path]:
            return None
        try:
            assert self.session is not None  # _open ran on startup
            async with self.session.post(self.upstream + path, json=body) as r:
                if r.status == 404:
                    self.can[path] = False
                return await r.json() if r.status == 200 else None
        except Exception:  # noqa: BLE001 - rendering is best effort; the call itself went through
            return None

    async def _render(self, call: Call) -> tuple[str | None, list[int] | None, str]:
        """(text, tokens, how): the prompt as the server renders it, else an approximation."""
        if call.messages is not None:
            out = await self._post("/apply-template", {"messages": call.messages})
            if isinstance(out, dict) and isinstance(out.get("prompt"), str):
                text, how = out["prompt"], "server"
            else:  # no template endpoint: role-tagged concatenation, stable where the messages are
                text = "".join(f"<|{m.get('role')}|>\n{_text(m.get('content'))}\n" for m in call.messages if isinstance(m, dict))
                how = "approximate"
        elif isinstance(call.prompt, str):
            text, how = call.prompt, "server"
        elif isinstance(call.prompt, list) and call.prompt and all(isinstance(x, int) for x in call.prompt):
            out = await self._post("/detokenize", {"tokens": call.prompt})
            text = out.get("content") if isinstance(out, dict) and isinstance(out.get("content"), str) else None
            return text, list(call.prompt), "server"
        else:
            return None, None, "none"
        out = await self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})
        tokens = out.get("tokens") if isinstance(out, dict) and isinstance(out.get("tokens"), list) else None
        if tokens is not None and not all(isinstance(x, int) for x in tokens):
            tokens = None  # a server answering with pieces: no ids
        return text, tokens, how

    async def _write(self, call: Call, duration: float, status: int, telemetry: Telemetry, error: str | None) -> None:
        text, tokens, how = await self._render(call)
        record: dict[str, Any] = {"stage": call.stage, "stream": call.stream, "t": call.t, "duration_s": duration,
                                  "path": call.path, "status": status, "render": how}
        if self.no_text:
            if text is not None:
                record.update(metadata(text, self.salt))
            if tokens is not None:
                record["n_tokens"] = len(tokens)
        else:
            record.update({k: v for k, v in (("text", text), ("tokens", tokens)) if v is not None})
        if error:
            record["error"] = error
        if "text" in record or "tokens" in record or "bytes" in record:
            assert self.writer is not None  # _record writes nothing without a capture
            self.writer.write_record(record, telemetry)


def serve(upstream: str, listen: str, capture: str | Path | None, *, no_text: bool = False, timeout: float = 600.0,
          ready=None, guard: Guarded | None = None) -> None:
    """Run until interrupted (Ctrl-C or SIGTERM); the capture is flushed line by line and closed at the end, and
    the guard's last batch written."""
    from aiohttp import web

    host, _ = parse_listen(listen, EXAMPLE)
    if capture is not None:
        check_path(capture)
    check_upstream(upstream)
    sock = bind(listen, EXAMPLE)  # bound before the capture is opened: a port in use writes nothing
    proxy = Proxy(upstream, capture, no_text=no_text, timeout=timeout, guard=guard)

    def printed(*_args: Any) -> None:
        if ready is not None:
            ready(f"http://{host}:{sock.getsockname()[1]}", proxy.upstream)

    web.run_app(proxy.app(), sock=sock, print=printed, access_log=None, handle_signals=True, shutdown_timeout=5)


@contextmanager
def running(upstream: str, capture: str | Path | None, *, host: str = "127.0.0.1", no_text: bool = False,
            timeout: float = 600.0, guard: Guarded | None = None) -> Iterator[str]:
    """The proxy on a free port in a background thread (for benchmarks and embedding); yields its URL."""
    from aiohttp import web

    proxy = Proxy(upstream, capture, no_text=no_text, timeout=timeout, guard=guard)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(proxy.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
