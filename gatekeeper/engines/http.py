"""The ``http`` adapter: a served model behind an OpenAI-compatible API (llama.cpp's llama-server,
vLLM, mlx_lm.server, ...), spoken to in its own dialect (``dialects.py``; ``auto`` detects it).

The two configurations are two deployments (``url`` with the flag off, ``url_on`` with it on) or
one server with a per-request switch (``cache_switch``, e.g. llama.cpp's ``cache_prompt``), or both.
Generation is ``POST /v1/completions`` at temperature 0, so the server's own tokenization and
decoding are what the gate judges. A session sends each registered stage prefix once, before the
first case that starts with it, so both configurations see the same requests and the cache is warm.

What a call cost is what the server reports (``telemetry.py``); a figure it does not report stays
``None`` (the gate then says ``not_observable:``), except prefill seconds, which fall back to the
request's wall time.

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
from . import telemetry
from ..errors import GatekeeperError
from ..identity import digest
from ..workspace import EngineProfile
from .base import Engine, Generation, Session, Until, checked_request
from .dialects import DIALECTS, detect

_MEMO = 4096  # rendered and tokenized texts remembered (a battery's prompts repeat across its runs)
# Fields of llama.cpp's GET /props that describe the deployment and do not change while it runs.
_PROPS = ("model_path", "build_info", "chat_template", "total_slots", "modalities", "model_alias")


class HTTPSession(Session):
    """One configuration: the flag-on deployment (``url_on``) and switch with the cache on, the
    flag-off ones otherwise. The servers' caches are their own; a session remembers only which
    registered prefixes it has sent."""

    def __init__(self, model: "HTTPEngine", *, cache: bool = False, results=None):
        super().__init__(model, cache=cache)
        self.model: HTTPEngine = model
        self.config = "on" if cache else "off"
        self._lock = threading.Lock()
        self._pins: list[tuple[int, ...]] = []
        self._warm = threading.Lock()

    def pin(self, prefix: Sequence[int]) -> None:
        self._pins.append(tuple(int(t) for t in prefix))

    def _warm_up(self, prompt: list[int]) -> None:
        """Send the registered prefix this prompt starts with, once, before it (not counted in stats)."""
        with self._warm:
            for pin in self._pins:
                if len(pin) < len(prompt) and tuple(prompt[: len(pin)]) == pin:
                    self.model.complete(self.config, list(pin), 1, (), warm=True)
                    self._pins.remove(pin)
                    return

    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
        until: Until | None = None,
    ) -> Generation:
        request = checked_request(prompt, max_tokens)
        if self._pins:
            self._warm_up(request)
        g = self.model.complete(self.config, request, max_tokens, stop)
        if not top2:
            g.top2 = None
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
        self.dialect_name = profile.dialect  # until detected: messages during the first requests name it
        # Ask both deployments what they serve now: a server that is down fails here, before the
        # gate writes anything, and the answers are the identity.
        described = {url: self._describe(url) for url in dict.fromkeys(self.urls.values())}
        self.servers = {cfg: described[url] for cfg, url in self.urls.items()}
        self.model_ids = {cfg: (s["models"][0]["id"] if s["models"] else None) for cfg, s in self.servers.items()}
        if profile.dialect == "auto":
            self.dialect_name, self.detected = detect(self.servers["off"])
        else:
            self.dialect_name, self.detected = profile.dialect, "set in the profile"
        self.dialect = DIALECTS[self.dialect_name](self)
        self.granularity = self.dialect.granularity(self.urls["on"])

    @property
    def _where(self) -> str:
        return self.profile.where

    # --- the wire -------------------------------------------------------------------------------
    def _raw(self, url: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """One request; every way it can fail becomes a GatekeeperError naming the URL and the fix."""
        target = url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(target, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        late = (f"{target}: no answer within {self.timeout:g} s; raise 'timeout' in {self._where} or check the server")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise GatekeeperError(f"{target}: HTTP {e.code} {detail}; check that {self._where} points at an "
                                  f"OpenAI-compatible server that accepts this request (dialect {self.dialect_name})") from None
        except (TimeoutError, socket.timeout):
            raise GatekeeperError(late) from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise GatekeeperError(late) from None
            raise GatekeeperError(f"{target}: cannot connect ({reason}); start the server or fix the URL in {self._where}") from None

    def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        raw = self._raw(url, path, body)
        try:
            return json.loads(raw)
        except ValueError:
            raise GatekeeperError(f"{url}{path}: the answer is not JSON ({raw[:80]!r}); check that {self._where} "
                                  "points at an OpenAI-compatible server") from None

    def call_text(self, url: str, path: str) -> str:
        return self._raw(url, path).decode(errors="replace")

    def _describe(self, url: str) -> dict[str, Any]:
        """What the server says it serves: /v1/models, and llama.cpp's /props where there is one."""
        models = self.call(url, "/v1/models")
        if not isinstance(models, dict) or not isinstance(models.get("data"), list):
            raise GatekeeperError(f"{url}/v1/models: not an OpenAI model list; check that {self._where} "
                                  "points at an OpenAI-compatible server")
        # ``created`` is the time of the request on some servers: keep what names the model only.
        listed = [{k: m.get(k) for k in ("id", "owned_by", "meta", "root", "max_model_len") if k in m}
                  for m in models["data"] if isinstance(m, dict)]
        try:
            props = self.call(url, "/props")
        except GatekeeperError:
            props = {}  # not llama.cpp: the model list is all there is
        kept = {k: props[k] for k in _PROPS if isinstance(props, dict) and k in props}
        if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
            kept["n_ctx"] = props["default_generation_settings"].get("n_ctx")
        return {"url": url, "models": listed, "props": kept}

    # --- text <-> tokens: the flag-off server's own, or the profile's tokenizer ------------------
    def text_op(self, path: str, body: dict[str, Any], field: str) -> Any:
        key = (path, json.dumps(body, sort_keys=True))
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        out = self.call(self.urls["off"], path, body)
        if not isinstance(out, dict) or field not in out:
            raise GatekeeperError(f"{self.urls['off']}{path}: no '{field}' in the answer; the {self.dialect_name} "
                                  f"dialect expects it (set 'dialect' in {self._where} if the server speaks another)")
        with self._lock:
            self._memo[key] = out[field]
            if len(self._memo) > _MEMO:  # a long-running pipeline sees endless texts: forget the oldest
                del self._memo[next(iter(self._memo))]
        return out[field]

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self.dialect.render(messages)

    def tokenize(self, text: str) -> list[int]:
        return self.dialect.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.dialect.detokenize(tokens)

    # --- generation -----------------------------------------------------------------------------
    def complete(self, config: str, prompt: list[int], max_tokens: int, stop: Sequence[str], warm: bool = False) -> Generation:
        """One completion from the deployment of ``config`` (off or on); ``warm``: a prefix sent ahead."""
        url = self.urls[config]
        body: dict[str, Any] = {**self.profile.options.get("request", {}), **self.dialect.request(prompt),
                                "max_tokens": max_tokens, "temperature": 0, "stream": False, "stop": list(stop)}
        if self.model_ids[config]:
            body["model"] = self.model_ids[config]
        if self.profile.cache_switch:
            body[self.profile.cache_switch] = config == "on"
        with self._slots:
            start = perf_counter()
            answer = self.call(url, "/v1/completions", body)
            wall = perf_counter() - start
        return self._parse(url, answer, prompt, wall)

    def _parse(self, url: str, answer: Any, prompt: list[int], wall: float) -> Generation:
        where = f"{url}/v1/completions"
        try:
            choice = answer["choices"][0]
            text = choice["text"]
            if not isinstance(text, str):
                raise TypeError("text")
            tokens, margins = self._tokens(choice, text)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise GatekeeperError(f"{where}: not an OpenAI-compatible completion (bad or missing {e}); "
                                  f"check that {self._where} points at an OpenAI-compatible server") from None
        if margins is not None and (len(margins) != len(tokens) or any(len(m) < 2 for m in margins)):
            margins = None  # a step without two candidates: no margin to report
        t = telemetry.read(answer)
        prefill = t.prefill_s if t.prefill_s is not None else wall  # no split reported: the request is the prefill
        return Generation(tokens=tokens, text=text, prompt_tokens=t.prompt_tokens if t.prompt_tokens is not None else len(prompt),
                          cached_tokens=t.cached_tokens, prefill_s=prefill, decode_s=t.decode_s or 0.0,
                          ttft_s=prefill, top2=margins)

    def _tokens(self, choice: dict[str, Any], text: str) -> tuple[list[int], list | None]:
        """Generated token ids and top-2 [[id, logprob], ...] per step, in whichever shape the server uses."""
        logprobs = choice.get("logprobs") or {}
        steps = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(steps, list) and steps:  # llama.cpp, mlx_lm.server: one entry per token, with ids
            tokens = [self.dialect.step_token(s) for s in steps]
            margins = [[[_key(t.get("id", t.get("token"))), float(t["logprob"])] for t in _best(s.get("top_logprobs") or [])]
                       for s in steps]
            return tokens, margins
        legacy = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        margins = ([[[_key(k), float(v)] for k, v in sorted(step.items(), key=lambda kv: -kv[1])[:2]] for step in legacy]
                   if isinstance(legacy, list) and all(isinstance(x, dict) for x in legacy) else None)
        if isinstance(choice.get("token_ids"), list):  # vLLM with return_token_ids
            return [int(t) for t in choice["token_ids"]], margins
        # no ids reported: the tokenization of its text is the best there is
        return (self.tokenize(text) if text else []), margins

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
            "dialect": {"name": self.dialect_name, "detected": self.detected},
            "cache_granularity": self.granularity,
            "cache_switch": self.profile.cache_switch,
            "concurrency": self.concurrency,
            **({"tokenizer": self.profile.tokenizer} if self.profile.tokenizer else {}),
            **({"request": self.profile.options["request"]} if self.profile.options.get("request") else {}),
        }

    def close(self) -> None:
        self._memo.clear()


def _best(top: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The two most likely candidates (some servers list them in no set order)."""
    return sorted(top, key=lambda t: -float(t["logprob"]))[:2]


def _key(token: Any) -> Any:
    """A candidate's id: an int where the server gives one (vLLM's ``token_id:N`` too), else its text."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    return int(token) if isinstance(token, int) else token
