"""The worker's side of an engine in another environment (``engines/worker.py`` is the parent's): run as
``python -m gatekeeper.engines.worker_main`` under the profile's interpreter, it loads the adapter there and answers
the parent's requests, one JSON document per line, until told to close or its stdin ends."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import EngineCrash, GatekeeperError, described, origin
from ..workspace import EngineProfile
from .faults import Fault
from .registry import build_engine
from .sampler import Draw
from .worker import DECLARED


def main() -> None:
    """Serve one engine over this process's stdin and stdout, until told to close or stdin ends."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print goes to stderr, never into the protocol
    state: dict[str, Any] = {"engine": None, "sessions": {}}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer: dict[str, Any] = {"ok": _handle(request, state, out)}
        except EngineCrash as e:  # evidence about this side: the parent records it with the case
            answer = {"error": str(e), "gatekeeper": True, "crash": {"url": e.url, "said": e.said, "request": e.request}}
        except GatekeeperError as e:
            answer = {"error": str(e), "gatekeeper": True}
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it there
            where, ours = origin(e)  # the innermost frame: the runtime's (its crash) or gatekeeper's (a bug)
            answer = {"error": described(e), "gatekeeper": False, **({"internal": where} if ours else {})}
        out.write(json.dumps(answer) + "\n")
        if request["op"] == "close":
            break


def _handle(r: dict[str, Any], state: dict[str, Any], out: Any) -> Any:
    op, engine, sessions = r["op"], state["engine"], state["sessions"]
    if op == "load":
        profile = EngineProfile.model_validate({**r["profile"]}).model_copy(update={"name": r["name"]})
        engine = state["engine"] = build_engine(profile, workspace_root=Path(r["root"]) if r["root"] else None)
        return {**{k: getattr(engine, k) if k != "weights" else str(engine.weights or "") for k in DECLARED},
                "observes": sorted(engine.observes), "eos_ids": sorted(engine.eos_ids), "notices": list(engine.notices),
                "faults": sorted(engine.faults), "unscored": engine.unscored(), "unreferenced": engine.unreferenced()}
    if op == "python":
        return {"executable": sys.executable, "version": sys.version.split()[0]}
    if op in ("identity", "render", "tokenize", "detokenize"):
        arg = {"render": "messages", "tokenize": "text", "detokenize": "tokens"}.get(op)
        return getattr(engine, op)(r[arg]) if arg else engine.identity()
    if op == "reference":
        read = engine.reference(r["sequence"], r["steps"], r["asked"], r["batch"], r["own"])
        return None if read is None else vars(read)
    if op == "stepped":
        read = engine.stepped(r["sequence"], r["steps"], r["asked"])
        return None if read is None else vars(read)
    if op == "check_fault":
        return engine.check_fault(Fault(**{k: r["fault"][k] for k in ("kind", "size", "seed")}))
    if op == "session":
        fault = Fault(**{k: r["fault"][k] for k in ("kind", "size", "seed")}) if r["fault"] else None
        sid = len(sessions) + 1
        sessions[sid] = engine.session(cache=r["cache"], results=Path(r["results"]) if r["results"] else None, fault=fault)
        return sid
    if op == "close":
        for s in sessions.values():
            s.close()
        if engine is not None:
            engine.close()
        return None
    session = sessions[r["sid"]]
    if op == "generate":
        def until(tokens: list[int], top2: Any) -> bool:
            out.write(json.dumps({"until": [tokens, top2]}) + "\n")
            return bool(json.loads(sys.stdin.readline())["stop"])

        sampled = {"sampling": Draw.of(r["sampling"])} if r.get("sampling") else {}
        g = session.generate(r["prompt"], max_tokens=r["max_tokens"], stop=r["stop"], top2=r["top2"],
                             until=until if r["until"] else None, **sampled)
        return {k: v for k, v in vars(g).items()}
    if op == "score":
        s = session.score(r["prompt"], r["continuation"], top_k=r["top_k"])
        return None if s is None else {"tokens": list(s.tokens), "kind": s.kind, "cached_tokens": s.cached_tokens,
                                       **{k: None if getattr(s, k) is None else getattr(s, k).tolist()
                                          for k in ("logprobs", "token_logprobs", "ids")}}
    if op == "split":
        rows = session.split(r["prompt"], r["at"])
        return None if rows is None else list(rows)
    if op == "pin":
        session.pin(r["prefix"])
        return session.pin_sources.get(tuple(r["prefix"]))
    if op == "held":
        return list(session.held())
    if op == "snapshot_stats":
        return session.snapshot_stats()
    if op == "close_session":
        sessions.pop(r["sid"]).close()
        return None
    raise GatekeeperError(f"the worker does not know the request {op!r}")


if __name__ == "__main__":
    main()
