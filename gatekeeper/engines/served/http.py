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

A side may list several replicas (``url: [A, B]``): every replica must describe itself as the first does
(the same model, server build and settings), calls go to the replica with the fewest in flight (then the
least used), and each call records which replica answered. ``load`` keeps background requests in flight
beside the battery's, as production traffic would be batched with them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from time import perf_counter
from typing import Any, Mapping, Sequence, cast

from ... import __version__
from ...errors import EngineCrash, GatekeeperError
from ...evidence import Top2
from ...identity import digest, flatten
from ...summaries import SamplerChain
from ...workspace import Decoding, EngineProfile
from .. import sampler
from ..base import (
    Engine,
    Generation,
    Referenced,
    Scored,
    Session,
    Until,
    attention_limits,
    checked_request,
    labelled,
    request_labels,
)
from ..sampler import Draw, fresh
from . import serve, telemetry
from .dialects import (
    DIALECTS,
    PROMPT_TOP_K,
    Candidate,
    Choice,
    Completion,
    CompletionRequest,
    Described,
    ListedModel,
    PromptLogprob,
    Props,
    detect,
)

# A server's reference read covers the first position of each answer: there the arm's token comes from a prefill's
# last row, as the forced read's does, and a reused prefix shows first. Later positions are decode steps, whose
# kernels a forced prefill does not share (llama-server on the default Q4_1 model: 0.3 nats apart with no cache
# involved, measured), so a server's own read cannot judge them; it costs one request per turn. Nor are its gaps
# judged: a prefix the arm reused holds keys and values its decode computed, which the cold read recomputes with
# prefill kernels (0.03 to 0.13 nats apart in a gap on that model, no defect involved); only clear flips count.
FORCED_AT = (0,)


def scored_at(n: int) -> list[int]:
    """Where the distance reads an answer of ``n`` tokens on a server that gives no prompt log-probabilities, one
    request each: the first position (a reused prefix ends where the answer starts), the middle and the last (past any
    cache structure); three requests per turn and side however long the answer."""
    return sorted({0, n // 2, n - 1}) if n else []


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
        self._pins: list[tuple[tuple[int, ...], dict[str, str]]] = []  # prefix, labels when registered
        self._warm = threading.Lock()

    def pin(self, prefix: Sequence[int]) -> None:
        # the prefix's warm-up is labelled as it was registered (its stage), not as the case that sends it
        self._pins.append((tuple(int(t) for t in prefix), request_labels()))

    def _warm_up(self, prompt: list[int], max_tokens: int, stop: Sequence[str]) -> None:
        """Send the registered prefix this prompt starts with, once per replica, before it (not counted in stats).
        It ends the way the case's own request ends (its max_tokens and stop), so the server is left in a state
        the battery's requests also leave it in: a generation cut short at one token is a path of its own."""
        with self._warm:
            for pin, labels in self._pins:
                if len(pin) < len(prompt) and tuple(prompt[: len(pin)]) == pin:
                    with labelled(stage=labels.get("stage"), stream=labels.get("stream")):
                        for url in self.model.replicas[self.config]:
                            self.model.complete(self.config, list(pin), max_tokens, stop, warm=True, replica=url)
                    self._pins.remove((pin, labels))
                    return

    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
        until: Until | None = None, sampling: Draw | None = None,
    ) -> Generation:
        request = checked_request(prompt, max_tokens)
        if self._pins and self.model.profile.warm_up:
            self._warm_up(request, max_tokens, stop)
        g = self.model.complete(self.config, request, max_tokens, stop, sampling=sampling)
        if not top2:
            g.top2 = None
        with self._lock:
            self.stats.add(g)
        return g

    def score(self, prompt: Sequence[int], continuation: Sequence[int], top_k: int | None = None) -> Scored | None:
        """The server's own top-k log-probabilities at each position of ``continuation`` (its prompt log-probabilities:
        vLLM's ``prompt_logprobs``), or None where its dialect cannot ask for them (``Dialect.unscored``)."""
        if self._pins and self.model.profile.warm_up:  # as a case would: the stage prefix is sent first
            self._warm_up(list(prompt), 1, ())
        scored = self.model.score(self.config, list(prompt), list(continuation))
        return scored if scored is None or top_k is None else scored.top(min(top_k, scored.k or top_k))


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
        if not profile.url and not profile.serve:
            raise GatekeeperError(f"{self._where}: field 'url' is required for adapter http; "
                                  "set it to the flag-off server's base URL, e.g. http://127.0.0.1:8080")
        self.started = serve.start(profile, workspace_root)  # the servers this engine starts (serve, serve_on)
        try:
            self._connect(profile)
        except BaseException:
            serve.stop(self.started)
            raise

    def _connect(self, profile: EngineProfile) -> None:
        self.replicas = {side: [self.started[side].url] if side in self.started else profile.replicas(side)
                         for side in ("off", "on")}
        self.urls = {side: urls[0] for side, urls in self.replicas.items()}  # tokenizing, rendering, naming
        self.timeout = float(profile.timeout)
        self.concurrency = int(profile.concurrency)  # the gate may run this many cases at once
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self._memo: dict[tuple[str, str], Any] = {}  # (path, body): the answer's field, as the server gave it
        self._busy = {url: [0, 0] for urls in self.replicas.values() for url in urls}  # in flight, sent
        self._answered: set[str] = set()  # servers that answered: one that stops answering has crashed
        self.notices: list[str] = []  # what the answers showed that the figures cannot (Engine.notices)
        self.dialect_name = profile.dialect  # until detected: messages during the first requests name it
        # Ask every deployment what it serves now: a server that is down fails here, before the
        # gate writes anything, and the answers are the identity.
        described = {url: self._describe(url) for urls in self.replicas.values() for url in urls}
        for side, urls in self.replicas.items():
            self._same_replicas(side, [described[u] for u in urls])
        self.servers = {cfg: described[url] for cfg, url in self.urls.items()}
        self.model_ids: dict[str, str | None] = {cfg: (s["models"][0]["id"] if s["models"] else None)
                                                 for cfg, s in self.servers.items()}
        if profile.dialect == "auto":
            self.dialect_name, self.detected = detect(self.servers["off"])
        else:
            self.dialect_name, self.detected = profile.dialect, "set in the profile"
        self.dialect = DIALECTS[self.dialect_name](self)
        self.samples = self.dialect.sampler is not None
        self.score_caveat = self.dialect.score_caveat
        self.granularity = self.dialect.granularity(self.urls["on"])
        self.context = _context(self.servers["off"])
        if self.dialect.tokenizer is not None:  # the served model's own folder: its config names its window
            self.window = attention_limits(self.dialect.tokenizer.model_dir)[0]

    @property
    def _where(self) -> str:
        return self.profile.where

    def _same_replicas(self, side: str, described: list[Described]) -> None:
        """Exit 2 naming the first replica that serves something else than the side's first one."""
        first = {k: v for k, v in described[0].items() if k != "url"}
        for other in described[1:]:
            theirs = {k: v for k, v in other.items() if k != "url"}
            if theirs != first:
                a, b = flatten(first), flatten(theirs)
                fields = ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
                field = "url" if side == "off" or not self.profile.url_on else "url_on"
                raise GatekeeperError(f"{self._where}: field '{field}': replica {other['url']} does not serve what "
                                      f"{described[0]['url']} serves ({fields}); replicas of one side must run the same "
                                      "model, server build and settings: fix or remove that replica")

    # --- the wire -------------------------------------------------------------------------------
    def _raw(self, url: str, path: str, body: Mapping[str, object] | None = None,
             headers: dict[str, bytes] | None = None) -> bytes:
        """One request; every way it can fail becomes a GatekeeperError naming the URL and the fix. A server that
        took the request and failed it (no answer on the connection, a 5xx, gone after it had answered) is an
        ``EngineCrash``: evidence about the server, not a URL to fix."""
        target = url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(target, data=data, method="GET" if body is None else "POST",
                                     # typeshed allows str values only; http.client sends bytes as they are (UTF-8 labels)
                                     headers={"Content-Type": "application/json", **(headers or {})})  # type: ignore[dict-item]
        late = (f"{target}: no answer within {self.timeout:g} s; raise 'timeout' in {self._where} or check the server")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            if e.code >= 500 and url in self._answered:
                raise self._crash(url, path, body, f"HTTP {e.code} {detail}",
                                  f"answered HTTP {e.code} ({detail.strip() or 'no body'})") from None
            raise GatekeeperError(f"{target}: HTTP {e.code} {detail}; check that {self._where} points at an "
                                  f"OpenAI-compatible server that accepts this request (dialect {self.dialect_name})") from None
        except (TimeoutError, socket.timeout):
            raise GatekeeperError(late) from None
        except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise GatekeeperError(late) from None
            if isinstance(reason, (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionResetError,
                                   BrokenPipeError, http.client.BadStatusLine)):
                raise self._crash(url, path, body, f"{type(reason).__name__}: {reason}",
                                  "closed the connection without an answer after the request was sent") from None
            if url in self._answered:  # it answered earlier in this run: it has died since
                raise self._crash(url, path, body, f"{type(reason).__name__}: {reason}",
                                  f"stopped answering ({reason}) after it had answered earlier in this run") from None
            raise GatekeeperError(f"{target}: cannot connect ({reason}); start the server or fix the URL in {self._where}") from None
        self._answered.add(url)
        return raw

    def _crash(self, url: str, path: str, body: Mapping[str, object] | None, said: str, what: str) -> EngineCrash:
        prompt = (body or {}).get("prompt")
        request = {"path": path, **({"prompt_tokens": len(prompt)} if isinstance(prompt, list) else {}),
                   **({"prompt_chars": len(prompt)} if isinstance(prompt, str) else {}),
                   **({"prompt_digest": digest(prompt)} if prompt is not None else {}),
                   **({"max_tokens": body["max_tokens"]} if body and "max_tokens" in body else {}),
                   **({k: body[k] for k in (self.profile.cache_switch,) if k and body and k in body})}
        return EngineCrash(f"{url}{path}: the server {what}: a crash, with the server up and the request sent; "
                           "its own log says why", url=url, said=said, request=request)

    def call(self, url: str, path: str, body: Mapping[str, object] | None = None,
             headers: dict[str, bytes] | None = None) -> Any:
        raw = self._raw(url, path, body, headers)
        try:
            return json.loads(raw)
        except ValueError:
            raise GatekeeperError(f"{url}{path}: the answer is not JSON ({raw[:80]!r}); check that {self._where} "
                                  "points at an OpenAI-compatible server") from None

    def call_text(self, url: str, path: str) -> str:
        return self._raw(url, path).decode(errors="replace")

    def _describe(self, url: str) -> Described:
        """What the server says it serves: /v1/models, and llama.cpp's /props where there is one."""
        models = self.call(url, "/v1/models")
        if not isinstance(models, dict) or not isinstance(models.get("data"), list):
            raise GatekeeperError(f"{url}/v1/models: not an OpenAI model list; check that {self._where} "
                                  "points at an OpenAI-compatible server")
        # ``created`` is the time of the request on some servers: keep what names the model only.
        listed = [cast(ListedModel, {k: m.get(k) for k in ("id", "owned_by", "meta", "root", "max_model_len") if k in m})
                  for m in models["data"] if isinstance(m, dict)]
        try:
            props = self.call(url, "/props")
        except GatekeeperError:
            props = {}  # not llama.cpp: the model list is all there is
        kept = cast(Props, {k: props[k] for k in _PROPS if isinstance(props, dict) and k in props})
        if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
            kept["n_ctx"] = props["default_generation_settings"].get("n_ctx")
        return {"url": url, "models": listed, "props": kept}

    # --- text <-> tokens: the flag-off server's own, or the profile's tokenizer ------------------
    def text_op(self, path: str, body: Mapping[str, object], field: str) -> Any:
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
    def complete(self, config: str, prompt: list[int], max_tokens: int, stop: Sequence[str], warm: bool = False,
                 replica: str | None = None, background: bool = False, sampling: Draw | None = None) -> Generation:
        """One completion from the deployment of ``config`` (off or on); ``warm``: a prefix sent ahead;
        ``replica``: this one rather than the least busy; ``background``: load traffic, outside the
        battery's concurrency limit; ``sampling``: the declared decoding with the draw's seed, else greedy. It
        carries the labels in force (``base.labelled``) as headers."""
        # sampled: the server's top lists too, to read each draw against the declared decoding (gate/stats/pit.py)
        drawn = self.dialect.sampling(sampling, len(prompt) + max_tokens) if sampling else {}
        url, answer, wall = self._send(config, {**self.dialect.request(prompt), "max_tokens": max_tokens,
                                                "stop": list(stop), **drawn}, replica, background)
        g = self._parse(url, answer, prompt, wall)
        if sampling is not None and not background:
            g.draws = self._draws(url, sampling, answer["choices"][0], g.tokens)
        g.replica = url  # the server that answered: the evidence says which server each side reached
        return g

    def _send(self, config: str, request: CompletionRequest, replica: str | None = None,
              background: bool = False) -> tuple[str, Completion, float]:
        """``request`` (the dialect's fields) as a ``/v1/completions`` call to the deployment of ``config`` (greedy unless
        it sets a temperature), with the profile's extra fields, its model and cache switch, and the labels in force:
        (url, answer, wall seconds)."""
        body: dict[str, object] = {**self.profile.options.get("request", {}), "temperature": 0, **request, "stream": False}
        if self.model_ids[config]:
            body["model"] = self.model_ids[config]
        if self.profile.cache_switch:
            body[self.profile.cache_switch] = config == "on"
        with contextlib.nullcontext() if background else self._slots:
            url = self._pick(config, replica)
            try:
                start = perf_counter()
                answer = self.call(url, "/v1/completions", body, _headers(request_labels()))
                wall = perf_counter() - start
            finally:
                with self._lock:
                    self._busy[url][0] -= 1
        return url, answer, wall

    def unscored(self) -> str | None:
        return self.dialect.unscored

    def score(self, config: str, prompt: list[int], continuation: list[int]) -> Scored | None:
        """``Session.score`` on the deployment of ``config``: one request with the whole conversation as its prompt
        where the server gives prompt log-probabilities (vLLM); else one forced request per position of ``scored_at``
        that the dialect can force, which the result holds (llama-server, mlx_lm.server); None where the dialect reads
        neither (``Dialect.unscored``)."""
        if self.dialect.unscored:
            return None
        request = self.dialect.score_request(prompt + continuation)
        if request is None:
            at = [j for j in scored_at(len(continuation)) if self.dialect.forceable(prompt + continuation[:j])]
            tops = [self._forced(prompt + continuation[:j + 1], config) for j in at]
            tokens = [continuation[j] for j in at]
            return _scored(tops, tokens, [_at_most(top, t) for top, t in zip(tops, tokens)], None)
        url, answer, _ = self._send(config, request)
        try:
            rows = answer["choices"][0]["prompt_logprobs"][len(prompt):]
            return _top_k(rows, continuation, telemetry.read(answer).cached_tokens)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise GatekeeperError(f"{url}/v1/completions: no prompt log-probabilities at every position (bad or missing "
                                  f"{e}); check that {self._where} points at a {self.dialect_name} server") from None

    @classmethod
    def sampler_chain(cls, profile: EngineProfile) -> SamplerChain | None:
        return {"sampler": f"the {profile.dialect} server's own, seeded per request"}

    def sampler(self) -> SamplerChain | None:
        return self.dialect.sampler

    def unsampled(self, decoding: Decoding) -> str | None:
        return super().unsampled(decoding) or self.dialect.unsampled(decoding)

    def unreferenced(self) -> str | None:
        return self.dialect.unreferenced

    def reference(self, sequence, steps, asked, batch=1, own=False):
        """The flag-off deployment's own cold read at the positions of ``FORCED_AT`` (``Dialect.unreferenced`` says
        where there is none): vLLM's prompt log-probabilities, never read from its prefix cache; llama-server one
        forced request per position, its prompt cache off. ``batch``: as many identical requests at once (another
        batch shape where the server has the slots); ``own``: the same read again (the server's read is its own). An
        asked token outside the top ``PROMPT_TOP_K`` gets the least log-probability listed (at most)."""
        seq = [int(t) for t in sequence]
        start = len(seq) - steps
        at = sorted({p % steps for p in FORCED_AT})
        tops = [_together(batch, lambda j=j: self._forced(seq[:start + j + 1])) for j in at]
        top2 = [[[i, lp] for i, lp in sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[:2]] for top in tops]
        return Referenced(top2, [[_at_most(top, a) for a in asked[j]] for j, top in zip(at, tops)],
                          self.dialect.reference_read, at, gaps=False)

    def _forced(self, tokens: list[int], config: str = "off") -> dict[int, float]:
        """The top log-probabilities at the last position of ``tokens`` (what the model gives its last token), read
        by the deployment of ``config``, the flag-off one with no cache: vLLM's prompt log-probabilities (its token
        comes too, at its rank), llama-server's one generated token after the rest (cache_prompt as the side has it)."""
        if (request := self.dialect.score_request(tokens)) is None:
            request = self.dialect.forced_request(tokens[:-1], cache=config == "on")
        assert request is not None  # the dialect reads one
        url, answer, _ = self._send(config, request)
        try:
            if "prompt_logprobs" in request:
                row = answer["choices"][0]["prompt_logprobs"][-1]
                top = {int(i): float(v["logprob"]) for i, v in row.items()}
            else:
                step = answer["choices"][0]["logprobs"]["content"][0]
                top = {int(t["id"]): float(t["logprob"]) for t in step["top_logprobs"]}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise GatekeeperError(f"{url}/v1/completions: no top log-probabilities for the forced position (bad or "
                                  f"missing {e}); check that {self._where} points at a {self.dialect_name} server") from None
        if config == "off" and (cached := telemetry.read(answer).cached_tokens):  # proof, not trust, that it is cold
            raise GatekeeperError(f"{url} served {cached} tokens of a cold read from its prompt cache although the "
                                  "request turned it off; the reference arm and the distance's flag-off side need "
                                  "cache-free reads: set 'reference: false' and 'distance: false' in the policy for this server")
        if len(top) < 2 or any(v != v or abs(v) == float("inf") for v in top.values()):
            raise GatekeeperError(f"{url}/v1/completions gave no two finite log-probabilities for the last of "
                                  f"{len(tokens)} forced tokens")
        return top

    def _pick(self, config: str, replica: str | None = None) -> str:
        """``replica``, else the side's replica with the fewest calls in flight, then the fewest sent; counted as busy."""
        with self._lock:
            url = replica or min(self.replicas[config], key=lambda u: tuple(self._busy[u]))
            self._busy[url][0] += 1
            self._busy[url][1] += 1
            return url

    def background(self, cache: bool, prompts: Sequence[tuple[list[int], int, Decoding | None]],
                   workers: int) -> "Background":
        return Background(self, "on" if cache else "off", prompts, workers)

    def _parse(self, url: str, answer: Completion, prompt: list[int], wall: float) -> Generation:
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
        if margins is None and tokens and choice.get("logprobs"):
            self._notice(f"not_observable: top-2 logprobs from {url} (dialect {self.dialect_name}): the answer carries "
                         "logprobs in a shape this dialect does not read, so logit drift and margins are unknown; set "
                         f"'dialect' in {self._where} if the server speaks another")
        t = telemetry.read(answer)
        prompt_tokens = len(prompt)
        # Token ids are sent as they are; text is tokenized by the server, which may add a BOS token. A count
        # beyond that is not the prompt's size (some servers count only the re-processed suffix): flagged,
        # never used as one.
        slack = 0 if self.dialect.token_prompts else 1
        if t.prompt_tokens is not None and abs(t.prompt_tokens - prompt_tokens) > slack:
            self._notice(f"telemetry_suspect: {url} reported {t.prompt_tokens} prompt tokens for a prompt of "
                         f"{prompt_tokens} tokens sent (dialect {self.dialect_name}); gatekeeper counts "
                         f"{prompt_tokens} and does not take the server's prompt figures at face value")
        elif t.prompt_tokens is not None:
            prompt_tokens = t.prompt_tokens
        prefill = t.prefill_s if t.prefill_s is not None else wall  # no split reported: the request is the prefill
        return Generation(tokens=tokens, text=text, prompt_tokens=prompt_tokens,
                          cached_tokens=t.cached_tokens, prefill_s=prefill, decode_s=t.decode_s or 0.0,
                          ttft_s=prefill, top2=margins)

    def _draws(self, url: str, draw: Draw, choice: Choice, tokens: list[int]) -> list[list[float]] | None:
        """What each draw weighed under the server's own chain (``sampler.served``); where the answer's top lists cannot
        tell it, a notice, and the weights alone where the decoding leaves the model's distribution untouched (the
        server's own log-probability of each token drawn: what ``seeds_ignored`` and the controls need), else None."""
        tops = _tops(choice)
        spec = self.dialect.sampler
        rows = (sampler.served(draw.decoding, draw.key, spec, tokens, tops) if tops is not None and spec is not None
                and len(tops) == len(tokens) else "the answer gives no top log-probabilities by token id")
        if isinstance(rows, str):
            self._notice(f"not_observable: the draws of {url} against the declared decoding ({rows}), so a sampler "
                         "that does not follow it is not seen on this side")
            drawn = _drawn(choice)
            if sampler.untouched(draw.decoding) and drawn and len(drawn) == len(tokens):
                # the server's raw log-probability of each token drawn is its declared one: [raw, processed], no transform
                return [[lp, lp] for lp in drawn]
            return None
        return rows

    def _notice(self, text: str) -> None:
        """Remember a finding once (by its text up to the first number that varies per call)."""
        with self._lock:
            key = text.split(" reported ")[0]
            if not any(n.split(" reported ")[0] == key for n in self.notices):
                self.notices.append(text)

    def _tokens(self, choice: Choice, text: str) -> tuple[list[int], list[Top2] | None]:
        """Generated token ids and top-2 [[id, logprob], ...] per step, in whichever shape the server uses."""
        logprobs = choice.get("logprobs") or {}
        steps = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(steps, list) and steps:  # llama.cpp, mlx_lm.server: one entry per token, with ids
            tokens = [self.dialect.step_token(s) for s in steps]
            # a candidate's id is its text where the server gives no id
            margins: list[list[list[Any]]] | None = [
                [[_key(t.get("id", t.get("token"))), float(t["logprob"])] for t in _best(s.get("top_logprobs") or [])]
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
            # a started server's port is chosen per run: its command (in the profile) names it instead
            "servers": {cfg: {**s, "url": self._named(s["url"])} for cfg, s in self.servers.items()},
            **({"started": {self._named(s.url): s.command for s in self.started.values()}} if self.started else {}),
            **({"replicas": {s: [self._named(u) for u in urls] for s, urls in self.replicas.items()}} if any(len(u) > 1 for u in self.replicas.values()) else {}),
            "dialect": {"name": self.dialect_name, "detected": self.detected},
            "cache_granularity": self.granularity,
            "cache_switch": self.profile.cache_switch,
            "concurrency": self.concurrency,
            **({"tokenizer": self.profile.tokenizer} if self.profile.tokenizer else {}),
            **({"request": self.profile.options["request"]} if self.profile.options.get("request") else {}),
        }

    def _named(self, url: str) -> str:
        """A URL as the identity records it: a started server's as the field that starts it."""
        side = next((side for side, s in self.started.items() if s.url == url), None)
        found = self.profile.started(side) if side else None
        return found[0] if found else url

    def close(self) -> None:
        self._memo.clear()
        serve.stop(self.started)


class Background:
    """Load traffic on one side's deployment while the ``with`` block runs: ``workers`` threads, each
    sending the next prompt as soon as its last one is answered, so that many stay in flight. A failed
    background request fails the run on exit: the load was not what the evidence says it was."""

    def __init__(self, model: HTTPEngine, config: str, prompts: Sequence[tuple[list[int], int, Decoding | None]],
                 workers: int):
        if not prompts:
            raise GatekeeperError("a load needs background prompts, and there are none")
        self.model, self.config, self.prompts, self.workers = model, config, list(prompts), workers
        self.sent = 0
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []

    def _take(self) -> tuple[list[int], int, Decoding | None]:
        with self._lock:
            prompt = self.prompts[self._next % len(self.prompts)]
            self._next += 1
            return prompt

    def _loop(self) -> None:
        while not self._stop.is_set():
            tokens, max_tokens, decoding = self._take()
            # a sampled suite's load draws as it does, with no seed: unseeded requests in flight beside seeded ones
            drawn = None if decoding is None else Draw(decoding, fresh(), seeded=False)
            try:
                self.model.complete(self.config, tokens, max_tokens, (), warm=True, background=True, sampling=drawn)
            except GatekeeperError as e:
                self._errors.append(str(e))
                return
            with self._lock:
                self.sent += 1

    def __enter__(self) -> "Background":
        self._threads = [threading.Thread(target=self._loop, daemon=True, name=f"load-{i}") for i in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.model.timeout + 5)
        if self._errors and exc[0] is None:
            raise GatekeeperError(f"a background request of the load failed ({self._errors[0]}); the battery did not "
                                  "run under the load the evaluation names")


# A request's labels as the headers ``gatekeeper proxy`` reads (UTF-8: stage names are the user's).
_HEADERS = {"stage": "X-Gatekeeper-Stage", "stream": "X-Gatekeeper-Stream"}


def _top_k(rows: list[dict[str, PromptLogprob]], continuation: list[int], cached_tokens: int | None) -> Scored:
    """``Scored`` from vLLM's prompt log-probabilities, one ``{token id: {logprob, rank}}`` per position: its top
    ``PROMPT_TOP_K`` (the position's own token comes too, at its rank), best first, the lowest id first on a tie."""
    if len(rows) != len(continuation):
        raise ValueError(f"{len(rows)} positions for {len(continuation)} tokens")
    tops = [{int(i): float(v["logprob"]) for i, v in row.items() if int(v["rank"]) <= PROMPT_TOP_K} for row in rows]
    own = [float(row[str(t)]["logprob"]) for row, t in zip(rows, continuation)]
    return _scored(tops, list(continuation), own, cached_tokens)


def _at_most(top: dict[int, float], token: int) -> float:
    """The token's log-probability among a position's top ones; outside them, the least listed (at most)."""
    return top.get(int(token), min(top.values()))


def _scored(tops: list[dict[int, float]], tokens: list[int], own: list[float], cached_tokens: int | None) -> Scored:
    """``Scored`` from each position's top log-probabilities (best first, the lowest id first on a tie) and the
    log-probability of the position's own token."""
    import numpy as np

    ranked = [sorted(top.items(), key=lambda x: (-x[1], x[0])) for top in tops]
    k = min((len(t) for t in ranked), default=1)  # a vocabulary smaller than PROMPT_TOP_K gives fewer
    ids = np.array([[i for i, _ in t[:k]] for t in ranked], dtype=np.int64).reshape(len(ranked), k)
    lps = np.array([[lp for _, lp in t[:k]] for t in ranked], dtype=np.float32).reshape(len(ranked), k)
    return Scored(tokens=tokens, kind=f"top{k}", logprobs=lps, token_logprobs=np.array(own, dtype=np.float32), ids=ids,
                  cached_tokens=cached_tokens)


def _together(n: int, read):
    """``read()`` ``n`` times at once (threads), the last one's answer: one read where ``n`` is 1."""
    if n <= 1:
        return read()
    out: list[Any] = [None] * n

    def one(k: int) -> None:
        try:
            out[k] = read()
        except BaseException as e:  # raised again below, in the caller's thread
            out[k] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for answer in out:
        if isinstance(answer, BaseException):
            raise answer
    return out[-1]


def _headers(labels: dict[str, str]) -> dict[str, bytes]:
    return {_HEADERS[k]: v.encode() for k, v in labels.items() if k in _HEADERS}


def _drawn(choice: Choice) -> list[float] | None:
    """Each generated token's own log-probability, where the answer gives it per step (llama.cpp, mlx_lm.server)."""
    steps = (choice.get("logprobs") or {}).get("content")
    try:
        return [float(s["logprob"]) for s in steps] if isinstance(steps, list) else None
    except (KeyError, TypeError, ValueError):
        return None


def _tops(choice: Choice) -> list[dict[int, float]] | None:
    """Each step's listed candidates by token id and log-probability; None where the ids are not given."""
    logprobs = choice.get("logprobs") or {}
    steps = logprobs.get("content")
    try:
        if isinstance(steps, list):  # llama.cpp: one entry per token, with ids
            return [{int(t["id"]): float(t["logprob"]) for t in s.get("top_logprobs") or []} for s in steps]
        return [{k: float(v) for k, v in ((_key(k), v) for k, v in step.items()) if isinstance(k, int)}
                for step in logprobs["top_logprobs"]]  # vLLM, ids as token_id:N
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _best(top: list[Candidate]) -> list[Candidate]:
    """The two most likely candidates (some servers list them in no set order)."""
    return sorted(top, key=lambda t: -float(t["logprob"]))[:2]


def _key(token: int | str | None) -> int | str | None:
    """A candidate's id: an int where the server gives one (vLLM's ``token_id:N`` too), else its text."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    return int(token) if isinstance(token, int) else token


def _context(described: Described) -> int | None:
    """The context a server holds per request, as it describes itself (llama.cpp's n_ctx, vLLM's max_model_len)."""
    n = described["props"].get("n_ctx") or next((m.get("max_model_len") for m in described["models"] if m.get("max_model_len")), None)
    return int(n) if isinstance(n, int) and n > 0 else None
