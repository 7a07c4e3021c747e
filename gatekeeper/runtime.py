"""What a pipeline imports at run time.

    from gatekeeper import Runtime
    rt = Runtime("path/to/workspace")
    answer = rt.complete("router", {"session": "user=ana", "query": "What is 2+2?"})

The runtime reads flag states from the ledger and builds the pipeline they describe (see
``gatekeeper.gate.state.pipeline``): the prefix cache on only if ``prefix_cache`` is, prompts partitioned or
as written per ``static_first``, the adapter ``adapter`` approved. It pins each stage's static
prefix and serves answers from a response cache keyed by the pipeline-version hash. A change of model or adapter identity flushes the
answers and saved prefix states made under the old one and records the flush in the ledger.

When the workspace has a recipe (``gatekeeper pin``), pinned prefix states come from the result
layer on this machine if their keys match, and are computed and saved there if not.

Measurement options: ``flags={"prefix_cache": "on"}`` forces flag states over the ledger's,
``response_cache=False`` answers every call with the engine (a served answer costs nothing, so it
would measure nothing), ``capture="prompts.jsonl"`` writes each rendered prompt to a local
JSONL file (see ``gatekeeper.traffic.captures.capture``; off unless asked for), and ``persist=True`` uses the
result layer whatever the recipe says (``gatekeeper pin``, which then rewrites the recipe).

The guard after a flip: ``guard="prefix_cache"`` (with ``sign=``, the service key, or ``$GATEKEEPER_SIGNING_KEY``)
replays a share of the calls under the flag-off configuration on a background worker and rolls the flag back on a
breach of the policy's ``guard:`` rule, as ``gatekeeper proxy --guard`` does (``gatekeeper.traffic.live.in_process``).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .battery import partition
from .battery.suites import all_suites
from .cache import recipe as recipes
from .cache import results
from .cache.response import ResponseCache
from .engines import sampler
from .engines.base import Session, labelled
from .errors import GatekeeperError
from .gate.run import runs
from .gate.state import pipeline
from .identity import digest, sha256_hex
from .ledger import open_ledger
from .setup.models import home
from .traffic.captures import capture as captures
from .workspace import Suite, Workspace

if TYPE_CHECKING:
    from .traffic.live.in_process import InProcess


def _conversation(messages: Sequence[dict[str, str]]) -> str:
    """A call's default rollout key: its conversation's first user message."""
    return next((m["content"] for m in messages if m.get("role") == "user"), "")


def results_root() -> Path:
    """The result layer on this machine: saved prefix states."""
    return home() / "prefix_states"


@dataclass
class Completion:
    text: str
    tokens: list[int]
    from_response_cache: bool
    pipeline_hash: str
    prompt_tokens: int
    cached_tokens: int | None  # None: the engine did not report it
    prefill_s: float
    decode_s: float
    ttft_s: float
    messages: list[dict[str, str]]  # the transcript so far, for the next turn's ``history``

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Runtime:
    def __init__(self, workspace: str | Path | None = None, *, engine: str = "auto", ledger: str | None = None,
                 response_cache: Path | bool | None = None, flags: Mapping[str, str] | None = None,
                 capture: str | Path | None = None, persist: bool = False, guard: str | None = None,
                 sign: str | Path | None = None):
        from .engines.registry import build_engine

        self.ws = Workspace(workspace)
        self.ledger_url = ledger or f"sqlite:///{self.ws.ledger_path}"
        with self._ledger(create=False) as led:
            self.force = pipeline.in_force(self.ws, led, flags)
        self.flags, self.render = self.force.states, self.force.render
        capture_path = captures.check_path(capture) if capture is not None else None
        self.stages: dict[str, Suite] = {s.stage: s for s in all_suites(self.ws).values()}
        self.model = build_engine(pipeline.engine_profile(self.ws, engine, self.force), workspace_root=self.ws.root)
        self.responses: ResponseCache | None = None
        self.session: Session | None = None
        self.capture: captures.CaptureWriter | None = None
        self.guard: InProcess | None = None
        try:
            self._open(response_cache, capture_path, persist)
            if guard is not None:
                self.guard = self._watch(guard, sign, engine, flags)
        except BaseException:  # the runtime lives inside a pipeline: leave nothing open behind
            self.close()
            raise

    def _open(self, response_cache: Path | bool | None, capture_path: Path | None, persist: bool) -> None:
        identity = self.model.identity()
        self.model_digest, self.adapter_digest = identity["model_digest"], identity.get("adapter_digest")
        self.hash_parts, self.pipeline_hash = pipeline.version(self.ws, self.force, identity)
        self.responses = None if response_cache is False else ResponseCache(
            response_cache if isinstance(response_cache, (str, Path)) else home() / "responses.db")
        self.flushed: list[str] = self._flush_if_identity_changed() if self.responses is not None else []
        # Every stage prefix is registered, as the gate did: under the aligned plan it is a cut.
        self.prefixes: dict[str, Sequence[int]] = {stage: self._static_prefix(suite) for stage, suite in self.stages.items()}
        self.recipe = None if persist else recipes.read(self.ws.root)  # persist: about to rewrite it
        self.recipe_stale = recipes.stale(self.recipe, self.prefixes, identity) if self.recipe else {}
        self.session = self.model.session(
            cache=self.force.cache, results=results_root() if self.recipe is not None or persist else None)
        for stage, prefix in self.prefixes.items():
            if prefix:
                with labelled(stage=stage):
                    self.session.pin(prefix)
        self.capture = captures.CaptureWriter(capture_path) if capture_path else None
        self._streams: dict[str, str] = {}  # transcript digest -> its stream, so later turns join it
        self._new_streams = 0

    def _watch(self, flag: str, sign: str | Path | None, engine: str, flags: Mapping[str, str] | None) -> InProcess:
        """The guard for ``guard=FLAG``: the policy, the ledger, the flag's state and the key are checked here, and
        the flag-off side is a Runtime of this workspace with the flag forced off and no response cache."""
        import logging
        import os

        from . import signing
        from .traffic.live.guarded import Guarded
        from .traffic.live.in_process import InProcess

        key = sign or os.environ.get(signing.SIGNING_KEY_ENV)
        if not key:
            raise GatekeeperError(f"guard={flag!r} needs a service key to sign its rollbacks: pass sign=KEY or set "
                                  f"${signing.SIGNING_KEY_ENV} (its public key in policies/allowed_signers)")
        guarded = Guarded(self.ws, self.ledger_url, flag, "the flag-off pipeline in this process", signing.load_key(key),
                          say=logging.getLogger("gatekeeper.guard").warning)
        try:
            off = Runtime(self.ws.root, engine=engine, ledger=self.ledger_url, response_cache=False,
                          flags={**(flags or {}), flag: "off"})
        except BaseException:
            guarded.shut()
            raise
        return InProcess(guarded, off.complete, off.close)

    def _ledger(self, *, create: bool):
        """The ledger (closed by ``with``); with ``create=False`` and no ledger yet, a context of None."""
        led = open_ledger(self.ledger_url, create=create)
        return nullcontext(None) if led is None else led

    def _static_prefix(self, suite: Suite) -> list[int]:
        """The stage's rendered tokens before the first dynamic byte (the same for every call)."""
        values = {name: "" for name in partition.suite_vars(suite)}
        rendered = partition.render(self.model, partition.pieces(self.ws, suite, values, static_only=True), self.render)
        return rendered.tokens[: rendered.static_tokens]

    def _flush_if_identity_changed(self) -> list[str]:
        """Compare model/adapter digests with the last ones this workspace saw; purge and record on change."""
        assert self.responses is not None  # called only with a response cache
        root = str(self.ws.root)
        last = self.responses.last_seen(root)
        self.responses.mark_seen(root, self.model_digest, self.adapter_digest)
        if last is None or last == (self.model_digest, self.adapter_digest):
            return []
        watched = {t for p in self.ws.policies.values() for t in p.flush_on}
        triggers = [t for t, old, new in (("model", last[0], self.model_digest), ("adapter", last[1], self.adapter_digest))
                    if t in watched and old != new]
        if not triggers:
            return []
        purged = self.responses.purge(*last)
        states_purged = results.purge(results_root(), *last)
        with self._ledger(create=True) as ledger:
            for trigger in triggers:
                ledger.add_flush(trigger, {"model_digest": last[0], "adapter_digest": last[1]},
                                 {"model_digest": self.model_digest, "adapter_digest": self.adapter_digest},
                                 {"responses_purged": purged, "prefix_states_purged": states_purged,
                                  "workspace": root})
        return triggers

    @property
    def prefix_sources(self) -> dict[str, str]:
        """Stage -> where its pinned state came from: computed, loaded (result layer) or recomputed
        (a saved state failed its check); stages without a static prefix or cache are left out."""
        assert self.session is not None  # opened in __init__
        sources = self.session.pin_sources
        return {stage: sources[tuple(p)] for stage, p in self.prefixes.items() if tuple(p) in sources}

    def write_recipe(self) -> dict[str, Any]:
        """Write the workspace's recipe from the stage prefixes as rendered now (``gatekeeper pin``)."""
        self.recipe = recipes.write(self.ws.root, self.prefixes, self.model.identity())
        self.recipe_stale = {}
        return self.recipe

    def complete(self, stage: str, values: Mapping[str, str], history: Sequence[dict[str, str]] = (),
                 stream: str | None = None, key: str | None = None) -> Completion:
        """Render the stage's prompt, serve it from the response cache or the engine.

        ``stream`` names the conversation in a capture; by default a call continuing an earlier
        completion's ``messages`` joins that call's stream, and any other call starts a new one. ``key``: what a
        guarded rollout draws the call's side from (a user, a session; default: the conversation's first user message).
        """
        suite = self.stages.get(stage)
        if suite is None:
            raise GatekeeperError(f"unknown stage {stage!r}; stages in {self.ws.root / 'assertions'}: {', '.join(self.stages)}")
        pieces = partition.pieces(self.ws, suite, values)
        rendered = partition.render(self.model, pieces, self.render, history)
        started = self.capture.now() if self.capture is not None else 0.0
        if self.guard is not None and not self.guard.current(key or _conversation(rendered.messages)):
            return self.guard.answer(stage, values, history)  # rolled back, or not yet in the rollout's share
        if self.capture is not None:
            stream = stream or self._stream_of(history)
        t0 = time.monotonic()
        try:
            with labelled(stage=stage, stream=stream):  # a served engine tells a proxy what this is
                completion = self._answer(stage, suite, rendered)
        except Exception as e:
            self._offer(stage, values, history, suite, rendered, None, f"{type(e).__name__}: {e}", t0)
            raise
        if not completion.from_response_cache:  # an answer served again was offered when the engine made it
            self._offer(stage, values, history, suite, rendered, completion, None, t0)
        if self.capture is not None:  # written once answered, with the call's wall time
            assert stream is not None  # named above when capturing
            self.capture.write(stage, stream, rendered, captures.segments(
                self.model, rendered, partition.order(pieces, self.render), first_turn=not history), started)
            self._streams[digest(completion.messages)] = stream
        return completion

    def _offer(self, stage: str, values: Mapping[str, str], history: Sequence[dict[str, str]], suite: Suite,
               rendered: partition.Rendered, completion: Completion | None, error: str | None, t0: float) -> None:
        """A call the engine answered (or failed ``error``), to the guard: its decoding pairs as a request's would."""
        if self.guard is None:
            return
        from .traffic.live import guarded, shadow

        d = suite.decoding
        request = {"prompt": rendered.text, "max_tokens": d.max_tokens, **({} if d.sampled else {"temperature": 0}),
                   **({} if history else {"messages": rendered.messages})}  # a suite case's are graded (judge.py)
        live = (guarded.Failed(0, error or "") if completion is None
                else shadow.Answer(completion.text, None, len(completion.tokens)))
        self.guard.offer(stage, values, history, request, live, time.monotonic() - t0)

    def _stream_of(self, history: Sequence[dict[str, str]]) -> str:
        known = self._streams.get(digest(list(history))) if history else None
        if known:
            return known
        self._new_streams += 1
        return f"s{self._new_streams}"

    def _answer(self, stage: str, suite: Suite, rendered: partition.Rendered) -> Completion:
        prompt_digest = sha256_hex(rendered.text.encode())
        d = suite.decoding
        # a sampled stage draws afresh on every call (a live draw, keyed at random), and its answers are never replayed
        responses = None if d.sampled else self.responses
        drawn: dict[str, Any] = {} if d.plain else {"sampling": sampler.Draw(d, sampler.fresh())}
        runs.check_samples(suite, self.model)
        hit = responses.get(self.pipeline_hash, stage, prompt_digest) if responses is not None else None
        if hit is not None:
            return Completion(hit["text"], hit["tokens"], True, self.pipeline_hash, len(rendered.tokens), 0, 0.0, 0.0, 0.0,
                              [*rendered.messages, {"role": "assistant", "content": hit["text"]}])
        assert self.session is not None  # opened in __init__
        g = self.session.generate(rendered.tokens, max_tokens=d.max_tokens, stop=d.stop, **drawn)
        if responses is not None:
            responses.put(self.pipeline_hash, stage, prompt_digest, {"text": g.text, "tokens": g.tokens},
                               self.model_digest, self.adapter_digest)
        return Completion(g.text, g.tokens, False, self.pipeline_hash, g.prompt_tokens, g.cached_tokens, g.prefill_s,
                          g.decode_s, g.ttft_s, [*rendered.messages, {"role": "assistant", "content": g.text}])

    def close(self) -> None:
        for part in (self.guard, self.capture, self.responses, self.session, self.model):
            if part is not None:
                part.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
