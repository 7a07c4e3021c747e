"""Running a plan's cases: the models each configuration loads, a case run turn by turn on a session, each
stage's static prefix pinned, the graders a battery needs. The evaluator, calibration, mining and the Ray
actors all run cases through these, so a case runs the same wherever it runs."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

from ...battery import checks, partition
from ...battery import suites as battery
from ...engines import sampler
from ...engines.base import Engine, Scored, Session, labelled
from ...errors import EngineCrash, GatekeeperError
from ...evidence import CaseResult, Crash, Turn
from ...identity import sha256_hex
from ...workspace import Workspace
from . import graders as graders_
from .plans import Plan


def open_engines(p: Plan) -> dict[str, Engine]:
    """A loaded model per configuration; one shared model when both run the same profile."""
    from ...engines.registry import build_engine

    off = build_engine(p.configs["off"].profile, workspace_root=p.ws.root)
    if p.configs["on"].profile == p.configs["off"].profile:
        return {"off": off, "on": off}
    try:
        return {"off": off, "on": build_engine(p.configs["on"].profile, workspace_root=p.ws.root)}
    except BaseException:
        off.close()
        raise


def close_engines(models: dict[str, Engine]) -> None:
    for model in {id(m): m for m in models.values()}.values():
        model.close()


def open_graders(p: Plan, loaded: Iterable[Engine] = ()) -> graders_.Graders | None:
    """The graders of the plan's model-graded and similar assertions (None: nothing to grade); ``loaded``:
    models already loaded that a grader profile may share."""
    return graders_.open(p.grading, p.ws.root, loaded)


def run_case(session: Session, ws: Workspace, item: battery.Item, mode: partition.Mode, watch: Any = None,
             graders: graders_.Graders | None = None) -> CaseResult:
    """One case, every turn of it, greedy; each later turn extends the transcript so far. A ``watch``
    (calibration's) may stop the case early: its ``turn(n)`` is the turn's ``until``, its ``fired`` the stop.
    ``graders``: the evaluation's (model-graded and similar assertions)."""
    suite, case, model = item.suite, item.case, session.model
    values = dict(case.vars)
    history: list[dict[str, str]] = []
    turns: list[Turn] = []
    for n, turn_vars in enumerate(case.turns or [{}]):
        values.update(turn_vars)
        early = {"until": watch.turn(n)} if watch else {}  # plugins written before ``until`` are never handed one
        try:
            rendered = partition.render(model, partition.pieces(ws, suite, values), mode, history)
            with labelled(stage=suite.stage, stream=item.case_id):  # a served engine tells a proxy what this is
                g = session.generate(rendered.tokens, max_tokens=suite.decoding.max_tokens, stop=suite.decoding.stop,
                                     top2=True, **early, **drawn(item, n))
            if (step := _not_finite(g.top2)) is not None:  # no verdict can rest on it, and no record can hold it
                raise EngineCrash(f"the {model.name} engine gave non-finite logits at generated step {step} of case "
                                  f"{item.case_id} turn {n + 1}", url=model.name, said="non-finite logits",
                                  request={"prompt_tokens": len(rendered.tokens), "step": step})
        except EngineCrash as e:  # evidence about this side: recorded with the case (gate/arms/crashes.py)
            return CaseResult(turns=turns, text="", outcomes=[], crash=Crash(**e.record(), turn=n + 1))
        turns.append(Turn(**g.to_dict(), static_tokens=rendered.static_tokens, prompt_digest=sha256_hex(rendered.text.encode())))
        history = [*rendered.messages, {"role": "assistant", "content": g.text}]
        if watch and watch.fired:
            break
    text = turns[-1]["text"]
    context = checks.Context(vars=values, prompt=promptfoo_prompt(rendered.messages), graders=graders)
    return CaseResult(turns=turns, text=text, outcomes=checks.outcomes(list(case.assert_), text, context))


def draw(item: battery.Item, turn: int) -> sampler.Draw | None:
    """One turn (0-based) of a case as it is drawn: its declared decoding keyed by (seed, case, sample, turn), the same
    on every side so their draws pair; None where the decoding is plain greedy."""
    d = item.suite.decoding
    return None if d.plain else sampler.Draw(d, sampler.key(d.seed, item.case_key, item.sample, turn))


def drawn(item: battery.Item, turn: int) -> dict[str, Any]:
    """``generate``'s sampling argument for one turn of a case (``draw``); nothing where the decoding is plain greedy
    (plugins written before ``sampling`` are never handed one)."""
    return {} if (found := draw(item, turn)) is None else {"sampling": found}


def check_decoding(p: Plan, models: dict[str, Engine]) -> None:
    """Exit 2 before any model time is spent where a suite declares a decoding that an engine cannot run."""
    for suite in {i.suite.suite: i.suite for i in p.items}.values():
        for model in models.values():
            check_samples(suite, model)


def check_samples(suite: battery.Suite, model: Engine) -> None:
    """Exit 2 where ``suite`` declares a decoding beyond greedy that ``model`` cannot run as declared."""
    if not suite.decoding.plain and (why := model.unsampled(suite.decoding)):
        raise GatekeeperError(f"{suite.path}: field 'decoding': the {model.name} engine of {model.profile.where} "
                              f"{why}; it cannot run {sampler.describe(suite.decoding)}: run it where it samples as "
                              "declared (torch without draft_model or cache_implementation, mlx, llamacpp, "
                              "llama-server, vLLM, mlx_lm.server without presence or frequency penalties, "
                              "llama-cpp-python's server without penalties) or decode "
                              "the suite greedy")


def _not_finite(top2: list | None) -> int | None:
    """The first generated step (1-based) whose top-2 logits are NaN or infinite; None: all finite."""
    return next((n for n, step in enumerate(top2 or [], 1) if not all(math.isfinite(v) for _, v in step)), None)


def promptfoo_prompt(messages: list[dict[str, str]]) -> str:
    """The prompt as promptfoo hands it to assertions and graders: a lone user message's text, else the chat
    messages as JSON text (what a promptfoo chat prompt renders to)."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return checks.stringify([{"role": m["role"], "content": m["content"]} for m in messages])


def pin_stage_prefixes(session: Session, p: Plan, mode: partition.Mode) -> int:
    """Register each suite's static prefix (identical across its cases) with the session."""
    pinned = 0
    for suite in {i.suite.suite: i.suite for i in p.items}.values():
        case = suite.cases[0]
        values = {**case.vars, **(case.turns[0] if case.turns else {})}
        r = partition.render(session.model, partition.pieces(p.ws, suite, values), mode)
        if r.static_tokens:
            with labelled(stage=suite.stage):
                session.pin(r.tokens[: r.static_tokens])
            pinned += 1
    return pinned


def cases(session: Session, p: Plan, mode: partition.Mode, workers: int | None = None,
          graders: graders_.Graders | None = None,
          items: list[battery.Item] | None = None) -> Iterator[tuple[battery.Item, CaseResult]]:
    """Each case with its result, in battery order (or ``items``, a sequential evaluation's round); up to
    ``workers`` (the engine's concurrency) run at once."""
    workers = max(1, workers or session.model.concurrency)
    items = p.items if items is None else items
    if workers == 1:
        yield from ((item, run_case(session, p.ws, item, mode, graders=graders)) for item in items)
        return
    pool = ThreadPoolExecutor(workers)
    try:
        futures = [pool.submit(run_case, session, p.ws, item, mode, graders=graders) for item in items]
        for item, future in zip(items, futures):
            yield item, future.result()
    finally:
        pool.shutdown(cancel_futures=True)  # an interrupted run stops what has not started


def forced(session: Session, ws: Workspace, item: battery.Item, mode: partition.Mode,
           reference: CaseResult) -> list[Scored] | None:
    """The case's reference conversation (its prompts as this session renders them, its answers as given) read
    teacher-forced: per turn, the next-token distributions at each position of the reference's answer. None
    where the engine gives none (``Session.score``)."""
    values, out = dict(item.case.vars), []
    history: list[dict[str, str]] = []
    for turn_vars, turn in zip(item.case.turns or [{}], reference["turns"]):
        values.update(turn_vars)
        rendered = partition.render(session.model, partition.pieces(ws, item.suite, values), mode, history)
        with labelled(stage=item.suite.stage, stream=item.case_id):
            scored = session.score(rendered.tokens, turn["tokens"])
        if scored is None:
            return None
        out.append(scored)
        history = [*rendered.messages, {"role": "assistant", "content": turn["text"]}]
    return out
