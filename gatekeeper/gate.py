"""The gate: run the battery with a flag off (repeated) and on, compare, decide, record.

Everything goes into the ledger as it happens, so an interrupted run leaves an
``aborted`` evaluation and never a verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from deepdiff import DeepDiff

from . import battery, checks, partition
from .errors import GatekeeperError
from .identity import digest, sha256_hex
from .workspace import Policy, Workspace

NEAR_TIE = 0.1  # a top-2 logit margin at or below this is a near-tie: a few ULPs can flip it
RENDER_MODE: partition.Mode = "partitioned"  # until the static_first flag exists, everything renders partitioned


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
    model_seconds: float
    overhead_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Plan:
    """An evaluation, fully validated before the ledger is touched."""

    ws: Workspace
    flag: str
    policy: Policy
    items: list[battery.Item]
    engine_name: str
    battery_digest: str
    config: dict[str, Any] = field(default_factory=dict)


def plan(ws: Workspace, flag: str, engine: str = "auto", suites: list[str] | None = None,
         limit: int | None = None) -> Plan:
    policy = ws.policy(flag)
    if policy.gate != "byte_equivalence":
        raise GatekeeperError(f"{ws.root / 'policies' / (flag + '.yaml')}: gate '{policy.gate}' is not built yet; "
                              "this version evaluates byte_equivalence flags (prefix_cache)")
    ws.engine(engine)  # validates the profile before anything is loaded or written
    items = battery.load(ws, suites, limit)
    return Plan(ws, flag, policy, items, engine, battery.battery_digest(ws, items),
                {"engine": engine, "suites": suites, "limit": limit, "render": RENDER_MODE})


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


def _pin_stage_prefixes(engine, p: Plan) -> int:
    """Register each suite's static prefix (identical across its cases) with the engine."""
    pinned = 0
    for suite in {i.suite.suite: i.suite for i in p.items}.values():
        case = suite.cases[0]
        values = {**case.vars, **(case.turns[0] if case.turns else {})}
        r = partition.render(engine, partition.pieces(p.ws, suite, values), RENDER_MODE)
        if r.static_tokens:
            engine.pin(r.tokens[: r.static_tokens])
            pinned += 1
    return pinned


def identities(engine, p: Plan) -> dict[str, Any]:
    """What makes each configuration's outputs what they are; the flag state is the one difference."""
    base = {
        "engine": engine.identity(),
        "profile": p.ws.engine(p.engine_name).model_dump(mode="json"),
        "battery_digest": p.battery_digest,
        "policy_digest": digest(p.policy.model_dump(mode="json")),
        "render": RENDER_MODE,
        "decoding": {s.suite: s.decoding.model_dump(mode="json") for s in {i.suite.suite: i.suite for i in p.items}.values()},
    }
    return {state: {**base, "flags": {p.flag: state}} for state in ("off", "on")}


def evaluate(p: Plan, ledger, engine, operator: str,
             progress: Callable[[str], None] = lambda label: None) -> Outcome:
    """Run, compare and decide; every step is appended to the ledger as it happens."""
    t_start = time.perf_counter()
    shares = _cacheable_share(engine, p)
    evaluation_id = ledger.start_evaluation(p.flag, operator, p.policy.gate, identities(engine, p),
                                            {**p.config, "baseline_repeats": p.policy.baseline_repeats})
    try:
        return _run(p, ledger, engine, evaluation_id, shares, t_start, progress)
    except BaseException as e:  # Ctrl-C, SIGTERM, a crash: the evaluation is aborted, never a verdict
        ledger.abort_evaluation(evaluation_id, f"{type(e).__name__}: {e}".strip(": "))
        raise


def _run(p: Plan, ledger, engine, evaluation_id: int, shares: dict[str, float], t_start: float,
         progress: Callable[[str], None]) -> Outcome:
    runs: dict[str, list[dict[str, dict]]] = {"off": [], "on": []}
    seconds = {"off": 0.0, "on": 0.0}
    model_s = 0.0
    schedule = [("off", r) for r in range(p.policy.baseline_repeats)] + [("on", 0)]
    for config, repeat in schedule:
        engine.cache_enabled = config == "on"
        engine.reset_cache()
        # Registered in both configurations: an aligned prefill plan splits at these boundaries either way.
        _pin_stage_prefixes(engine, p)
        results: dict[str, dict] = {}
        t0 = time.perf_counter()
        for item in p.items:
            progress(f"{config}#{repeat} {item.case_id}")
            result = run_case(engine, p.ws, item, RENDER_MODE)
            model_s += sum(t["prefill_s"] + t["decode_s"] for t in result["turns"])
            ledger.add_case_result(evaluation_id, item.case_id, config, repeat, result)
            results[item.case_id] = result
        seconds[config] += time.perf_counter() - t0
        runs[config].append(results)
    engine.cache_enabled = False

    detok = engine.detokenize
    reference = runs["off"][0]
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
        diff = compare(reference[cid], runs["on"][0][cid], detok)
        ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": "off#0~on#0", **(diff or {})})
        if diff is None:
            equal["off_on"] += 1
        else:
            differing.append((cid, diff))

    on_turns = [t for res in runs["on"][0].values() for t in res["turns"]]
    off_turns = [t for res in reference.values() for t in res["turns"]]
    cached = sum(t["cached_tokens"] for t in on_turns)
    bound = sum(t["static_tokens"] for t in on_turns)
    exercised = min(1.0, cached / bound) if bound else 0.0
    floor = p.policy.exercise_floor.min_cached_share

    reasons: list[str] = []
    if unstable:
        verdict = "INCONCLUSIVE"
        reasons += [f"baseline_unstable: {cid} gave different outputs on repeated flag-off runs" for cid in unstable]
    elif differing:
        verdict = "FAIL"
        for cid, d in differing:
            if d.get("turn") is None:
                reasons.append(f"differs: {cid} assertion outcomes differ")
            else:
                reasons.append(f"differs: {cid} turn {d['turn']} first divergent token at position {d['first_divergent_position']} "
                               f"({d['a']['token']} vs {d['b']['token']}, margin {d['a']['margin']!s} vs {d['b']['margin']!s}"
                               f"{', near-tie' if d['near_tie'] else ''})")
    elif cached == 0:
        verdict = "INCONCLUSIVE"
        reasons.append(f"not_exercised: the cache served 0 tokens of a {bound}-token stable-prefix bound")
    elif exercised < floor:
        verdict = "INCONCLUSIVE"
        reasons.append(f"not_exercised: the cache served {cached} of a {bound}-token stable-prefix bound "
                       f"({exercised:.2f} < floor {floor})")
    else:
        verdict = "PASS"
        reasons.append(f"equal: all {len(p.items)} cases identical in token ids, text and assertion outcomes; "
                       f"baseline stable over {p.policy.baseline_repeats} runs; cache served {exercised:.0%} of the stable-prefix bound")

    wall = time.perf_counter() - t_start
    outcome = Outcome(
        evaluation_id=evaluation_id, flag=p.flag, verdict=verdict, reasons=reasons,
        cases=len(p.items), assertions=sum(len(i.case.assert_) for i in p.items),
        differing_cases=[cid for cid, _ in differing], equal=equal,
        tokens={"prompt_off": sum(t["prompt_tokens"] for t in off_turns),
                "computed_on": sum(t["prompt_tokens"] - t["cached_tokens"] for t in on_turns),
                "cached_on": cached, "stable_prefix_bound": bound},
        seconds={"off": round(seconds["off"] / p.policy.baseline_repeats, 3), "on": round(seconds["on"], 3)},
        cacheable_share=shares, exercised_share=round(exercised, 4),
        model_seconds=round(model_s, 3), overhead_seconds=round(max(0.0, wall - model_s), 3),
    )
    ledger.finish_evaluation(evaluation_id, verdict, reasons, outcome.to_dict())
    return outcome


def identity_now(ws: Workspace, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The flag-off identity that ``evaluation``'s configuration (engine, suites, limit) has today."""
    from .engines.registry import build_engine

    config = evaluation["config"]
    p = plan(ws, evaluation["flag"], config["engine"], config.get("suites"), config.get("limit"))
    engine = build_engine(ws.engine(p.engine_name), cache=False, workspace_root=ws.root)
    try:
        return identities(engine, p)["off"]
    finally:
        engine.close()
