"""Two recorded evaluations side by side, case by case: which outcomes changed, where each run
parted, how far the logits drifted, what it cost, and which parts of the identity differ."""

from __future__ import annotations

from typing import Any

from ..evidence import EvaluationRecord
from ..identity import flatten
from .outcomes import CaseOutcome, case_flips, case_outcomes, divergence_text, verdict_summary


def _header(record: EvaluationRecord) -> dict[str, Any]:
    summary = verdict_summary(record)
    stats = (summary.get("sequential") or summary.get("paired")) if summary else None
    return {"id": record["id"], "flag": record["flag"], "gate": record["gate"], "status": record["status"],
            "operator": record["operator"], "started_at": record["started_at"],
            "model_seconds": summary.get("model_seconds") if summary else None, "reasons": record.get("reasons") or [],
            # a paired or sequential verdict's totals (absent for the others, whose diff reads as it did)
            **({"flips": {"harmful": stats.get("harmful"), "beneficial": stats.get("beneficial"), "loss": stats.get("loss"),
                          "lower": stats.get("lower"), "upper": stats.get("upper"), "margin": stats.get("margin")}}
               if stats and "suites" not in stats else {}),
            # sampled decoding: what the seed-paired draws certify (absent for greedy evaluations)
            **({"sampling": {"answers": s.get("answers"), "steps": s.get("steps"), "mismatches": s.get("mismatches"),
                             "tv_bound": s.get("tv_bound"), "tv_mean_bound": s.get("tv_mean_bound"),
                             "classes": s.get("classes"), "alpha": s.get("alpha")}}
               if summary and (s := summary.get("sampling")) else {})}


def _side(case: CaseOutcome | None, flips: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    if case is None:
        return None
    extra = {"flips": list(flips[case.case_id])} if case.case_id in flips else {}  # [harmful, beneficial]
    d = case.divergence or case.unstable
    a, b = (d or {}).get("a"), (d or {}).get("b")
    return {"status": case.status, "first_divergence": None if d is None else {
                "turn": d.get("turn"), "position": d.get("first_divergent_position"),
                "tokens": [a.get("token") if a else None, b.get("token") if b else None],
                "margins": [a.get("margin") if a else None, b.get("margin") if b else None],
                "near_tie": d.get("near_tie"), "collapse": d.get("collapse"), "text": divergence_text(d)},
            "drift": case.drift, "seconds": case.seconds, "passed": case.passed, **extra}


def _where(side: dict[str, Any] | None) -> tuple | None:
    d = side and side["first_divergence"]
    return None if not d else (d["turn"], d["position"], tuple(d["tokens"]))


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    fa, fb = flatten(a), flatten(b)
    return [{"part": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def diff(a: EvaluationRecord, b: EvaluationRecord) -> dict[str, Any]:
    """Evaluation ``a`` against ``b``. A case *changed* when its status or its first divergence moved;
    drift and seconds are shown for every case but differ on every rerun, so they do not count."""
    cases_a = {c.case_id: c for c in case_outcomes(a)}
    cases_b = {c.case_id: c for c in case_outcomes(b)}
    flips_a, flips_b = case_flips(a), case_flips(b)
    rows = []
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

def status_text(side: dict[str, Any] | None) -> str:
    if side is None:
        return "(not run)"
    where = side["first_divergence"]
    return side["status"] if where is None else f"{side['status']} at {where['text']}"


def num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def flips_text(side: dict[str, Any] | None) -> str:
    """A case's assertion flips off -> on: harmful / beneficial."""
    return "-" if side is None or "flips" not in side else f"{side['flips'][0]} / {side['flips'][1]}"


def totals_text(header: dict[str, Any]) -> str:
    f = header.get("flips")
    return "-" if not f else (f"{f['harmful']} harmful / {f['beneficial']} beneficial; loss {f['loss']:.3f}, "
                              f"bounds [{f['lower']:.3f}, {f['upper']:.3f}], margin {f['margin']:g}")


def sampling_text(header: dict[str, Any]) -> str:
    s = header.get("sampling")
    if not s:
        return "-"
    head = f"{s['answers']} answers, {s['steps']} coupled steps, {s['mismatches']} mismatched: "
    if not s.get("classes"):  # recorded before the per-class bounds: its one bound is the average over compared steps
        return head + f"mean TV <= {s['tv_bound']:.3g}"
    worst = max(s["classes"], key=lambda c: c["bound"])
    return head + (f"TV <= {s['tv_bound']:.3g} averaged within every position class and stage (largest in "
                   f"{worst['class']}), <= {s['tv_mean_bound']:.3g} averaged over all steps")


def seconds_text(side: dict[str, Any] | None) -> str:
    return "-" if side is None else " / ".join(f"{k} {v:.3g}" for k, v in side["seconds"].items())


def markdown(d: dict[str, Any]) -> str:
    a, b = d["a"], d["b"]
    esc = lambda t: str(t).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    paired = "flips" in a or "flips" in b  # flips columns only where a side was judged on them
    lines = [f"# gatekeeper: evaluation {a['id']} vs {b['id']}", "",
             "| | A | B |", "|---|---|---|",
             *(f"| {k} | {esc(a[k])} | {esc(b[k])} |" for k in ("flag", "gate", "status", "operator", "started_at", "model_seconds")),
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
    for side, key in (("A", "only_a"), ("B", "only_b")):
        if d["reasons"][key]:
            lines += ["", f"## Reasons only in {side}", "", *(f"- {esc(r)}" for r in d["reasons"][key])]
    return "\n".join(lines) + "\n"
