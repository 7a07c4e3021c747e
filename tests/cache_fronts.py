"""A front in front of a real llama-server that plants the faults real prefix caches have, on the paths a
battery of independent cases never takes, or that crashes the way a server does mid-request.

Modes (what the front does to POST /v1/completions; everything else is forwarded unchanged):
- ``none``: forwards (the control);
- ``stale_repeat``: a prompt identical to the one before it is answered from the state before that one;
- ``inside_empty``: a prompt wholly inside the previous prompt and its answer is answered on its first token only;
- ``continuation_skip``: a prompt that continues the previous prompt and answer loses the answer's tokens (a
  cache that never held what it generated; one lost token at the join did not change this model's answers);
- ``lost_window``: a continuation longer than ``window`` tokens loses everything older than the window;
- ``drop``: reads the request, then closes the connection without an answer (a crash mid-request);
- ``suffix_count``: answers with ``usage.prompt_tokens`` counting only the tokens it did not take from its cache;
- ``odd_logprobs``: answers with its logprobs in a shape no dialect reads.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class History:
    """The prompts and answers the front has seen, in order."""

    def __init__(self):
        self.seen: list[tuple[list[int], list[int]]] = []
        self.max_tokens: list[int] = []  # each request's
        self.planted = 0  # requests the fault changed

    def rewrite(self, mode: str, prompt: list[int], window: int) -> list[int]:
        if not self.seen:
            return prompt
        last, answer = self.seen[-1]
        held = last + answer
        if mode == "stale_repeat" and prompt == last and len(self.seen) >= 2:
            return self._planted(self.seen[-2][0])
        if mode == "inside_empty" and prompt != last and len(prompt) < len(held) and held[: len(prompt)] == prompt:
            return self._planted(prompt[:1])
        held = last + answer[:-1]  # the answer's last token is never fed back
        if mode == "continuation_skip" and answer and len(prompt) > len(held) and prompt[: len(held)] == held:
            return self._planted(prompt[: len(last)] + prompt[len(held):])  # the answer's tokens
        if mode == "lost_window" and len(prompt) > window and len(prompt) > len(held) > 0 and prompt[: len(held)] == held:
            return self._planted(prompt[:1] + prompt[-(window - 1):])
        return prompt

    def _planted(self, prompt: list[int]) -> list[int]:
        self.planted += 1
        return prompt


@contextmanager
def cache_front(upstream: str, mode: str, window: int = 512):
    """A front on a free loopback port; yields (its URL, its History)."""
    history = History()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, payload: bytes):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _forward(self, body: bytes | None) -> bytes:
            req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    payload = r.read()
                    if self.path == "/v1/completions" and mode in ("suffix_count", "odd_logprobs"):
                        payload = json.dumps(_misreport(mode, json.loads(payload))).encode()
                    self._send(r.status, payload)
                    return payload
            except urllib.error.HTTPError as e:
                self._send(e.code, e.read())
                return b""

        def do_GET(self):
            self._forward(None)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/completions":
                self._forward(body)
                return
            if mode == "drop":  # the request was read: close without a status line
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            request = json.loads(body)
            with lock:  # one request at a time: the history is the order the server saw
                prompt = request["prompt"]
                history.max_tokens.append(request["max_tokens"])
                request["prompt"] = history.rewrite(mode, prompt, window)
                answer = json.loads(self._forward(json.dumps(request).encode()) or b"{}")
                steps = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
                history.seen.append((prompt, [s["id"] for s in steps if isinstance(s, dict)]))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", history
    finally:
        server.shutdown()
        server.server_close()


def _misreport(mode: str, answer: dict) -> dict:
    if mode == "suffix_count":
        usage = answer["usage"]
        usage["prompt_tokens"] -= answer["timings"]["cache_n"]
        del answer["timings"]  # so the count is read from usage
        usage["prompt_tokens_details"] = {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
    else:
        choice = answer["choices"][0]
        choice["logprobs"] = {"steps": [[s["token"], s["logprob"]] for s in choice["logprobs"]["content"]]}
    return answer
