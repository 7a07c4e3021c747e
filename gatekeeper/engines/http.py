"""The ``http`` adapter: a served model behind an OpenAI-compatible API (llama.cpp's llama-server,
vLLM, SGLang, ...).

The two configurations are two deployments (``url`` with the flag off, ``url_on`` with it on) or
one server with a per-request switch (``cache_switch``, e.g. llama.cpp's ``cache_prompt``), or both.
Generation is ``POST /v1/completions`` with the prompt as token ids and temperature 0, so the
server's own tokenization and decoding are what the gate judges. Text <-> tokens go to the flag-off
server (the baseline) through llama.cpp's ``/apply-template``, ``/tokenize`` and ``/detokenize``.

Token ids come back from ``logprobs`` (llama.cpp puts each token's ``id`` there; vLLM's
``return_token_ids`` as ``token_ids``); top-2 margins are logprob differences, which equal logit
differences. Cached and timing figures come from llama.cpp's ``timings`` (``cache_n``, ``prompt_ms``,
``predicted_ms``), else ``usage.prompt_tokens_details.cached_tokens`` and the request's wall time.

``generate`` is thread-safe and lets at most ``concurrency`` requests be in flight at once.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from time import perf_counter
from typing import Any, Sequence

from .. import __version__
from ..errors import GatekeeperError
from ..identity import digest
from ..workspace import EngineProfile
from .base import Engine, Generation, Session, checked_request

# Fields of llama.cpp's GET /props that describe the deployment and do not change while it runs.
_MEMO = 4096  # rendered and tokenized texts remembered (a battery's prompts repeat across its runs)
_PROPS = ("model_path", "build_info", "chat_template", "total_slots", "modalities", "model_alias")


class HTTPSession(Session):
    """One configuration: the flag-on deployment (``url_on``) and switch with the cache on, the
    flag-off ones otherwise. The servers' caches are their own; a session holds nothing."""

    def __init__(self, model: "HTTPEngine", *, cache: bool = False, results=None):
        super().__init__(model, cache=cache)
        self.model: HTTPEngine = model
        self.config = "on" if cache else "off"
        self._lock = threading.Lock()

    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False
    ) -> Generation:
        g = self.model.complete(self.config, checked_request(prompt, max_tokens), max_tokens, stop, top2)
        with self._lock:
            self.stats.add(g)
        return g


class HTTPEngine(Engine):
    name = "http"
    session_class = HTTPSession
    options = {"request": "extra fields sent with every completion request (a mapping)"}

    @classmethod
    def check(cls, profile: EngineProfile) -> None:
        super().check(profile)
        if not isinstance(profile.options.get("request", {}), dict):
            raise GatekeeperError(f"{profile.where}: field 'options.request': must be a mapping of request fields to values")

    def __init__(self, profile: EngineProfile, *, workspace_root=None):
        super().__init__(profile, workspace_root=workspace_root)
        self.check(profile)
        if not profile.url:
            raise GatekeeperError(f"{self._where}: field 'url' is required for adapter http; "
                                  "set it to the flag-off server's base URL, e.g. http://127.0.0.1:8080")
        self.urls = {"off": profile.url.rstrip("/"), "on": (profile.url_on or profile.url).rstrip("/")}
        self.timeout = float(profile.timeout)
        self.concurrency = int(profile.concurrency)  # the gate may run this many cases at once
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self._memo: dict[tuple, Any] = {}
        # Ask both deployments what they serve now: a server that is down fails here, before the
        # gate writes anything, and the answers are the identity.
        described = {url: self._describe(url) for url in dict.fromkeys(self.urls.values())}
        self.servers = {cfg: described[url] for cfg, url in self.urls.items()}
        self.model_ids = {cfg: (s["models"][0]["id"] if s["models"] else None) for cfg, s in self.servers.items()}

    @property
    def _where(self) -> str:
        return self.profile.where

    # --- the wire -------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; every way it can fail becomes a GatekeeperError naming the URL and the fix."""
        target = url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(target, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise GatekeeperError(f"{target}: HTTP {e.code} {detail}; check that {self._where} points at an "
                                  "OpenAI-compatible server that accepts this request") from None
        except (TimeoutError, socket.timeout):
            raise GatekeeperError(f"{target}: no answer within {self.timeout:g} s; raise 'timeout' in {self._where} "
                                  "or check the server") from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise GatekeeperError(f"{target}: no answer within {self.timeout:g} s; raise 'timeout' in "
                                      f"{self._where} or check the server") from None
            raise GatekeeperError(f"{target}: cannot connect ({reason}); start the server or fix the URL in {self._where}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise GatekeeperError(f"{target}: the answer is not JSON ({raw[:80]!r}); check that {self._where} "
                                  "points at an OpenAI-compatible server") from None

    def _describe(self, url: str) -> dict[str, Any]:
        """What the server says it serves: /v1/models, and llama.cpp's /props where there is one."""
        models = self._call(url, "/v1/models")
        if not isinstance(models, dict) or not isinstance(models.get("data"), list):
            raise GatekeeperError(f"{url}/v1/models: not an OpenAI model list; check that {self._where} "
                                  "points at an OpenAI-compatible server")
        # ``created`` is the time of the request on some servers: keep what names the model only.
        listed = [{k: m.get(k) for k in ("id", "owned_by", "meta") if k in m} for m in models["data"] if isinstance(m, dict)]
        try:
            props = self._call(url, "/props")
        except GatekeeperError:
            props = {}  # not llama.cpp: the model list is all there is
        kept = {k: props[k] for k in _PROPS if isinstance(props, dict) and k in props}
        if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
            kept["n_ctx"] = props["default_generation_settings"].get("n_ctx")
        return {"url": url, "models": listed, "props": kept}

    # --- text <-> tokens: the flag-off server's own ----------------------------------------------
    def _text_op(self, path: str, body: dict[str, Any], field: str) -> Any:
        key = (path, json.dumps(body, sort_keys=True))
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        out = self._call(self.urls["off"], path, body)
        if not isinstance(out, dict) or field not in out:
            raise GatekeeperError(f"{self.urls['off']}{path}: no '{field}' in the answer; the http adapter renders and "
                                  "tokenizes through llama.cpp's /apply-template, /tokenize and /detokenize")
        with self._lock:
            self._memo[key] = out[field]
            if len(self._memo) > _MEMO:  # a long-running pipeline sees endless texts: forget the oldest
                del self._memo[next(iter(self._memo))]
        return out[field]

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self._text_op("/apply-template", {"messages": [dict(m) for m in messages]}, "prompt")

    def tokenize(self, text: str) -> list[int]:
        tokens = self._text_op("/tokenize", {"content": text, "add_special": False, "parse_special": True}, "tokens")
        return [int(t["id"] if isinstance(t, dict) else t) for t in tokens]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._text_op("/detokenize", {"tokens": [int(t) for t in tokens]}, "content")

    # --- generation -----------------------------------------------------------------------------
    def complete(self, config: str, prompt: list[int], max_tokens: int, stop: Sequence[str], top2: bool) -> Generation:
        """One completion from the deployment of ``config`` (off or on)."""
        url = self.urls[config]
        body: dict[str, Any] = {**self.profile.options.get("request", {}),
                                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False,
                                "stop": list(stop), "logprobs": 2, "return_token_ids": True}
        if self.model_ids[config]:
            body["model"] = self.model_ids[config]
        if self.profile.cache_switch:
            body[self.profile.cache_switch] = config == "on"
        with self._slots:
            start = perf_counter()
            answer = self._call(url, "/v1/completions", body)
            wall = perf_counter() - start
        return self._parse(url, answer, prompt, wall, top2)

    def _parse(self, url: str, answer: Any, prompt: list[int], wall: float, top2: bool) -> Generation:
        where = f"{url}/v1/completions"
        try:
            choice = answer["choices"][0]
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError("text")
            logprobs = choice.get("logprobs") or {}
            steps = logprobs.get("content") if isinstance(logprobs, dict) else None
            if isinstance(steps, list) and steps:  # llama.cpp: one entry per generated token, with its id
                tokens = [int(s["id"]) for s in steps]
                margins = [[[int(t["id"]), float(t["logprob"])] for t in s["top_logprobs"][:2]] for s in steps]
            elif isinstance(choice.get("token_ids"), list):  # vLLM with return_token_ids
                tokens, margins = [int(t) for t in choice["token_ids"]], None
            else:  # no ids reported: the server's tokenization of its text is the best there is
                tokens, margins = (self.tokenize(text) if text else []), None
            usage = answer.get("usage") or {}
            timings = answer.get("timings") or {}
            prompt_tokens = int(usage.get("prompt_tokens", len(prompt)))
            if "cache_n" in timings:
                cached = int(timings["cache_n"])
            else:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if "prompt_ms" in timings and "predicted_ms" in timings:
                prefill_s, decode_s = float(timings["prompt_ms"]) / 1000, float(timings["predicted_ms"]) / 1000
            else:  # no split reported: the whole request counts as prefill
                prefill_s, decode_s = wall, 0.0
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise GatekeeperError(f"{where}: not an OpenAI-compatible completion (bad or missing {e}); "
                                  f"check that {self._where} points at an OpenAI-compatible server") from None
        if top2 and margins is not None and any(len(m) < 2 for m in margins):
            margins = None  # a step without two candidates: no margin to report
        return Generation(tokens=tokens, text=text, prompt_tokens=prompt_tokens, cached_tokens=cached,
                          prefill_s=prefill_s, decode_s=decode_s, ttft_s=prefill_s,
                          top2=margins if top2 else None)

    # --- identity -------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        off = self.servers["off"]
        return {
            "engine": self.name,
            "engine_version": __version__,
            "libraries": {"server": off["props"].get("build_info", "unknown")},
            # A served model cannot be hashed from here: what the server reports about it stands in.
            "model_digest": digest({"models": off["models"], "props": {k: v for k, v in off["props"].items() if k != "build_info"}}),
            "adapter_digest": None,
            "dtype": "server",
            "device": "server",
            "prefill": "server",
            "servers": self.servers,
            "cache_switch": self.profile.cache_switch,
            "concurrency": self.concurrency,
            **({"request": self.profile.options["request"]} if self.profile.options.get("request") else {}),
        }

    def close(self) -> None:
        self._memo.clear()
