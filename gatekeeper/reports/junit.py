"""An evaluation as CI reads it: JUnit XML, one test case per battery case, and a short markdown
summary for a CI job's page (GitHub's ``$GITHUB_STEP_SUMMARY``).

A case fails when the gate said FAIL and that case is one it blamed; an INCONCLUSIVE evaluation
skips every case with the reason that concerns it; an evaluation without a verdict (aborted) is an
error on every case. A PASS passes every case.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from ..evidence import EvaluationRecord
from .outcomes import DIFFERS, CaseOutcome, case_flips, case_outcomes, divergence_text, observed, verdict_summary

# What XML 1.0 cannot carry (control characters, lone surrogates): shown as escapes instead.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _safe(text: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _concerns(reason: str, case_id: str) -> bool:
    return re.search(rf"(?<![\w/.-]){re.escape(case_id)}(?![\w/.-])", reason) is not None


def _verdict_of(record: EvaluationRecord, case: CaseOutcome) -> tuple[str, str, str]:
    """(kind, message, detail): kind is pass, failure, skipped or error."""
    verdict, reasons = record.get("verdict"), record.get("reasons") or []
    own = [r for r in reasons if _concerns(r, case.case_id)]
    if verdict is None:
        aborted = record.get("aborted_record")
        why = (aborted["reason"] if aborted else None) or record.get("status", "aborted")
        return "error", f"{record.get('status', 'aborted')}: the evaluation has no verdict ({why})", ""
    if verdict == "INCONCLUSIVE":
        return "skipped", "; ".join(own or reasons), ""
    if verdict == "FAIL" and (own or case.status == DIFFERS):
        message = own[0] if own else f"differs: {divergence_text(case.divergence)}"
        detail = [divergence_text(case.divergence), *own[1:]]
        if case.divergence and case.divergence.get("text_a") is not None:
            detail += [f"flag off: {case.divergence['text_a']!r}", f"flag on:  {case.divergence['text_b']!r}"]
        return "failure", message, "\n".join(detail)
    return "pass", "", ""


def _statistics(record: EvaluationRecord) -> list[tuple[str, str]]:
    """What a paired or sequential verdict rests on, the teacher-forced distance, sampled decoding's coupling and the
    reference arm, as suite properties (none for the evaluations that have none of them, so their XML reads as it did)."""
    summary = verdict_summary(record)
    if summary is None:
        return []
    sequential = summary.get("sequential")
    stats, out = sequential or summary.get("paired"), []
    if stats and "suites" not in stats:  # per-suite margins: each suite's bound is in the reasons
        out += [("harmful_flips", str(stats["harmful"])), ("beneficial_flips", str(stats["beneficial"])),
                ("loss", f"{stats['loss']:.4g}"), ("loss_bounds", f"[{stats['lower']:.4g}, {stats['upper']:.4g}]"),
                ("margin", f"{stats['margin']:g}"), ("alpha", f"{stats['alpha']:g}")]
        if sequential:
            out += [("sequential_cases", f"{sequential['cases']} of {sequential['battery_cases']}"),
                    ("sequential_stopped", str(sequential["stopped"]))]
    read = observed(summary.get("distance"))
    if read and (moved := read["distance"]):
        out += [("kld_mean", f"{moved['kld']['mean']:.4g}"), ("same_top1", f"{moved['same_top1']:.4f}")]
    s = summary.get("sampling")
    if s:  # sampled decoding: what the seed-paired draws certify, and the controls
        out += [("sampled_answers", str(s["answers"])), ("coupled_steps", str(s["steps"])),
                ("coupled_mismatches", str(s["mismatches"])), ("tv_bound", f"{s['tv_bound']:.4g}")]
        if s.get("classes"):  # per position class and stage, each at alpha/m; tv_bound is the largest
            out += [("tv_mean_bound", f"{s['tv_mean_bound']:.4g}")]
            out += [(f"tv_bound {c['class']}", f"{c['bound']:.4g} ({c['mismatches']} of {c['steps']})") for c in s["classes"]]
        if controls := s.get("controls"):
            out += [("control_planted", controls["planted"]), ("control_unpaired", controls["unpaired"])]
    reference = observed(summary.get("reference"))
    if reference and (arms := reference["arms"]):  # the reference arm: answer positions where each arm parts from a cache-free read
        out += [(f"reference_departed_{name}", f"{a['departed']} of {a['positions']}") for name, a in arms.items()]
    return out


def render(record: EvaluationRecord) -> str:
    """The evaluation as a JUnit XML document (testsuites > testsuite per suite > testcase per case)."""
    flag, eid = record["flag"], record["id"]
    statistics, flips = _statistics(record), case_flips(record)
    root = ET.Element("testsuites", name=f"gatekeeper {flag} evaluation {eid}")
    suites: dict[str, ET.Element] = {}
    counts: dict[str, dict[str, float]] = {}
    for case in case_outcomes(record):
        suite = suites.get(case.suite)
        if suite is None:
            suite = suites[case.suite] = ET.SubElement(root, "testsuite", name=f"{flag}: {case.suite}",
                                                       timestamp=record["started_at"])
            props = ET.SubElement(suite, "properties")
            for name, value in (("evaluation", eid), ("flag", flag), ("gate", record["gate"]),
                                ("verdict", record.get("verdict") or record.get("status")),
                                ("operator", record["operator"]), *statistics):
                ET.SubElement(props, "property", name=name, value=_safe(str(value)))
            counts[case.suite] = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
        seconds = sum(case.seconds.values())
        tc = ET.SubElement(suite, "testcase", classname=f"gatekeeper.{flag}.{case.suite}", name=case.name,
                           time=f"{seconds:.3f}")
        kind, message, detail = _verdict_of(record, case)
        if kind != "pass":
            el = ET.SubElement(tc, kind, message=_safe(message))
            if kind != "skipped":
                el.set("type", message.split(":", 1)[0])
                el.text = _safe(detail or message)
        ET.SubElement(tc, "system-out").text = (
            f"status: {case.status}; drift: {'n/a' if case.drift is None else f'{case.drift:.3g}'}; "
            f"assertions passed: {', '.join(f'{k} {v}' for k, v in case.passed.items())}; "
            f"model seconds: {', '.join(f'{k} {v:g}' for k, v in case.seconds.items())}"
            + (f"; flips: harmful {flips[case.case_id][0]}, beneficial {flips[case.case_id][1]}" if case.case_id in flips else ""))
        c = counts[case.suite]
        c["tests"] += 1
        c["time"] += seconds
        if kind != "pass":
            c["failures" if kind == "failure" else "errors" if kind == "error" else "skipped"] += 1
    for name, suite in suites.items():
        for key, count in counts[name].items():
            suite.set(key, f"{count:.3f}" if key == "time" else str(int(count)))
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(c[key]) for c in counts.values())))
    root.set("time", f"{sum(c['time'] for c in counts.values()):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def summary(record: EvaluationRecord) -> str:
    """A few markdown lines for a CI job's summary page: the verdict, its reasons, the cases it blamed."""
    verdict = record.get("verdict") or record.get("status")
    lines = [f"### gatekeeper: {record['flag']} evaluation {record['id']}: **{verdict}**", ""]
    lines += [f"- {_md(r)}" for r in record.get("reasons") or []]
    cases = case_outcomes(record)
    blamed = [(c, _verdict_of(record, c)) for c in cases]
    blamed = [(c, v) for c, v in blamed if v[0] != "pass"]
    lines += ["", f"{len(cases)} cases, {len(cases) - len(blamed)} passed"]
    if blamed:
        lines += ["", "| case | result | detail |", "|---|---|---|"]
        lines += [f"| `{c.case_id}` | {kind} | {_md(message)} |" for c, (kind, message, _) in blamed]
    return "\n".join(lines) + "\n\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
