"""An evaluation as a reviewer reads it: Markdown, a self-contained HTML page, or JSON.

All three render one view of the ledger record: verdict and reasons, both identities, per-stage
token and time figures, a chart of prompt tokens off vs computed on, the strength of the comparison
(top-2 logit drift) and the flag-off baseline's near-tie census, and every differing case side by
side with where the outputs part and the logit margins there. The HTML page loads nothing:
styles and the chart are inline, a Content-Security-Policy forbids every fetch, and all model
output is escaped.
"""

from __future__ import annotations

import html
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Union, cast, final

from ..cache.trie import common_prefix
from ..engines.base import plus
from ..evidence import CaseResultRow, Comparison, DivergentSide, EvaluationRecord
from ..gate.kinds import AT_RISK, NEAR_TIE, divergence
from ..gate.stats import looks
from ..identity import flatten
from ..summaries import (
    CalibrationRow,
    DepartureRecord,
    DistanceSummary,
    NotObservable,
    OutcomeSummary,
    ReferenceSummary,
    SamplingSummary,
    SequentialSummary,
    Statistics,
    Step,
    StrengthSummary,
    SuiteCensus,
)
from . import junit
from .outcomes import observed, verdict_summary

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # importing typing_extensions costs every CLI start 20 ms: only where typing lacks these
    from typing_extensions import TypedDict

PROBE = "probe:"  # the case ids of the gate's cache probes (gate/arms/probes.py)

FORMATS = ("md", "html", "json", "junit")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
MARK = "\u258c"  # in Markdown, where two outputs part (code blocks cannot be styled)

# --- the view's records: what render(fmt="json") prints beside the record, and what review pages show ----------------


class StageRow(TypedDict):
    """Per stage and configuration, the first run of each case: calls, tokens and model seconds."""

    stage: str
    config: str
    calls: int
    prompt_tokens: int
    cached_tokens: int | None  # None once a call did not report it
    computed_tokens: int | None
    prefill_s: float
    decode_s: float


class ChartRow(TypedDict):
    """A stage's two bars: prompt tokens with the flag off, tokens computed with it on."""

    stage: str
    prompt_off: int
    computed_on: int


class IdentityRow(TypedDict):
    """One dotted identity part, both sides' values and whether they differ."""

    part: str
    off: object
    on: object
    differs: bool


class Difference(TypedDict):
    """A differing comparison as a reviewer reads it: where the outputs part, both sides, both texts."""

    case_id: str
    pair: str
    label_a: str
    label_b: str
    turn: int | None
    first_divergent_position: int | None
    a: DivergentSide | None
    b: DivergentSide | None
    near_tie: bool | None
    collapse: Literal["a", "b"] | None
    collapse_recorded: bool  # False for entries recorded before the collapse label
    divergence: str | None
    text_a: str
    text_b: str
    divergent_char: int
    outcomes_diff: dict[str, object]


class StrengthView(StrengthSummary):
    """The strength with where its largest drift was, in words."""

    where_text: str | None


class Census(SuiteCensus):
    """A suite's near-tie census as the view shows it: flagged insensitive where none of its steps came near a tie."""

    suite: str
    insensitive: bool


class FaultView(TypedDict):
    """A planted fault's line in a calibration: None where its row does not hold the figure."""

    spec: str
    kind: str
    size: float
    supported: bool
    flagged: int | None
    cases: int | None
    share: float | None
    share_outputs: float | None
    share_drift: float | None


class CalibrationView(TypedDict):
    """One calibration of the evaluation: per planted fault, the share of cases the gate flagged."""

    id: int
    operator: str
    at: str
    engine: str
    cases: int
    cost_flag_on_runs: float | None
    drift_rule: str | None
    mode: str
    twin: str | None
    faults: list[FaultView]


class Quantile(TypedDict):
    """A KLD quantile, flag on and the A/A floor."""

    q: str
    on: float
    floor: float


@final
class Unobserved(TypedDict):
    """A section the engine could not give: why."""

    not_observable: str


@final
class DistanceTable(TypedDict):
    """The teacher-forced distance beside its A/A floor."""

    rows: list[list[str]]
    quantiles: list[Quantile]
    reason: str | None


@final
class ReferenceTable(TypedDict):
    """The reference arm: a row per arm and a note on its floors."""

    rows: list[list[str]]
    note: str


class SamplingView(TypedDict):
    """Sampled decoding: each side's draws, the bound per position class, and a note on the coupling."""

    rows: list[list[str]]
    classes: list[list[str]]
    note: str


class Sections(TypedDict, total=False):
    """The view's sections present only where the verdict recorded them (the review's evaluation page shows them too)."""

    paired: list[list[str]]
    sequential: list[list[str]]
    looks: str
    distance: Union[Unobserved, DistanceTable]
    reference: Union[Unobserved, ReferenceTable]
    sampling: SamplingView


class Shown(Sections):
    """The view's fields the review app's evaluation page shows as they are."""

    flag: str
    gate: str
    status: str
    verdict: str | None
    reasons: list[str]
    operator: str
    started_at: str
    finished_at: str | None
    aborted: str | None
    config: dict[str, object]
    identity_rows: list[IdentityRow]
    stages: list[StageRow]
    chart: list[ChartRow]
    strength: StrengthView | None
    near_ties: list[Census]
    calibrations: list[CalibrationView]
    probes: dict[str, str]


class View(Shown):
    """Everything an export shows, as plain JSON-able data; its ``Sections`` follow the fixed keys."""

    evaluation: int
    identities: dict[str, object]
    near_tie_threshold: float
    differences: list[Difference]
    probe_seconds: float | None


# --- the view ----------------------------------------------------------------------------------


@dataclass
class _Totals:
    """A stage's running totals on one side."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = 0  # a server that did not report cached tokens makes the stage's figure unknown, not 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


def _stages(case_results: list[CaseResultRow]) -> list[StageRow]:
    """Per stage (a case id's suite part) and configuration: first run of each, so off and on compare like for like."""
    totals: dict[tuple[str, str], _Totals] = defaultdict(_Totals)
    for r in case_results:
        if r["repeat"] != 0 or r["case_id"].startswith(PROBE):  # the cache probes are no stage: their own section
            continue
        row = totals[(r["case_id"].split("/", 1)[0], r["config"])]
        for t in r["result"]["turns"]:
            row.calls += 1
            row.prompt_tokens += t.get("prompt_tokens") or 0
            row.prefill_s += t.get("prefill_s") or 0
            row.decode_s += t.get("decode_s") or 0
            row.cached_tokens = plus(row.cached_tokens, t.get("cached_tokens"))
    return [{"stage": stage, "config": config, "calls": row.calls, "prompt_tokens": row.prompt_tokens,
             "cached_tokens": row.cached_tokens,
             "computed_tokens": None if row.cached_tokens is None else row.prompt_tokens - row.cached_tokens,
             "prefill_s": round(row.prefill_s, 4), "decode_s": round(row.decode_s, 4)}
            for (stage, config), row in sorted(totals.items(), key=lambda kv: (kv[0][0], kv[0][1] != "off"))]


def _na(x: int | None) -> int | str:
    return "n/a" if x is None else x


def _chart(stages: list[StageRow]) -> list[ChartRow]:
    rows: dict[str, ChartRow] = {}
    for s in stages:
        row = rows.setdefault(s["stage"], {"stage": s["stage"], "prompt_off": 0, "computed_on": 0})
        if s["config"] == "off":
            row["prompt_off"] = s["prompt_tokens"]
        elif s["config"] == "on":
            # not reported: nothing is known to be saved, so the bar shows every prompt token as computed
            row["computed_on"] = s["prompt_tokens"] if s["computed_tokens"] is None else s["computed_tokens"]
    return list(rows.values())



def _texts(record: EvaluationRecord, case_id: str, pair: str) -> tuple[str, str]:
    """The final outputs of a compared pair such as 'off#0~on#0', from the case results."""
    runs = {(r["config"], r["repeat"]): r["result"].get("text", "") for r in record["case_results"] if r["case_id"] == case_id}
    sides = []
    for side in pair.split("~"):
        m = re.fullmatch(r"(\w+)#(\d+)", side)
        sides.append(runs.get((m.group(1), int(m.group(2))), "") if m else "")
    return (sides + ["", ""])[0], (sides + ["", ""])[1]


def _differences(record: EvaluationRecord) -> list[Difference]:
    out: list[Difference] = []
    for c in record["comparisons"]:
        if c["equal"]:
            continue
        d = Comparison(**c["detail"])
        pair = d.get("pair", "")
        if "text_a" not in d:  # outcome-only differences carry no texts: take them from the results
            d["text_a"], d["text_b"] = _texts(record, c["case_id"], pair)
        left, right = (pair.split("~") + ["a", "b"])[:2] if pair else ("a", "b")
        out.append({"case_id": c["case_id"], "pair": pair, "label_a": left, "label_b": right,
                    "turn": d.get("turn"), "first_divergent_position": d.get("first_divergent_position"),
                    "a": d.get("a"), "b": d.get("b"), "near_tie": d.get("near_tie"),
                    # entries recorded before the collapse label have no "collapse": shown as not recorded
                    "collapse": d.get("collapse"), "collapse_recorded": "collapse" in d,
                    "divergence": divergence(d, (left, right)) if d.get("turn") is not None else None,
                    "text_a": d["text_a"], "text_b": d["text_b"],
                    "divergent_char": common_prefix(d["text_a"], d["text_b"]),
                    "outcomes_diff": d.get("outcomes_diff") or {}})
    return out


def _where(w: Step | None) -> str | None:
    return None if w is None else f"{w['case']} turn {w['turn']} step {w['step']}"


def _census(summary: OutcomeSummary | None) -> list[Census]:
    """The near-tie census per suite; a suite none of whose steps came near a tie is flagged insensitive."""
    return [{"suite": suite, **row, "insensitive": bool(row.get("steps")) and not row.get("near_ties")}
            for suite, row in ((summary.get("near_ties") if summary else None) or {}).items()]


def view(record: EvaluationRecord) -> View:
    """Everything an export shows, as plain JSON-able data."""
    identity = record.get("identity") or {}
    off, on = flatten(identity.get("off", {})), flatten(identity.get("on", {}))
    stages = _stages(record["case_results"])
    verdict = record.get("verdict_record")
    aborted = record.get("aborted_record")
    summary = verdict_summary(record)
    strength = summary.get("strength") if summary else None
    return {
        "evaluation": record["id"], "flag": record["flag"], "gate": record["gate"], "status": record["status"],
        "verdict": record.get("verdict"), "reasons": record.get("reasons") or [],
        "operator": record["operator"], "started_at": record["started_at"], "finished_at": verdict["finished_at"] if verdict else None,
        "aborted": aborted["reason"] if aborted else None,
        "config": record.get("config") or {},
        "identities": identity,
        "identity_rows": [{"part": k, "off": off.get(k), "on": on.get(k), "differs": off.get(k) != on.get(k)}
                          for k in sorted(set(off) | set(on))],
        "stages": stages,
        "chart": _chart(stages),
        "strength": None if strength is None else {**strength, "where_text": _where(strength.get("where"))},
        "near_ties": _census(summary),
        "near_tie_threshold": NEAR_TIE,
        "differences": _differences(record),
        "calibrations": [_calibration(c) for c in record.get("calibrations") or []],
        "probes": (summary.get("probes") if summary else None) or {},
        "probe_seconds": summary.get("probe_seconds") if summary else None,
        **sections(summary),
    }


def sections(summary: OutcomeSummary | None) -> Sections:
    """The view's sections the verdict recorded, in their order; records written before paired verdicts have none,
    so their exports read as they did."""
    out: Sections = {}
    if not summary:
        return out
    if paired := summary.get("paired"):
        out["paired"] = _paired_rows(paired)
    if sequential := summary.get("sequential"):
        out["sequential"] = _sequential_rows(sequential)
    if look := summary.get("looks"):  # a gate judged from a bound: which look at the change and the alpha it spent
        out["looks"] = looks.line(look)
    if moved := summary.get("distance"):
        out["distance"] = _distance_view(moved)
    if read := summary.get("reference"):
        out["reference"] = _reference_view(read)
    if sampling := summary.get("sampling"):
        out["sampling"] = _sampling_view(sampling)
    return out


PAIRED_HEAD = ["suite", "assertion pairs", "cases", "harmful", "beneficial", "loss", "bounds (one-sided)", "margin",
               "alpha", "needed", "supports margin", "verdict"]


def _paired_rows(p: Statistics | None) -> list[list[str]]:
    """The paired verdict as table rows: one for the battery, or one per suite under per-suite margins."""
    if not p:
        return []
    judged = list(p["suites"].items()) if "suites" in p else [("all", p)]
    return [[name, str(s["n"]), str(s["clusters"]), str(s["harmful"]), str(s["beneficial"]), f"{s['loss']:.3f}",
             f"[{s['lower']:.3f}, {s['upper']:.3f}]", f"{s['margin']:g}", f"{s['alpha']:g}",
             "no finite number" if s["needed"] is None else str(s["needed"]), f"{s['supported_margin']:.3f}", s["verdict"]]
            for name, s in judged]


SEQUENTIAL_HEAD = ["cases run", "seed", "harmful", "beneficial", "loss per case", "bounds (one-sided)", "margin", "alpha",
                   "decision", "stopped"]


def _sequential_rows(s: SequentialSummary) -> list[list[str]]:
    """A sequential evaluation's rule where it stopped (gate/stats/sequential.py), as one table row."""
    return [[f"{s['cases']} of {s['battery_cases']}", str(s["seed"]), str(s["harmful"]), str(s["beneficial"]),
             f"{s['loss']:.3f}", f"[{s['lower']:.3f}, {s['upper']:.3f}]", f"{s['margin']:g}", f"{s['alpha']:g}",
             s["decision"], str(s["stopped"])]]


DISTANCE_HEAD = ["", "positions", "KLD mean ± SE", "KLD median", "KLD p99", "KLD max", "same top-1", "Δp RMS"]
KLD_QUANTILES: tuple[Literal["min", "p1", "p10", "median", "p90", "p95", "p99", "p999", "max"], ...] = (
    "min", "p1", "p10", "median", "p90", "p95", "p99", "p999", "max")


def _distance_view(summary: DistanceSummary | NotObservable) -> Unobserved | DistanceTable:
    """The teacher-forced distance beside its A/A floor as table rows and KLD quantiles; or why it was not read."""
    d = observed(summary)
    if d is None:
        return {"not_observable": cast(NotObservable, summary)["not_observable"]}
    floor = d["floor"]
    assert floor is not None  # the evaluator reads the A/A floor with every distance it records
    rows = [[label, str(x["positions"]), f"{x['kld']['mean']:.3g} ± {x['kld']['se']:.2g}", f"{x['kld']['median']:.3g}",
             f"{x['kld']['p99']:.3g}", f"{x['kld']['max']:.3g}", f"{100 * x['same_top1']:.2f}% ± {100 * x['same_top1_se']:.2f}%",
             f"{100 * x['delta_p_rms']:.3g}%"] for label, x in (("off~on", d["distance"]), ("A/A floor", floor))]
    quantiles: list[Quantile] = [{"q": q, "on": d["distance"]["kld"][q], "floor": floor["kld"][q]} for q in KLD_QUANTILES]
    return {"rows": rows, "quantiles": quantiles, "reason": d.get("reason")}


REFERENCE_HEAD = ["arm", "positions", "in the probes", "control reads", "flips", "departures", "largest gap", "first departure"]


def _reference_view(summary: ReferenceSummary | NotObservable) -> Unobserved | ReferenceTable:
    """The reference arm (gate/arms/reference.py): per arm, what a cache-free read of its answers says; or why none."""
    r = observed(summary)
    if r is None:
        return {"not_observable": cast(NotObservable, summary)["not_observable"]}

    def first(d: list[DepartureRecord]) -> str:
        return (f"{d[0]['case']} turn {d[0]['turn']} token {d[0]['position']}: emitted {d[0]['emitted']}, the reference "
                f"picks {d[0]['reference']} by {d[0]['margin']:.3g}" if d else "-")

    rows = [[f"flag-{name}", str(a["positions"]), str(a.get("probed", 0)), str(a["controls"]), str(a["flips"]), str(a["departed"]),
             f"{a['max_gap']:.3g}", first(a["departures"])] for name, a in r["arms"].items()]
    floor = ", ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in r["floor"].items())
    note = (f"{r['dtype']}, one pass, no cache; noise floor: {floor}; counted: flips above a margin "
            f"of {r['tolerance']['flip_margin']:.3g}, gaps above {r['tolerance']['gap']:.3g}")
    if second := r.get("second"):
        note += (f"; a second, independent reference (transformers reading {second['weights']}, {second['dtype']}) "
                 f"picks otherwise at {second['disagreed']} of {second['positions']} positions")
        if w := second["where"]:
            note += (f", first {w[0]['case']} turn {w[0]['turn']} token {w[0]['position']}: the engine's read picks "
                     f"{w[0]['engine']}, transformers {w[0]['transformers']} by {w[0]['margin']:.3g}")
    return {"rows": rows, "note": note}


SAMPLING_HEAD = ["side", "draws read", "Kolmogorov-Smirnov D", "p", "impossible draws", "first impossible"]
TV_HEAD = ["class", "coupled steps", "mismatched", "mean per-step TV at most"]


def _sampling_view(s: SamplingSummary) -> SamplingView:
    """Sampled decoding (gate/stats/coupling.py, gate/stats/pit.py): what the paired draws certify, per position class and stage,
    and each side's draws against the declared decoding."""
    rows = [[f"flag-{side}", str(d["steps"]), f"{d['statistic']:.3g}", f"{d['p']:.2g}", str(d["impossible"]),
             d["where"][0] if d["where"] else "-"] for side, d in (s.get("declared") or {}).items()]
    decoding = "; ".join(f"{suite}: {d}" for suite, d in s["decoding"].items())
    classes = s.get("classes") or []  # recorded before the classes: one pooled bound, named as what it was
    tv = (f"per-step total variation, averaged within each position class and stage, at most {s['tv_bound']:.3g} "
          f"({1 - s['alpha']:.0%}, each of the {len(classes)} classes below at alpha/{len(classes)}), "
          f"{s['tv_mean_bound']:.3g} averaged over all compared steps (early steps weigh most)"
          if classes else f"total variation averaged over the compared steps at most {s['tv_bound']:.3g} "
          f"({1 - s['alpha']:.0%}; recorded before the per-class bounds)")
    return {"rows": rows, "classes": [[c["class"], str(c["steps"]), str(c["mismatches"]), f"{c['bound']:.3g}"]
                                      for c in classes],
            "note": f"{decoding}. {s['answers']} answers paired by seed, {s['steps']} coupled steps, "
                    f"{s['mismatches']} mismatched: {tv}; {s['sampler_state']} coupled steps weighed differently by "
                    f"the samplers; sampler: {chain['sampler'] if (chain := s.get('chain')) else '-'}"
                    + (f"; controls: no shared seed {c['unpaired']}, the temperature doubled {c['planted']}"
                       if (c := s.get("controls")) else "")}


def _calibration(c: CalibrationRow) -> CalibrationView:
    """One calibration of the evaluation: per planted fault, the share of cases the gate flagged."""
    result = c["result"]
    # Calibrations recorded before drift was counted flagged by outputs alone.
    return {"id": c["id"], "operator": c["operator"], "at": c["at"], "engine": result.get("engine"),
            "cases": result.get("cases"), "cost_flag_on_runs": (result.get("seconds") or {}).get("per_flag_on_run"),
            "drift_rule": rule["rule"] if (rule := result.get("drift_rule")) else None, "mode": result.get("mode", "full"),
            "twin": twin["engine"] if (twin := result.get("twin")) else None,
            "faults": [{"spec": f.get("spec"), "kind": f.get("kind"), "size": f.get("size"), "supported": f.get("supported"),
                        "flagged": f.get("flagged"), "cases": f.get("cases"), "share": f.get("share"),
                        "share_outputs": f.get("share_outputs", f.get("share")), "share_drift": f.get("share_drift")}
                       for f in result["faults"]]}


def render(record: EvaluationRecord, fmt: str) -> str:
    if fmt == "junit":
        return junit.render(record)
    v = view(record)
    if fmt == "json":
        return json.dumps({**v, "record": record}, indent=2, ensure_ascii=False, default=str) + "\n"
    return markdown(v) if fmt == "md" else page(v)


def _value(x: object) -> str:
    return x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, default=str)


def _fmt(x: object) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


# --- Markdown ----------------------------------------------------------------------------------


def _md(text: object) -> str:
    """Plain text in a table cell or a line: no raw HTML, no table breaks."""
    return html.escape(_value(text), quote=False).replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """An inline code span that survives backticks in ``text``."""
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if text else "(empty)"


def _block(text: str) -> str:
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text}\n{fence}"


def _labels(d: Difference) -> str:
    """``near-tie: yes/no; one-sided collapse: ...``, shared by Markdown and HTML."""
    collapse = ("not recorded" if not d["collapse_recorded"] else "no" if d["collapse"] not in ("a", "b")
                else f"yes, {d['label_a'] if d['collapse'] == 'a' else d['label_b']}")
    return f"near-tie: {'yes' if d['near_tie'] else 'no'}; one-sided collapse: {collapse}"


def _side_md(side: DivergentSide | None) -> str:
    if not side:
        return "-"
    piece = side.get("piece")
    return (f"token {_fmt(side.get('token'))} "
            f"{_code(json.dumps(piece, ensure_ascii=False)) if piece is not None else '(none: output ended)'}, "
            f"margin {_fmt(side.get('margin'))}")


def _strength_rows(s: StrengthView) -> list[tuple[str, str]]:
    """The strength figures as (label, value) rows, shared by Markdown and HTML."""
    return [("grade", s["grade"] or "none: the outputs differ"),
            ("max top-2 logit drift", _fmt(s["max_drift"]) if s["max_drift"] is not None else "unknown"),
            ("where", s["where_text"] or "-"),
            (f"steps at risk (top-2 margin within {AT_RISK}× the drift)", f"{s['steps_at_risk']} of {s['steps']}"),
            ("steps without top-2 logits (drift unknown)", str(s["unknown"]))] + (
        [("assertion flips (harmful / beneficial of pairs)", f"{f['harmful']} / {f['beneficial']} of {f['pairs']}")]
        if (f := s.get("flips")) else [])


def _strength_md(s: StrengthView | None) -> list[str]:
    if s is None:
        return ["Not recorded (byte-equivalence evaluations are graded)."]
    return [f"- {label}: {'**' + _md(value) + '**' if label == 'grade' else _md(value)}" for label, value in _strength_rows(s)]


def markdown(v: View) -> str:
    lines = [f"# Evaluation {v['evaluation']}: {_md(v['flag'])} — {v['verdict'] or v['status']}", ""]
    lines += [f"- status: **{v['status']}**", f"- gate: {_md(v['gate'])}", f"- operator: {_md(v['operator'])}",
              f"- started: {v['started_at']}", f"- finished: {v['finished_at'] or '-'}",
              f"- configuration: {_md(v['config'])}"]
    if v["aborted"]:
        lines.append(f"- aborted: {_md(v['aborted'])}")
    lines += ["", "## Reasons", ""] + ([f"- {_md(r)}" for r in v["reasons"]] or ["- (none recorded)"])

    lines += ["", "## Identities", "", "| part | off | on | |", "|---|---|---|---|"]
    lines += [f"| {_md(r['part'])} | {_md(r['off'])} | {_md(r['on'])} | {'**differs**' if r['differs'] else ''} |"
              for r in v["identity_rows"]]

    lines += ["", "## Per stage (first run of each configuration)", "",
              "| stage | config | calls | prompt tokens | cached tokens | computed tokens | prefill s | decode s |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {_md(s['stage'])} | {s['config']} | {s['calls']} | {s['prompt_tokens']} | {_na(s['cached_tokens'])} | "
              f"{_na(s['computed_tokens'])} | {s['prefill_s']:.4f} | {s['decode_s']:.4f} |" for s in v["stages"]]

    lines += ["", "## Prompt tokens per stage: off vs computed on", ""]
    peak = max([max(c["prompt_off"], c["computed_on"]) for c in v["chart"]] + [1])
    width = max([len(c["stage"]) for c in v["chart"]] + [5])
    bars = []
    for c in v["chart"]:
        for label, n in ((c["stage"], c["prompt_off"]), ("", c["computed_on"])):
            which = "off" if label else "on "
            bars.append(f"{label:<{width}} {which} {'█' * round(40 * n / peak):<40} {n}")
    lines.append(_block("\n".join(bars)))

    lines += ["", "## Strength (off#0~on#0)", ""] + _strength_md(v["strength"])
    if v.get("paired"):
        lines += ["", "## Paired outcomes (flag off vs on)", "", "| " + " | ".join(PAIRED_HEAD) + " |",
                  "|---|" + "---:|" * (len(PAIRED_HEAD) - 2) + "---|"]
        lines += ["| " + " | ".join(_md(x) for x in row) + " |" for row in v["paired"]]
    if v.get("sequential"):
        lines += ["", "## Sequential evaluation (anytime-valid)", "", "| " + " | ".join(SEQUENTIAL_HEAD) + " |",
                  "|" + "---:|" * (len(SEQUENTIAL_HEAD) - 2) + "---|---|"]
        lines += ["| " + " | ".join(_md(x) for x in row) + " |" for row in v["sequential"]]
    if v.get("looks"):
        lines += ["", f"Looks: {_md(v['looks'])}"]
    if v.get("distance"):
        lines += ["", "## Teacher-forced distance (KL(off‖on) per position)", ""] + _distance_md(v["distance"])
    if v.get("reference"):
        lines += ["", "## Reference arm (each arm against a cache-free read of its answers)", ""] + (
            [f"Not observable: {_md(v['reference']['not_observable'])}"] if "not_observable" in v["reference"] else
            ["| " + " | ".join(REFERENCE_HEAD) + " |", "|---|" + "---:|" * 6 + "---|"]
            + ["| " + " | ".join(_md(x) for x in row) + " |" for row in v["reference"]["rows"]]
            + ["", _md(v["reference"]["note"])])
    if v.get("sampling"):
        lines += ["", "## Sampled decoding (paired draws, and each side's draws against the declared decoding)", "",
                  _md(v["sampling"]["note"])] + (
            ["", "| " + " | ".join(TV_HEAD) + " |", "|---|" + "---:|" * 3]
            + ["| " + " | ".join(_md(x) for x in row) + " |" for row in v["sampling"]["classes"]]
            if v["sampling"].get("classes") else []) + (
            ["", "| " + " | ".join(SAMPLING_HEAD) + " |", "|---|" + "---:|" * 4 + "---|"]
            + ["| " + " | ".join(_md(x) for x in row) + " |" for row in v["sampling"]["rows"]]
            if v["sampling"]["rows"] else [])
    lines += ["", "## Cache probes", ""] + (["| probe | outcome |", "|---|---|"] + [
        f"| {name} | {_md(status)} |" for name, status in v["probes"].items()] + ["", f"{v['probe_seconds']} s in all"]
        if v["probes"] else ["None ran."])
    lines += ["", f"## Near-ties in the flag-off baseline (top-2 margin at or below {v['near_tie_threshold']:g})", ""]
    if v["near_ties"]:
        lines += ["| suite | decode steps | near-ties | smallest margin | without top-2 |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {_md(r['suite'])} | {r['steps']} | {r['near_ties']} | {_fmt(r['min_margin'])} | {r.get('unknown', 0)} |"
                  for r in v["near_ties"]]
        lines += [""] + [f"- **insensitive**: suite {_md(r['suite'])} never came near a tie, so it cannot show a numeric "
                         "divergence (advice, not a failure)" for r in v["near_ties"] if r["insensitive"]]
    else:
        lines.append("Not recorded.")

    lines += ["", f"## Calibrations ({len(v['calibrations'])})", ""]
    if not v["calibrations"]:
        lines.append("None: run gatekeeper calibrate --evaluation ID to measure the gate's power to say no.")
    for cal in v["calibrations"]:
        cost = f", cost {cal['cost_flag_on_runs']:g} flag-on runs" if cal["cost_flag_on_runs"] else ""
        twin = f", measured on the twin {_md(cal['twin'])} (the served weights, checked by digest)" if cal["twin"] else ""
        lines += [f"Calibration {cal['id']} by {_md(cal['operator'])} at {cal['at']} ({_md(cal['engine'])}, {cal['cases']} cases{cost}{twin}):", "",
                  "| planted fault | flagged | share | by outputs | by drift | |", "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {f['spec']} | {f['flagged']} / {f['cases']} | {share:.0%} | {_pct(f['share_outputs'])} | "
                  f"{_pct(f['share_drift'])} | {'█' * round(20 * share)} |"
                  if f["supported"] and (share := f["share"]) is not None
                  else f"| {f['spec']} | - | - | - | - | not supported by this engine |" for f in cal["faults"]]
        if cal["drift_rule"]:
            lines += ["", f"By drift: {_md(cal['drift_rule'])}."]
        lines.append("")

    lines += ["", f"## Differing cases ({len(v['differences'])})", ""]
    if not v["differences"]:
        lines.append("None: every comparison was equal.")
    for d in v["differences"]:
        lines += [f"### {_md(d['case_id'])} ({_md(d['pair'])}{', turn ' + str(d['turn']) if d['turn'] else ''})", ""]
        if d["first_divergent_position"] is not None:
            lines += [f"First divergent position: **{d['first_divergent_position']}** (generated tokens, from 0); "
                      f"{_md(_labels(d))}", "",
                      f"- {_md(d['label_a'])}: {_side_md(d['a'])}", f"- {_md(d['label_b'])}: {_side_md(d['b'])}", "",
                      f"Where they part: {_md(d['divergence'])}", ""]
        else:
            lines += ["The outputs are identical; the assertion outcomes differ.", ""]
        k = d["divergent_char"]
        lines.append(f"{MARK} marks where the texts part (character {k}).")
        for label, text in ((d["label_a"], d["text_a"]), (d["label_b"], d["text_b"])):
            lines += ["", f"**{_md(label)}**", "", _block(text[:k] + MARK + text[k:])]
        if d["outcomes_diff"]:
            lines += ["", "Assertion outcomes differ:", "", _block(json.dumps(d["outcomes_diff"], indent=2, default=str))]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- HTML --------------------------------------------------------------------------------------

STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:72rem;padding:0 1rem;color:#1b1f24}
h1{font-size:1.6rem}h2{margin-top:2rem;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #d0d7de;padding:.25rem .5rem;vertical-align:top;overflow-wrap:anywhere}
th[scope=row]{text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.differs{background:#fff8c5}
.verdict{display:inline-block;padding:.2rem .7rem;border-radius:.3rem;color:#fff;font-weight:700}
.PASS{background:#1a7f37}.FAIL{background:#cf222e}.INCONCLUSIVE,.running,.aborted{background:#9a6700}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:1rem}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;padding:.6rem;border:1px solid #d0d7de}
mark{background:#ffd8d3;outline:1px solid #cf222e}
code{background:#f6f8fa;padding:0 .2rem}
tr.insensitive,p.insensitive{background:#ddf4ff}td.grade{font-weight:700}
"""


def _distance_md(d: Unobserved | DistanceTable) -> list[str]:
    if "not_observable" in d:
        return [f"Not observable: {_md(d['not_observable'])}"]
    return (["| " + " | ".join(DISTANCE_HEAD) + " |", "|---|" + "---:|" * (len(DISTANCE_HEAD) - 1)]
            + ["| " + " | ".join(_md(x) for x in row) + " |" for row in d["rows"]]
            + ["", "| KLD quantile | off~on | A/A floor |", "|---|---:|---:|"]
            + [f"| {q['q']} | {q['on']:.3g} | {q['floor']:.3g} |" for q in d["quantiles"]])


def _e(x: object) -> str:
    return html.escape(_value(x), quote=True)


def _table(head: list[str] | None, rows: list[list[str]], classes: list[str] | None = None) -> str:
    out = ["<table>" + ("<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>" if head else "") + "<tbody>"]
    for n, row in enumerate(rows):
        cls = f' class="{classes[n]}"' if classes and classes[n] else ""
        out.append(f"<tr{cls}>" + "".join(row) + "</tr>")
    return "".join(out) + "</tbody></table>"


def _num(x: object) -> str:
    return f'<td class="n">{_e(_fmt(x))}</td>'


def chart_svg(chart: list[ChartRow]) -> str:
    """Grouped horizontal bars, two per stage: prompt tokens with the flag off, tokens computed with it on."""
    label_w, bar_w, bar_h, gap = 160, 440, 16, 14
    peak = max([max(c["prompt_off"], c["computed_on"]) for c in chart] + [1])
    height = 30 + len(chart) * (2 * bar_h + gap)
    parts = [f'<svg role="img" width="{label_w + bar_w + 90}" height="{height}" '
             f'font-size="12" font-family="system-ui,sans-serif"><title>Prompt tokens off vs computed on, per stage</title>',
             '<rect x="0" y="4" width="12" height="12" fill="#57606a"/><text x="16" y="14">off: prompt tokens</text>',
             '<rect x="150" y="4" width="12" height="12" fill="#1a7f37"/><text x="166" y="14">on: prompt tokens computed</text>']
    y = 30
    for c in chart:
        parts.append(f'<text x="0" y="{y + bar_h + 4}">{_e(c["stage"])}</text>')
        for n, colour in ((c["prompt_off"], "#57606a"), (c["computed_on"], "#1a7f37")):
            w = round(bar_w * n / peak)
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w}" height="{bar_h}" fill="{colour}"/>'
                         f'<text x="{label_w + w + 4}" y="{y + bar_h - 4}">{n}</text>')
            y += bar_h
        y += gap
    return "".join(parts) + "</svg>"


def curve_svg(faults: list[FaultView]) -> str:
    """The detection curve: share of cases flagged against planted noise (log scale), with the
    positional faults as points on the right."""
    # a supported fault holds its share: (fault, share) pairs, so the share reads as a number
    noise = [(f, s) for f in faults if f["kind"] == "noise" and f["supported"] and f["size"] > 0 and (s := f["share"]) is not None]
    other = [(f, s) for f in faults if f["kind"] != "noise" and f["supported"] and (s := f["share"]) is not None]
    left, top, w, h = 50, 20, 360, 160
    width = left + w + 40 + 90 * len(other)
    parts = [f'<svg role="img" width="{width}" height="{top + h + 50}" font-size="12" font-family="system-ui,sans-serif">'
             "<title>Detection curve: share of cases flagged against planted fault size</title>",
             f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#57606a"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#57606a"/>',
             f'<text x="{left - 8}" y="{top + 4}" text-anchor="end">100%</text>',
             f'<text x="{left - 8}" y="{top + h + 4}" text-anchor="end">0%</text>',
             f'<text x="{left + w / 2}" y="{top + h + 36}" text-anchor="middle">relative noise on the restored state</text>']
    if noise:
        lo, hi = math.log10(min(f["size"] for f, _ in noise)), math.log10(max(f["size"] for f, _ in noise))
        xs = [left + (w * (math.log10(f["size"]) - lo) / (hi - lo) if hi > lo else w / 2) for f, _ in noise]
        ys = [top + h * (1 - share) for _, share in noise]
        parts.append('<polyline fill="none" stroke="#1a7f37" stroke-width="2" points="'
                     + " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys)) + '"/>')
        for (f, _), x, y in zip(noise, xs, ys):
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#1a7f37"/>'
                         f'<text x="{x:.1f}" y="{top + h + 16}" text-anchor="middle">{_e(format(f["size"], "g"))}</text>')
    for n, (f, share) in enumerate(other):
        x, y = left + w + 60 + 90 * n, top + h * (1 - share)
        parts.append(f'<circle cx="{x}" cy="{y:.1f}" r="4" fill="#cf222e"/>'
                     f'<text x="{x}" y="{top + h + 16}" text-anchor="middle">{_e(f["spec"])}</text>'
                     f'<text x="{x + 7}" y="{y + 4:.1f}">{share:.0%}</text>')
    return "".join(parts) + "</svg>"


def kld_svg(quantiles: list[Quantile]) -> str:
    """KLD quantiles, flag on against the A/A floor, as bars on a log scale (1e-8 nats at the baseline)."""
    floor_, top = -8.0, max(-1.0, *(math.log10(max(x, 1e-8)) for q in quantiles for x in (q["on"], q["floor"])))
    w, row = 420, 16

    def bar(x: float) -> float:
        return round(w * (math.log10(max(x, 1e-8)) - floor_) / (top - floor_), 1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 170}" height="{row * 2 * len(quantiles) + 10}" '
           'role="img" aria-label="KLD quantiles, log scale">']
    for i, q in enumerate(quantiles):
        y = i * 2 * row
        out += [f'<text x="0" y="{y + 12}" font-size="11">{_e(q["q"])}</text>',
                f'<rect x="50" y="{y + 2}" width="{bar(q["on"])}" height="{row - 4}" fill="#c0392b"/>',
                f'<text x="{56 + bar(q["on"])}" y="{y + 12}" font-size="10">{q["on"]:.2g}</text>',
                f'<rect x="50" y="{y + row}" width="{bar(q["floor"])}" height="{row - 4}" fill="#95a5a6"/>',
                f'<text x="{56 + bar(q["floor"])}" y="{y + row + 10}" font-size="10">floor {q["floor"]:.2g}</text>']
    return "\n".join(out + ["</svg>"])


def _distance_html(d: Unobserved | DistanceTable) -> str:
    if "not_observable" in d:
        return f"<p>Not observable: {_e(d['not_observable'])}</p>"
    return (_table(DISTANCE_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in d["rows"]])
            + "<p>KLD quantiles, flag on (red) against the A/A floor (grey), log scale:</p>" + kld_svg(d["quantiles"]))


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _calibration_html(c: CalibrationView) -> str:
    cost = f", cost {_e(c['cost_flag_on_runs'])} flag-on runs" if c["cost_flag_on_runs"] else ""
    rows = [[f"<td>{_e(f['spec'])}</td>", f"<td class=\"n\">{_e(f['flagged'])} / {_e(f['cases'])}</td>",
             f"<td class=\"n\">{f['share']:.0%}</td>", f"<td class=\"n\">{_pct(f['share_outputs'])}</td>",
             f"<td class=\"n\">{_pct(f['share_drift'])}</td>"] if f["supported"] else
            [f"<td>{_e(f['spec'])}</td>", "<td>-</td>", "<td>not supported by this engine</td>", "<td>-</td>", "<td>-</td>"]
            for f in c["faults"]]
    rule = f"<p>By drift: {_e(c['drift_rule'])}.</p>" if c["drift_rule"] else ""
    twin = f", measured on the twin {_e(c['twin'])} (the served weights, checked by digest)" if c["twin"] else ""
    return (f"<p>Calibration {_e(c['id'])} by {_e(c['operator'])} at {_e(c['at'])} ({_e(c['engine'])}, "
            f"{_e(c['cases'])} cases{cost}{twin})</p>" + curve_svg(c["faults"]) +
            _table(["planted fault", "flagged", "share", "by outputs", "by drift"], rows) + rule)


def _side_html(label: str, side: DivergentSide | None) -> list[str]:
    piece = side.get("piece") if side else None
    return [f"<td>{_e(label)}</td>", _num(side.get("token") if side else None),
            f"<td><code>{_e(json.dumps(piece, ensure_ascii=False)) if piece is not None else '(output ended)'}</code></td>",
            _num(side.get("margin") if side else None)]


def _difference_html(d: Difference) -> str:
    turn = f", turn {d['turn']}" if d["turn"] else ""
    out = [f'<section class="difference"><h3>{_e(d["case_id"])} <small>({_e(d["pair"])}{turn})</small></h3>']
    if d["first_divergent_position"] is not None:
        out.append(f'<p>First divergent position: <strong class="position">{d["first_divergent_position"]}</strong> '
                   f'(generated tokens, from 0); {_e(_labels(d))}</p>')
        out.append(_table(["run", "token", "piece", "top-2 logit margin"],
                          [_side_html(d["label_a"], d["a"]), _side_html(d["label_b"], d["b"])]))
        out.append(f'<p>Where they part: {_e(d["divergence"])}</p>')
    else:
        out.append("<p>The outputs are identical; the assertion outcomes differ.</p>")
    k = d["divergent_char"]
    out.append('<div class="pair">')
    for label, text in ((d["label_a"], d["text_a"]), (d["label_b"], d["text_b"])):
        out.append(f'<div><h4>{_e(label)}</h4><pre>{_e(text[:k])}<mark title="the outputs part here">'
                   f'{_e(text[k:])}</mark></pre></div>')
    out.append("</div>")
    if d["outcomes_diff"]:
        out.append(f"<p>Assertion outcomes differ:</p><pre>{_e(json.dumps(d['outcomes_diff'], indent=2, default=str))}</pre>")
    return "".join(out) + "</section>"


def _strength_html(s: StrengthView | None) -> str:
    if s is None:
        return "<p>Not recorded (byte-equivalence evaluations are graded).</p>"
    return _table(None, [[f'<th scope="row">{_e(label)}</th>',
                          f'<td class="grade">{_e(value)}</td>' if label == "grade" else f"<td>{_e(value)}</td>"]
                         for label, value in _strength_rows(s)])


def _near_ties_html(rows: list[Census]) -> str:
    if not rows:
        return "<p>Not recorded.</p>"
    out = [_table(["suite", "decode steps", "near-ties", "smallest margin", "without top-2"],
                  [[f"<td>{_e(r['suite'])}</td>", _num(r["steps"]), _num(r["near_ties"]), _num(r["min_margin"]),
                    _num(r.get("unknown", 0))] for r in rows],
                  ["insensitive" if r["insensitive"] else "" for r in rows])]
    out += [f'<p class="insensitive"><strong>insensitive</strong>: suite {_e(r["suite"])} never came near a tie, so it '
            "cannot show a numeric divergence (advice, not a failure)</p>" for r in rows if r["insensitive"]]
    return "".join(out)


def page(v: View) -> str:
    shown = v["verdict"] or v["status"]
    body = [f"<h1>Evaluation {v['evaluation']}: {_e(v['flag'])}</h1>",
            f'<p><span class="verdict {_e(shown)}">{_e(shown)}</span></p>',
            _table(None, [[f'<th scope="row">{k}</th>', f"<td>{_e(val if val is not None else '-')}</td>"] for k, val in (
                ("status", v["status"]), ("gate", v["gate"]), ("operator", v["operator"]), ("started", v["started_at"]),
                ("finished", v["finished_at"]), ("aborted", v["aborted"]), ("configuration", v["config"]))]),
            "<h2>Reasons</h2><ul>" + ("".join(f"<li>{_e(r)}</li>" for r in v["reasons"]) or "<li>(none recorded)</li>") + "</ul>",
            "<h2>Identities</h2>",
            _table(["part", "off", "on"], [[f"<td>{_e(r['part'])}</td>", f"<td>{_e(r['off'])}</td>", f"<td>{_e(r['on'])}</td>"]
                                           for r in v["identity_rows"]],
                   ["differs" if r["differs"] else "" for r in v["identity_rows"]]),
            "<h2>Per stage</h2><p>First run of each configuration.</p>",
            _table(["stage", "config", "calls", "prompt tokens", "cached tokens", "computed tokens", "prefill s", "decode s"],
                   [[f"<td>{_e(s['stage'])}</td>", f"<td>{_e(s['config'])}</td>"] +
                    [_num(x) for x in (s["calls"], s["prompt_tokens"], s["cached_tokens"], s["computed_tokens"], s["prefill_s"],
                                       s["decode_s"])]
                    for s in v["stages"]]),
            "<h2>Prompt tokens per stage: off vs computed on</h2>", chart_svg(v["chart"]),
            "<h2>Strength <small>(off#0~on#0)</small></h2>", _strength_html(v["strength"]),
            *(["<h2>Paired outcomes <small>(flag off vs on)</small></h2>",
               _table(PAIRED_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in v["paired"]])] if v.get("paired") else []),
            *(["<h2>Sequential evaluation <small>(anytime-valid)</small></h2>",
               _table(SEQUENTIAL_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in v["sequential"]])]
              if v.get("sequential") else []),
            *([f"<p>Looks: {_e(v['looks'])}</p>"] if v.get("looks") else []),
            *(["<h2>Teacher-forced distance <small>(KL(off‖on) per position)</small></h2>", _distance_html(v["distance"])]
              if v.get("distance") else []),
            *(["<h2>Reference arm <small>(each arm against a cache-free read of its answers)</small></h2>",
               (f"<p>Not observable: {_e(v['reference']['not_observable'])}</p>" if "not_observable" in v["reference"]
                else _table(REFERENCE_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in v["reference"]["rows"]])
                + f"<p>{_e(v['reference']['note'])}</p>")] if v.get("reference") else []),
            *(["<h2>Sampled decoding <small>(paired draws, and each side's draws against the declared decoding)</small></h2>",
               f"<p>{_e(v['sampling']['note'])}</p>"
               + (_table(TV_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in v["sampling"]["classes"]])
                  if v["sampling"].get("classes") else "")
               + (_table(SAMPLING_HEAD, [[f"<td>{_e(x)}</td>" for x in row] for row in v["sampling"]["rows"]])
                  if v["sampling"]["rows"] else "")] if v.get("sampling") else []),
            "<h2>Cache probes</h2>", (_table(["probe", "outcome"], [[f"<td>{_e(k)}</td>", f"<td>{_e(st)}</td>"]
                                                                   for k, st in v["probes"].items()])
                                      if v["probes"] else "<p>None ran.</p>"),
            f"<h2>Near-ties in the flag-off baseline <small>(top-2 margin at or below {v['near_tie_threshold']:g})</small></h2>",
            _near_ties_html(v["near_ties"]),
            f"<h2>Calibrations ({len(v['calibrations'])})</h2>",
            *([_calibration_html(c) for c in v["calibrations"]] or
              ["<p>None: run <code>gatekeeper calibrate --evaluation ID</code> to measure the gate's power to say no.</p>"]),
            f"<h2>Differing cases ({len(v['differences'])})</h2>"]
    body += [_difference_html(d) for d in v["differences"]] or ["<p>None: every comparison was equal.</p>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>gatekeeper evaluation {v['evaluation']}: {_e(v['flag'])} {_e(shown)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
