"""A workspace's pipeline (``gatekeeper.Runtime``) behind an OpenAI-shaped chat endpoint, for the real defects that live
in an in-process runtime (transformers) to be served behind ``gatekeeper proxy --guard`` (``bench/guard.py --parts
real``): each side of a flag is one of these, its flag forced on or off, no response cache.

A request names its stage and values beside its messages (``"gatekeeper": {"stage": ..., "values": {...}}``), which the
proxy forwards to both sides unchanged; the answer is the Runtime's, as ``choices[0].message.content``. One request at a
time (the engine is not re-entrant). Prints ``ready PORT`` once it listens.

    python bench/runtime_server.py WORKSPACE --engine NAME --flag FLAG=on|off
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from gatekeeper.runtime import Runtime

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--flag", required=True, help="FLAG=on|off: the side this server is")
    args = ap.parse_args()
    flag, state = args.flag.split("=")
    rt = Runtime(args.workspace, engine=args.engine, response_cache=False, flags={flag: state})
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # the proxy's and the fixtures' readiness checks
            self._reply(200, {"object": "list", "data": [{"id": args.engine}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            asked = body.get("gatekeeper") or {}
            try:
                with lock:
                    c = rt.complete(asked["stage"], asked.get("values", {}))
            except Exception as e:  # noqa: BLE001 - a failed call is the caller's 500, as a server's would be
                return self._reply(500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}})
            self._reply(200, {"object": "chat.completion", "model": args.engine,
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                                           "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.tokens)}})

        def _reply(self, status: int, doc: dict) -> None:
            payload = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"ready {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        rt.close()


if __name__ == "__main__":
    main()
