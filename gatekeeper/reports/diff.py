"""Two recorded evaluations side by side, case by case: which outcomes changed, where each run
parted, how far the logits drifted, what it cost, and which parts of the identity differ."""

from __future__ import annotations

from ..evidence import EvaluationRecord
from ..identity import flatten
from ..summaries import NotRequired, TVClass, TypedDict  # typing's, or typing_extensions' before 3.11
from .outcomes import CaseOutcome, case_flips, case_outcomes, divergence_text, verdict_summary

# --- what ``ledger diff --json`` prints and the review app's compare page shows ------------------------------------


class Totals(TypedDict):
    """A paired or sequential verdict's flip totals and its bound."""

    harmful: int
    beneficial: int
    loss: float
    lower: float
    upper: float
    margin: float


class SamplingTotals(TypedDict):
    """What the seed-paired draws of a sampled evaluation certify."""

    answers: int
    steps: int
    mismatches: int
    tv_bound: float
    tv_mean_bound: float | None  # None in rows recorded before the per-class bounds
    classes: list[TVClass] | None
    alpha: float


class Header(TypedDict):
    """One evaluation's line: who ran what, how it ended, its totals."""

    id: int
    flag: str
    gate: str
    status: str
    operator: str
    started_at: str
    model_seconds: float | None
    reasons: list[str]
    flips: NotRequired[Totals]  # paired and sequential verdicts only
    sampling: NotRequired[SamplingTotals]  # sampled decoding only


class FirstDivergence(TypedDict):
    """Where a case's runs first parted: turn, position, both tokens and margins, in words too."""

    turn: int | None
    position: int | None
    tokens: list[int | None]  # [a, b]
    margins: list[float | None]
    near_tie: bool | None
    collapse: str | None
    text: str


class Side(TypedDict):
    """A case in one of the two evaluations."""

    status: str
    first_divergence: FirstDivergence | None
    drift: float | None
    seconds: dict[str, float]
    passed: dict[str, str]
    flips: NotRequired[list[int]]  # [harmful, beneficial], for the gates judged on flips


class CaseRow(TypedDict):
    """A case in both evaluations (None: not run in that one), and whether its outcome changed."""

    case_id: str
    a: Side | None
    b: Side | None
    changed: bool
    href_a: NotRequired[str | None]  # the review app's compare page: each side's case page
    href_b: NotRequired[str | None]


class PartDiff(TypedDict):
    """A dotted identity or configuration part whose values differ."""

    part: str
    a: object
    b: object


class OnlyIn(TypedDict):
    only_a: list[str]
    only_b: list[str]


class Diff(TypedDict):
    """Evaluation ``a`` against ``b``."""

    a: Header
    b: Header
    verdict_changed: bool
    identity: list[PartDiff]
    config: list[PartDiff]
    reasons: OnlyIn
    cases: list[CaseRow]
    changed_cases: list[str]


def _header(record: EvaluationRecord) -> Header:
    summary = verdict_summary(record)
    stats = (summary.get("sequential") or summary.get("paired")) if summary else None
    out: Header = {"id": record["id"], "flag": record["flag"], "gate": record["gate"], "status": record["status"],
                   "operator": record["operator"], "started_at": record["started_at"],
                   "model_seconds": summary.get("model_seconds") if summary else None,
                   "reasons": record.get("reasons") or []}
    # a paired or sequential verdict's totals (absent for the others, whose diff reads as it did)
    if stats and "suites" not in stats:
        out["flips"] = {"harmful": stats.get("harmful"), "beneficial": stats.get("beneficial"), "loss": stats.get("loss"),
                        "lower": stats.get("lower"), "upper": stats.get("upper"), "margin": stats.get("margin")}
    # sampled decoding: what the seed-paired draws certify (absent for greedy evaluations)
    if summary and (s := summary.get("sampling")):
        out["sampling"] = {"answers": s.get("answers"), "steps": s.get("steps"), "mismatches": s.get("mismatches"),
                           "tv_bound": s.get("tv_bound"), "tv_mean_bound": s.get("tv_mean_bound"),
                           "classes": s.get("classes"), "alpha": s.get("alpha")}
    return out


def _side(case: CaseOutcome | None, flips: dict[str, tuple[int, int]]) -> Side | None:
    if case is None:
        return None
    d = case.divergence or case.unstable
    a, b = (d.get("a"), d.get("b")) if d else (None, None)
    out: Side = {"status": case.status, "first_divergence": None if d is None else {
                     "turn": d.get("turn"), "position": d.get("first_divergent_position"),
                     "tokens": [a.get("token") if a else None, b.get("token") if b else None],
                     "margins": [a.get("margin") if a else None, b.get("margin") if b else None],
                     "near_tie": d.get("near_tie"), "collapse": d.get("collapse"), "text": divergence_text(d)},
                 "drift": case.drift, "seconds": case.seconds, "passed": case.passed}
    if case.case_id in flips:
        out["flips"] = list(flips[case.case_id])  # [harmful, beneficial]
    return out


def _where(side: Side | None) -> tuple[int | None, int | None, tuple[int | None, ...]] | None:
    d = side["first_divergence"] if side else None
    return None if not d else (d["turn"], d["position"], tuple(d["tokens"]))


def _differing(a: dict[str, object], b: dict[str, object]) -> list[PartDiff]:
    fa, fb = flatten(a), flatten(b)
    return [{"part": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def diff(a: EvaluationRecord, b: EvaluationRecord) -> Diff:
    """Evaluation ``a`` against ``b``. A case *changed* when its status or its first divergence moved;
    drift and seconds are shown for every case but differ on every rerun, so they do not count."""
    cases_a = {c.case_id: c for c in case_outcomes(a)}
    cases_b = {c.case_id: c for c in case_outcomes(b)}
    flips_a, flips_b = case_flips(a), case_flips(b)
    rows: list[CaseRow] = []
    for cid in [*cases_a, *(c for c in cases_b if c not in cases_a)]:
        sa, sb = _side(cases_a.get(cid), flips_a), _side(cases_b.get(cid), flips_b)
        changed = (sa is None or sb is None or sa["status"] != sb["status"] or _where(sa) != _where(sb)
                   or sa.get("flips") != sb.get("flips"))
        rows.append({"case_id": cid, "a": sa, "b": sb, "changed": changed})
    return {
        "a": _header(a), "b": _header(b),
        "verdict_changed": a["status"] != b["status"],
        "identity": _differing(a.get("identity") or {}, b.get("identity") or {}),
        "config": _differing(a.get("config") or {}, b.get("config") or {}),
        "reasons": {"only_a": [r for r in _header(a)["reasons"] if r not in _header(b)["reasons"]],
                    "only_b": [r for r in _header(b)["reasons"] if r not in _header(a)["reasons"]]},
        "cases": rows,
        "changed_cases": [r["case_id"] for r in rows if r["changed"]],
    }


# --- as text -----------------------------------------------------------------------------------

def status_text(side: Side | None) -> str:
    if side is None:
        return "(not run)"
    where = side["first_divergence"]
    return side["status"] if where is None else f"{side['status']} at {where['text']}"


def num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def flips_text(side: Side | None) -> str:
    """A case's assertion flips off -> on: harmful / beneficial."""
    return "-" if side is None or (f := side.get("flips")) is None else f"{f[0]} / {f[1]}"


def totals_text(header: Header) -> str:
    f = header.get("flips")
    return "-" if not f else (f"{f['harmful']} harmful / {f['beneficial']} beneficial; loss {f['loss']:.3f}, "
                              f"bounds [{f['lower']:.3f}, {f['upper']:.3f}], margin {f['margin']:g}")


def sampling_text(header: Header) -> str:
    s = header.get("sampling")
    if not s:
        return "-"
    head = f"{s['answers']} answers, {s['steps']} coupled steps, {s['mismatches']} mismatched: "
    if not (classes := s["classes"]):  # recorded before the per-class bounds: its one bound is the average over compared steps
        return head + f"mean TV <= {s['tv_bound']:.3g}"
    worst = max(classes, key=lambda c: c["bound"])
    return head + (f"TV <= {s['tv_bound']:.3g} averaged within every position class and stage (largest in "
                   f"{worst['class']}), <= {s['tv_mean_bound']:.3g} averaged over all steps")


def seconds_text(side: Side | None) -> str:
    return "-" if side is None else " / ".join(f"{k} {v:.3g}" for k, v in side["seconds"].items())


def markdown(d: Diff) -> str:
    a, b = d["a"], d["b"]
    esc = lambda t: str(t).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    paired = "flips" in a or "flips" in b  # flips columns only where a side was judged on them
    lines = [f"# gatekeeper: evaluation {a['id']} vs {b['id']}", "",
             "| | A | B |", "|---|---|---|",
             *(f"| {k} | {esc(x)} | {esc(y)} |" for k, x, y in (
                 ("flag", a["flag"], b["flag"]), ("gate", a["gate"], b["gate"]), ("status", a["status"], b["status"]),
                 ("operator", a["operator"], b["operator"]), ("started_at", a["started_at"], b["started_at"]),
                 ("model_seconds", a["model_seconds"], b["model_seconds"]))),
             *([f"| flips | {esc(totals_text(a))} | {esc(totals_text(b))} |"] if paired else []),
             *([f"| sampling | {esc(sampling_text(a))} | {esc(sampling_text(b))} |"] if "sampling" in a or "sampling" in b else []),
             "", f"{len(d['changed_cases'])} of {len(d['cases'])} cases changed outcome{', flips' if paired else ''} or first divergence.",
             "", "## Cases", "",
             "| case | A | B | drift A | drift B | seconds A | seconds B |" + (" flips A | flips B |" if paired else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if paired else "")]
    for r in d["cases"]:
        mark = "**" if r["changed"] else ""
        lines.append(f"| {mark}`{r['case_id']}`{mark} | {esc(status_text(r['a']))} | {esc(status_text(r['b']))} | "
                     f"{num(r['a'] and r['a']['drift'])} | {num(r['b'] and r['b']['drift'])} | "
                     f"{seconds_text(r['a'])} | {seconds_text(r['b'])} |"
                     + (f" {flips_text(r['a'])} | {flips_text(r['b'])} |" if paired else ""))
    for title, rows in (("Identity that differs", d["identity"]), ("Configuration that differs", d["config"])):
        lines += ["", f"## {title}", ""]
        lines += (["| part | A | B |", "|---|---|---|", *(f"| `{r['part']}` | `{esc(r['a'])}` | `{esc(r['b'])}` |" for r in rows)]
                  if rows else ["none"])
    for side, only in (("A", d["reasons"]["only_a"]), ("B", d["reasons"]["only_b"])):
        if only:
            lines += ["", f"## Reasons only in {side}", "", *(f"- {esc(r)}" for r in only)]
    return "\n".join(lines) + "\n"
