"""The gate: run the battery with a flag off (repeated) and on, compare, decide, record.

The policy's gate kind decides what "off" and "on" are and what must hold between them:
``byte_equivalence`` (prefix_cache): the cache off vs on, token ids, text and assertion outcomes
identical; ``assertion_equivalence`` (static_first): prompts as written vs partitioned, cache off,
assertion outcomes identical; ``non_inferiority`` (adapter): the current weights vs a candidate
LoRA adapter, no passing assertion lost (within the policy's margin).

Everything goes into the ledger as it happens, so an interrupted run leaves an
``aborted`` evaluation and never a verdict.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from deepdiff import DeepDiff

from . import battery, checks, partition, pipeline
from .errors import GatekeeperError
from .identity import digest, directory_digest, sha256_hex
from .workspace import EngineProfile, Policy, Workspace

NEAR_TIE = 0.1  # a top-2 logit margin at or below this is a near-tie: a few ULPs can flip it


@dataclass
class Outcome:
    """What ``evaluate`` hands back to the CLI."""

    evaluation_id: int
    flag: str
    verdict: str
    reasons: list[str]
    cases: int
    assertions: int
    differing_cases: list[str]
    equal: dict[str, int]
    tokens: dict[str, int]
    seconds: dict[str, float]
    cacheable_share: dict[str, float]
    exercised_share: float
    passes: dict[str, int]  # assertions passed, flag off (first run) and on
    model_seconds: float
    overhead_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Config:
    """One side of the comparison: the weights, the prefix cache, how prompts render."""

    profile: EngineProfile
    cache: bool
    render: partition.Mode


@dataclass
class Plan:
    """An evaluation, fully validated before the ledger is touched."""

    ws: Workspace
    flag: str
    policy: Policy
    items: list[battery.Item]
    engine_name: str
    battery_digest: str
    configs: dict[str, Config]  # "off" and "on"
    candidate: dict[str, str] | None = None  # non_inferiority: the adapter's path and content digest
    config: dict[str, Any] = field(default_factory=dict)


def plan(ws: Workspace, flag: str, engine: str = "auto", suites: list[str] | None = None,
         limit: int | None = None, *, force: pipeline.InForce, candidate: str | Path | None = None) -> Plan:
    """``force``: the pipeline in force (flag states from the ledger), which both sides start from."""
    policy = ws.policy(flag)
    base = pipeline.engine_profile(ws, engine, force)  # validates the profile before anything is loaded
    if candidate is not None and policy.gate != "non_inferiority":
        raise GatekeeperError(f"--candidate is for a non_inferiority flag (adapter); {flag} is gated by {policy.gate}")
    cand = None
    if policy.gate == "non_inferiority":
        if candidate is None:
            raise GatekeeperError(f"{flag} compares the current weights with a candidate LoRA adapter: "
                                  "add --candidate PATH (the adapter directory)")
        path = Path(candidate).expanduser().resolve()
        if not path.is_dir():
            raise GatekeeperError(f"--candidate {path}: not a directory; point it at a LoRA adapter directory")
        cand = {"path": str(path), "digest": directory_digest(path)}
        configs = {"off": Config(base, False, force.render),
                   "on": Config(base.model_copy(update={"adapter_path": str(path)}), False, force.render)}
    elif policy.gate == "assertion_equivalence":
        configs = {"off": Config(base, False, "as_written"), "on": Config(base, False, "partitioned")}
    else:
        configs = {"off": Config(base, False, force.render), "on": Config(base, True, force.render)}
    items = battery.load(ws, suites, limit)
    return Plan(ws, flag, policy, items, engine, battery.battery_digest(ws, items), configs, cand,
                {"engine": engine, "suites": suites, "limit": limit,
                 "render": {k: c.render for k, c in configs.items()}, "candidate": cand})


def open_engines(p: Plan) -> dict[str, Any]:
    """An engine per configuration; one shared instance when both run the same weights."""
    from .engines.registry import build_engine

    off = build_engine(p.configs["off"].profile, cache=False, workspace_root=p.ws.root)
    if p.configs["on"].profile == p.configs["off"].profile:
        return {"off": off, "on": off}
    return {"off": off, "on": build_engine(p.configs["on"].profile, cache=False, workspace_root=p.ws.root)}


def run_case(engine, ws: Workspace, item: battery.Item, mode: partition.Mode) -> dict[str, Any]:
    """One case, every turn of it, greedy; each later turn extends the transcript so far."""
    suite, case = item.suite, item.case
    values = dict(case.vars)
    history: list[dict[str, str]] = []
    turns = []
    for turn_vars in case.turns or [{}]:
        values.update(turn_vars)
        rendered = partition.render(engine, partition.pieces(ws, suite, values), mode, history)
        g = engine.generate(rendered.tokens, max_tokens=suite.decoding.max_tokens, stop=suite.decoding.stop, top2=True)
        turns.append({**g.to_dict(), "static_tokens": rendered.static_tokens, "prompt_digest": sha256_hex(rendered.text.encode())})
        history = [*rendered.messages, {"role": "assistant", "content": g.text}]
    text = turns[-1]["text"]
    return {"turns": turns, "text": text, "outcomes": checks.outcomes(list(case.assert_), text)}


def _margin(step: list[list[float]] | None) -> float | None:
    return None if not step else float(step[0][1] - step[1][1])


def compare(a: dict[str, Any], b: dict[str, Any], detok: Callable[[list[int]], str]) -> dict[str, Any] | None:
    """None when token ids, text bytes and outcomes are identical; else where and how they part."""
    for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
        if ta["tokens"] == tb["tokens"] and ta["text"] == tb["text"]:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(ta["tokens"], tb["tokens"])) if x != y),
                   min(len(ta["tokens"]), len(tb["tokens"])))
        side = {}
        for name, t in (("a", ta), ("b", tb)):
            token = t["tokens"][pos] if pos < len(t["tokens"]) else None
            top2 = t.get("top2") or []
            side[name] = {"token": token, "piece": detok([token]) if token is not None else None,
                          "margin": _margin(top2[pos] if pos < len(top2) else None)}
        margins = [s["margin"] for s in side.values() if s["margin"] is not None]
        return {
            "turn": n + 1,
            "first_divergent_position": pos,
            "a": side["a"], "b": side["b"],
            "near_tie": bool(margins) and min(margins) <= NEAR_TIE,
            "text_a": ta["text"], "text_b": tb["text"],
            "outcomes_diff": DeepDiff(a["outcomes"], b["outcomes"]).to_dict() if a["outcomes"] != b["outcomes"] else {},
        }
    if a["outcomes"] != b["outcomes"]:
        return {"turn": None, "outcomes_diff": DeepDiff(a["outcomes"], b["outcomes"]).to_dict()}
    return None


def _cacheable_share(engine, p: Plan) -> dict[str, float]:
    """Tokens before the first dynamic byte, over all prompt tokens, as written vs partitioned."""
    totals = {"as_written": [0, 0], "partitioned": [0, 0]}
    for item in p.items:
        values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
        pieces = partition.pieces(p.ws, item.suite, values)
        for mode in totals:
            r = partition.render(engine, pieces, mode)  # type: ignore[arg-type]
            totals[mode][0] += r.static_tokens
            totals[mode][1] += len(r.tokens)
    return {m: round(s / t, 4) if t else 0.0 for m, (s, t) in totals.items()}


def _pin_stage_prefixes(engine, p: Plan, mode: partition.Mode) -> int:
    """Register each suite's static prefix (identical across its cases) with the engine."""
    pinned = 0
    for suite in {i.suite.suite: i.suite for i in p.items}.values():
        case = suite.cases[0]
        values = {**case.vars, **(case.turns[0] if case.turns else {})}
        r = partition.render(engine, partition.pieces(p.ws, suite, values), mode)
        if r.static_tokens:
            engine.pin(r.tokens[: r.static_tokens])
            pinned += 1
    return pinned


def _identity(p: Plan, config: str, engine_identity: dict[str, Any]) -> dict[str, Any]:
    """What makes one configuration's outputs what they are."""
    c = p.configs[config]
    out = {
        "engine": engine_identity,
        "profile": c.profile.model_dump(mode="json"),
        "battery_digest": p.battery_digest,
        "policy_digest": digest(p.policy.model_dump(mode="json")),
        "render": c.render,
        "decoding": {s.suite: s.decoding.model_dump(mode="json") for s in {i.suite.suite: i.suite for i in p.items}.values()},
        "flags": {p.flag: config},
    }
    if p.candidate is not None:
        out["candidate"] = p.candidate
    return out


def identities(engines: dict[str, Any], p: Plan) -> dict[str, Any]:
    return {config: _identity(p, config, engines[config].identity()) for config in ("off", "on")}


def evaluate(p: Plan, ledger, engines: dict[str, Any], operator: str,
             progress: Callable[[str], None] = lambda label: None) -> Outcome:
    """Run, compare and decide; every step is appended to the ledger as it happens."""
    t_start = time.perf_counter()
    shares = _cacheable_share(engines["off"], p)
    evaluation_id = ledger.start_evaluation(p.flag, operator, p.policy.gate, identities(engines, p),
                                            {**p.config, "baseline_repeats": p.policy.baseline_repeats,
                                             "concurrency": {k: _workers(e) for k, e in engines.items()}})
    try:
        return _run(p, ledger, engines, evaluation_id, shares, t_start, progress)
    except BaseException as e:  # Ctrl-C, SIGTERM, a crash: the evaluation is aborted, never a verdict
        ledger.abort_evaluation(evaluation_id, f"{type(e).__name__}: {e}".strip(": "))
        raise


def _run(p: Plan, ledger, engines: dict[str, Any], evaluation_id: int, shares: dict[str, float], t_start: float,
         progress: Callable[[str], None]) -> Outcome:
    runs: dict[str, list[dict[str, dict]]] = {"off": [], "on": []}
    seconds = {"off": 0.0, "on": 0.0}
    model_s = 0.0
    rendered_as: dict[int, str] = {}  # engine -> the mode its registered prefixes were rendered in
    schedule = [("off", r) for r in range(p.policy.baseline_repeats)] + [("on", 0)]
    for config, repeat in schedule:
        engine, c = engines[config], p.configs[config]
        if rendered_as.setdefault(id(engine), c.render) != c.render:
            engine.unpin()  # the other configuration's prefixes are not this one's boundaries
            rendered_as[id(engine)] = c.render
        engine.cache_enabled = c.cache
        engine.reset_cache()
        # Registered in both configurations: an aligned prefill plan splits at these boundaries either way.
        _pin_stage_prefixes(engine, p, c.render)
        results: dict[str, dict] = {}
        t0 = time.perf_counter()
        for item, result in _cases(engine, p, c.render):
            progress(f"{config}#{repeat} {item.case_id}")
            model_s += sum(t["prefill_s"] + t["decode_s"] for t in result["turns"])
            ledger.add_case_result(evaluation_id, item.case_id, config, repeat, result)
            results[item.case_id] = result
        seconds[config] += time.perf_counter() - t0
        runs[config].append(results)
        engine.cache_enabled = False

    detok = engines["off"].detokenize
    reference, on = runs["off"][0], runs["on"][0]
    unstable, differing, equal = [], [], {"baseline": 0, "off_on": 0}
    for item in p.items:
        cid = item.case_id
        for r, other in enumerate(runs["off"][1:], 1):
            diff = compare(reference[cid], other[cid], detok)
            ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": f"off#0~off#{r}", **(diff or {})})
            if diff is None:
                equal["baseline"] += 1
            elif cid not in unstable:
                unstable.append(cid)
        if p.policy.gate == "byte_equivalence":
            diff = compare(reference[cid], on[cid], detok)
        else:  # only assertion outcomes count; both texts are kept either way
            diff = _outcome_changes(item, reference[cid], on[cid])
        ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": "off#0~on#0", **(diff or {})})
        if diff is None:
            equal["off_on"] += 1
        else:
            differing.append((cid, diff))

    on_turns = [t for res in on.values() for t in res["turns"]]
    off_turns = [t for res in reference.values() for t in res["turns"]]
    cached = sum(t["cached_tokens"] for t in on_turns)
    bound = sum(t["static_tokens"] for t in on_turns)
    exercised = min(1.0, cached / bound) if bound else 0.0
    passes = {"off": _passes(reference), "on": _passes(on)}

    if unstable:
        verdict = "INCONCLUSIVE"
        reasons = [f"baseline_unstable: {cid} gave different outputs on repeated flag-off runs" for cid in unstable]
    else:
        decide = {"byte_equivalence": _decide_bytes, "assertion_equivalence": _decide_assertions,
                  "non_inferiority": _decide_non_inferior}[p.policy.gate]
        verdict, reasons = decide(p, differing, passes, cached, bound, exercised)

    wall = time.perf_counter() - t_start
    outcome = Outcome(
        evaluation_id=evaluation_id, flag=p.flag, verdict=verdict, reasons=reasons,
        cases=len(p.items), assertions=sum(len(i.case.assert_) for i in p.items),
        differing_cases=[cid for cid, _ in differing], equal=equal,
        tokens={"prompt_off": sum(t["prompt_tokens"] for t in off_turns),
                "computed_on": sum(t["prompt_tokens"] - t["cached_tokens"] for t in on_turns),
                "cached_on": cached, "stable_prefix_bound": bound},
        seconds={"off": round(seconds["off"] / p.policy.baseline_repeats, 3), "on": round(seconds["on"], 3)},
        cacheable_share=shares, exercised_share=round(exercised, 4), passes=passes,
        model_seconds=round(model_s, 3), overhead_seconds=round(max(0.0, wall - model_s), 3),
    )
    ledger.finish_evaluation(evaluation_id, verdict, reasons, outcome.to_dict())
    return outcome


def _workers(engine) -> int:
    """Cases in flight at once: a served engine may batch them (recorded, since batching can change outputs)."""
    return max(1, int(getattr(engine, "concurrency", 1)))


def _cases(engine, p: Plan, mode: partition.Mode) -> Iterator[tuple[battery.Item, dict[str, Any]]]:
    """Each case with its result, in battery order; up to the engine's concurrency run at once."""
    workers = _workers(engine)
    if workers == 1:
        yield from ((item, run_case(engine, p.ws, item, mode)) for item in p.items)
        return
    pool = ThreadPoolExecutor(workers)
    try:
        futures = [pool.submit(run_case, engine, p.ws, item, mode) for item in p.items]
        for item, future in zip(p.items, futures):
            yield item, future.result()
    finally:
        pool.shutdown(cancel_futures=True)  # an interrupted run stops what has not started


def _passes(results: dict[str, dict]) -> int:
    return sum(o["pass"] for r in results.values() for o in r["outcomes"])


def _outcome_changes(item: battery.Item, off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any] | None:
    """None when every assertion has the same outcome; else which changed, and both texts."""
    changed = [{"assertion": a.get("name") or f"#{n + 1} {a['type']}", "off": a["pass"], "on": b["pass"]}
               for n, (a, b) in enumerate(zip(off["outcomes"], on["outcomes"])) if a["pass"] != b["pass"]]
    if not changed:
        return None
    return {"changed": changed, "text_a": off["text"], "text_b": on["text"],
            "outcomes_diff": DeepDiff(off["outcomes"], on["outcomes"]).to_dict()}


Decision = tuple[str, list[str]]


def _decide_bytes(p: Plan, differing: list, passes: dict, cached: int, bound: int, exercised: float) -> Decision:
    floor = p.policy.exercise_floor.min_cached_share
    if differing:
        reasons = []
        for cid, d in differing:
            if d.get("turn") is None:
                reasons.append(f"differs: {cid} assertion outcomes differ")
            else:
                reasons.append(f"differs: {cid} turn {d['turn']} first divergent token at position {d['first_divergent_position']} "
                               f"({d['a']['token']} vs {d['b']['token']}, margin {d['a']['margin']!s} vs {d['b']['margin']!s}"
                               f"{', near-tie' if d['near_tie'] else ''})")
        return "FAIL", reasons
    if cached == 0:
        return "INCONCLUSIVE", [f"not_exercised: the cache served 0 tokens of a {bound}-token stable-prefix bound"]
    if exercised < floor:
        return "INCONCLUSIVE", [f"not_exercised: the cache served {cached} of a {bound}-token stable-prefix bound "
                                f"({exercised:.2f} < floor {floor})"]
    return "PASS", [f"equal: all {len(p.items)} cases identical in token ids, text and assertion outcomes; "
                    f"baseline stable over {p.policy.baseline_repeats} runs; cache served {exercised:.0%} of the stable-prefix bound"]


def _decide_assertions(p: Plan, differing: list, passes: dict, *_: Any) -> Decision:
    if differing:
        return "FAIL", [f"differs: {cid} assertion {c['assertion']!r} {'passed' if c['off'] else 'failed'} as written, "
                        f"{'passes' if c['on'] else 'fails'} partitioned" for cid, d in differing for c in d["changed"]]
    return "PASS", [f"equal: all {len(p.items)} cases have the same assertion outcomes as written and partitioned "
                    f"({passes['off']} passed); baseline stable over {p.policy.baseline_repeats} runs"]


def _decide_non_inferior(p: Plan, differing: list, passes: dict, *_: Any) -> Decision:
    # Candidate passes = current passes - regressions + improvements, so bounding the regressions
    # by the margin also keeps the pass count from dropping by more than the margin allows.
    margin = p.policy.margin
    regressions = [(cid, c["assertion"]) for cid, d in differing for c in d["changed"] if c["off"]]
    allowed = math.floor(margin * passes["off"] + 1e-9)  # regressions the margin tolerates
    summary = (f"{len(regressions)} regressions (margin {margin:g} allows {allowed}); "
               f"passes {passes['off']} with the current weights, {passes['on']} with the candidate")
    reasons = [f"regressed: {cid} assertion {name!r} passes with the current weights, fails with the candidate"
               for cid, name in regressions]
    if len(regressions) > allowed:
        return "FAIL", reasons + [f"inferior: {summary}"]
    return "PASS", reasons + [f"non_inferior: {summary}"]


def identity_now(ws: Workspace, evaluation: dict[str, Any], ledger) -> dict[str, Any]:
    """The flag-off identity that ``evaluation``'s configuration (engine, suites, limit, candidate)
    has today, with the pipeline in force as the ledger says, the evaluated flag taken as off."""
    from .engines.registry import build_engine

    config = evaluation["config"]
    force = pipeline.in_force(ws, ledger, {evaluation["flag"]: "off"})
    candidate = (config.get("candidate") or {}).get("path")
    p = plan(ws, evaluation["flag"], config["engine"], config.get("suites"), config.get("limit"),
             force=force, candidate=candidate)
    engine = build_engine(p.configs["off"].profile, cache=False, workspace_root=ws.root)
    try:
        return _identity(p, "off", engine.identity())
    finally:
        engine.close()
