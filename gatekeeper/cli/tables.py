"""The human-readable output of the commands: plain functions that take the data and print it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from ..evidence import EvaluationRecord
    from ..gate.enable.flip import CheckpointFailed, FlipResult
    from ..gate.state.flags import StatusRow
    from ..ledger.audit import Integrity
    from ..ledger.intoto import VerificationRecord
    from ..ledger.store import EvaluationLine
    from ..reports.diff import Diff
    from ..shadows import LiveEvidence
    from ..summaries import CalibrationSummary, CheckpointRecorded, StrengthSummary, SuiteCensus


def _share(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_diff(d: Diff) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..reports.diff import flips_text, num, sampling_text, status_text, totals_text

    a, b = d["a"], d["b"]
    console = Console()
    typer.echo(f"evaluation {a['id']} ({a['flag']}, {a['status']}) vs {b['id']} ({b['flag']}, {b['status']}): "
                  f"{len(d['changed_cases'])} of {len(d['cases'])} cases changed")
    paired = "flips" in a or "flips" in b
    if paired:
        typer.echo(f"flips {a['id']}: {totals_text(a)}\nflips {b['id']}: {totals_text(b)}")
    if "sampling" in a or "sampling" in b:
        typer.echo(f"sampling {a['id']}: {sampling_text(a)}\nsampling {b['id']}: {sampling_text(b)}")
    total = lambda side: "-" if side is None else f"{sum(side['seconds'].values()):.3g}"  # noqa: E731
    table = Table("case", f"{a['id']}", f"{b['id']}", "drift", "model seconds", *(["flips (harmful / beneficial)"] if paired else []))
    for r in d["cases"]:
        style = "bold" if r["changed"] else None
        table.add_row(r["case_id"], status_text(r["a"]), status_text(r["b"]),
                      f"{num(r['a'] and r['a']['drift'])} -> {num(r['b'] and r['b']['drift'])}",
                      f"{total(r['a'])} -> {total(r['b'])}",
                      *([f"{flips_text(r['a'])} -> {flips_text(r['b'])}"] if paired else []), style=style)
    console.print(table)
    for title, rows in (("identity", d["identity"]), ("configuration", d["config"])):
        if rows:
            parts = Table("part", f"{a['id']}", f"{b['id']}", title=f"{title} that differs")
            for part in rows:
                parts.add_row(part["part"], json.dumps(part["a"]), json.dumps(part["b"]))
            console.print(parts)
        else:
            console.print(f"{title}: the same")


# --- flags -------------------------------------------------------------------------------------


def print_status(rows: list[StatusRow]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..gate.guard import line

    table = Table("flag", "state", "evaluation", "by", "since", "evidence", "live")
    for r in rows:
        evidence = ("-" if r["evidence_current"] is None else "current" if r["evidence_current"]
                    else "; ".join(r["evidence_problems"]))
        if r.get("currency_error"):
            evidence = f"cannot be worked out now: {r['currency_error']}"
        table.add_row(r["flag"], r["state"], str(r["evaluation_id"] or "-"), r["operator"] or "-", r["since"] or "-", evidence,
                      line(r.get("live")))
    Console().print(table)


def print_live(e: LiveEvidence) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..gate.guard import line, scope_of

    console = Console()
    console.print(f"{e['flag']}: live evidence of flip {e['flip_id']}, batches {e['batches'][0]}-{e['batches'][1]}, "
                  f"{e['since']} to {e['until']}", highlight=False)
    console.print(f"{e['requests']} requests, {e['shadowed']} shadowed: {line(e)}", highlight=False)
    baseline = "aa_compared" in e  # the A/A columns: the flag-off side against its own second answer
    table = Table("stage", "compared", "parted", "unpaired", *(("A/A compared", "A/A parted") if baseline else ()))
    for stage, row in sorted(e["stages"].items()):
        aa = (str(row.get("aa_compared", 0)), str(row.get("aa_mismatches", 0))) if baseline else ()
        table.add_row(stage, str(row["compared"]), str(row["mismatches"]), str(row["unpaired"]), *aa)
    console.print(table)
    for name in ("unpaired", "dropped", "shapes", "proxies"):
        if e.get(name):
            console.print(f"{name}: " + ", ".join(f"{k} {n}" for k, n in sorted(e[name].items())), highlight=False)
    for t in e["tests"]:
        console.print(f"test, {scope_of(t['scope'])}: rate <= {t['limit']:g} at alpha {t['alpha']:.3g}: log statistic "
                      f"{t['log_e']} of {t['log_threshold']}{' BREACHED' if t['breached'] else ''}", highlight=False)
    if e["ended_by"]:
        end = e["ended_by"]
        console.print(f"ended by flip {end['id']} to {end['state']} by {end['operator']}"
                      f"{' (signed by ' + end['signer'] + ')' if end['signer'] else ''}: {end['reason']}", highlight=False)
    for item in e["mismatched"][:5]:
        how = (f"parted at character {item['parting_char']}" if item.get("parting_char") is not None else "the same text")
        judged = (" (lost a pass of " + item["case"] + ")" if item.get("lost_pass") else "") + \
                 (f" (mean KL {item['kld']:.3g})" if "kld" in item else "")
        console.print(f"{how} in stage {item['stage']}{judged}", highlight=False)


def print_flip(flag: str, result: FlipResult, checkpoint: CheckpointRecorded | CheckpointFailed | None = None) -> None:
    signed = f" (signed by {result.signer})" if result.signer else ""
    if result.action == "refused":
        typer.echo(f"refused: {flag} stays {result.state}")
    elif result.action == "approved":
        typer.echo(f"approval {result.approvals} of {result.required} recorded{signed}; {flag} stays {result.state}")
    else:
        typer.echo(f"{flag} is now {result.state}{signed}")
    for r in result.reasons if result.action != "approved" else []:
        typer.echo(f"  - {r}")
    if checkpoint and "error" in checkpoint:
        typer.echo(checkpoint["error"])
    elif checkpoint:
        typer.echo(f"checkpoint at seq {checkpoint['seq']} recorded in {checkpoint['file']}"
                   + (f", signed by {checkpoint['signer']}" if checkpoint["signer"] else
                      " (unsigned: 'gatekeeper ledger checkpoint --record --sign KEY' records a signed one)"))


def print_hash(data: dict[str, Any]) -> None:
    parts = data["parts"]
    typer.echo(f"{data['pipeline_hash']}\n" + "\n".join(
        f"  {k}: {json.dumps(parts[k], sort_keys=True)}" for k in data["hash_parts"]))


def print_pin(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("stage", "boundary (tokens)", "content hash", "model digest", "state")
    for r in data["stages"]:
        table.add_row(r["stage"], str(r["boundary"]), r["content_hash"][:16], _na(r["model_digest"], "{:.16}"), r["state"] or "-")
    Console().print(table)
    typer.echo(f"recipe written to {data['recipe']}")


# --- evidence ----------------------------------------------------------------------------------


def _strength(s: StrengthSummary) -> str:
    """A byte-equivalence comparison's top-2 logit drift, in one line (rich markup escaped)."""
    from rich.markup import escape

    grade = s["grade"] or "outputs differ"
    if s["grade"] == "bit_exact":
        return f"bit_exact: top-2 logits identical at all {s['steps']} steps" + _flips(s)
    drift = "unknown" if s["max_drift"] is None else f"{s['max_drift']:.3g}"
    w = s["where"]
    out = f"{grade}: max drift {drift}" + (f" at {escape(w['case'])} turn {w['turn']} step {w['step']}" if w else "")
    out += f"; {s['steps_at_risk']} of {s['steps']} steps at risk"
    return out + (f"; {s['unknown']} steps without top-2 logits" if s["unknown"] else "") + _flips(s)


def _flips(s: StrengthSummary) -> str:
    """An exact gate's assertion flips, beside its drift (records before them have none)."""
    f = s.get("flips")
    return f"; {f['harmful']} harmful / {f['beneficial']} beneficial flips of {f['pairs']} assertions" if f else ""


def _near_ties(row: SuiteCensus) -> str:
    from ..gate.kinds import NEAR_TIE

    smallest = "-" if row["min_margin"] is None else f"{row['min_margin']:.3g}"
    out = f"{row['near_ties']} of {row['steps']} decode steps with a top-2 margin <= {NEAR_TIE:g} (smallest {smallest})"
    return out + (f"; {row['unknown']} without top-2 logits" if row.get("unknown") else "")


def print_outcome(o) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"evaluation {o.evaluation_id}: {o.flag}", show_header=False)
    rows = [
        ("cases / assertions", f"{o.cases} / {o.assertions}"),
        ("equal off~off / off~on", f"{o.equal['baseline']} / {o.equal['off_on']} (of {o.cases} cases)"),
        ("assertions passed off / on", f"{o.passes['off']} / {o.passes['on']}"),
        ("prompt tokens off / computed on", f"{o.tokens['prompt_off']} / {_na(o.tokens['computed_on'])}"),
        ("cached tokens on", f"{_na(o.tokens['cached_on'])} ({o.exercised_share:.0%} of the {o.tokens['stable_prefix_bound']}-token stable-prefix bound)"),
        ("cacheable share as written / partitioned", f"{o.cacheable_share['as_written']:.0%} / {o.cacheable_share['partitioned']:.0%}"),
        ("wall seconds off (per run) / on", f"{o.seconds['off']:.1f} / {o.seconds['on']:.1f}"),
    ]
    if o.strength is not None:
        rows.append(("strength off~on", _strength(o.strength)))
    if o.paired and "n" in o.paired:  # per-suite verdicts say theirs in the reasons
        p = o.paired
        rows.append(("paired off~on", f"{p['harmful']} harmful / {p['beneficial']} beneficial flips of {p['n']} assertions; "
                                      f"loss {p['loss']:.3f}, bounds [{p['lower']:.3f}, {p['upper']:.3f}] at alpha "
                                      f"{p['alpha']:g}, margin {p['margin']:g}"))
    if o.sequential:  # the fixed-n bound has no level where the rule stopped: the rule's own bounds
        q = o.sequential
        rows.append(("sequential off~on", f"{q['decision']} after {q['cases']} of {q['battery_cases']} cases (seed "
                                          f"{q['seed']}, stopped: {q['stopped']}); {q['harmful']} harmful / "
                                          f"{q['beneficial']} beneficial flips; anytime-valid bounds [{q['lower']:.3f}, "
                                          f"{q['upper']:.3f}] at alpha {q['alpha']:g}, margin {q['margin']:g}"))
    if o.looks:  # a gate judged from a bound: its share of alpha (gate/stats/looks.py)
        from ..gate.stats.looks import line

        rows.append(("looks", line(o.looks)))
    if o.reference and "arms" in o.reference:
        r = o.reference
        rows.append(("reference arm off / on", " / ".join(
            f"{a['departed']} of {a['positions']} positions depart" for a in (r["arms"]["off"], r["arms"]["on"]))
            + f" ({r['dtype']}, no cache; {r['seconds']:.1f} s)"))
    if o.probes:
        rows.append(("cache probes", ", ".join(f"{k} {v.split(' (')[0]}" for k, v in o.probes.items())
                     + f" ({o.probe_seconds:.1f} s)"))
    for side, urls in o.reached.items():
        rows.append((f"servers reached flag-{side}", ", ".join(urls)))
    for suite, row in o.near_ties.items():  # suite names are the user's: no rich markup in them
        rows.append((f"near-ties flag-off, suite {escape(suite)}", _near_ties(row)))
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    console.print(table)
    # a server that reports no cached tokens leaves the computed count, and so the saving, unknown
    saved = None if o.tokens["computed_on"] is None else o.tokens["prompt_off"] - o.tokens["computed_on"]
    console.print(f"verdict: [bold]{o.verdict}[/bold]   prefill saved with the flag on: {_na(saved)} tokens")
    for r in o.reasons:
        console.print(f"  - {escape(r)}")


def print_measurement(m: dict, capture: Optional[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for run in m["runs"]:
        table = Table("stage", "calls", "prompt tok", "cached tok", "computed tok", "prefill s", "decode s",
                      "prefill share", "wall s", "model s",
                      title=f"measurement {m['measurement_id']}: {m['flag']} {run['flag_state']}")
        for name, f in [*run["stages"].items(), ("total", run["total"])]:
            table.add_row(name, str(f["calls"]), str(f["prompt_tokens"]), _na(f["cached_tokens"]), _na(f["computed_tokens"]),
                          f"{f['prefill_s']:.3f}", f"{f['decode_s']:.3f}", f"{f['prefill_share']:.0%}",
                          f"{f['wall_s']:.3f}", f"{f['prefill_s'] + f['decode_s']:.3f}")
        console.print(table)
        console.print(f"end to end {run['wall_s']:.3f} s wall vs {run['total']['model_s']:.3f} s in the model "
                      f"(overhead {run['overhead_s']:.3f} s); start-up {run['startup_s']:.3f} s")
    if m["reduction"]:
        table = Table("stage", "computed tok off", "on", "saved", "reduction", "prefill s off", "on", "reduction",
                      title="what the flag saves")
        for name, r in m["reduction"].items():
            table.add_row(name, _na(r["computed_tokens_off"]), _na(r["computed_tokens_on"]), _na(r["computed_tokens_saved"]),
                          _na(r["computed_tokens_reduction"], "{:.0%}"), f"{r['prefill_s_off']:.3f}", f"{r['prefill_s_on']:.3f}",
                          f"{r['prefill_s_reduction']:.0%}")
        console.print(table)
    if capture is not None:
        console.print(f"prompts captured to {capture} (local file; read it with 'gatekeeper analyze {capture}')")


def print_analysis(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..traffic.captures.analyze import LONG, SHORT

    console = Console()
    table = Table("stage", "calls", "mean bytes", "stable bytes", "stable share", "cacheable written", "partitioned",
                  title=f"{r['requests']} requests, {r['streams']} streams: byte-stable prefix per stage")
    for name, s in r["stages"].items():
        c = s["cacheable_share"] or {}
        table.add_row(name, str(s["calls"]), str(s["mean_prompt_bytes"] or "-"), str(s["stable_prefix_bytes"] or "-"),
                      _share(s["byte_stable_share"]), _share(c.get("as_written")), _share(c.get("partitioned")))
    console.print(table)
    if r.get("telemetry"):
        print_telemetry(console, r["stages"], r["telemetry"])
    print_load(console, r)
    if r["consecutive"] is None:
        console.print("consecutive requests: some lines carry only tokens and others only text; no common unit")
        return
    views = r["consecutive"]
    table = Table(f"common prefix ({r['unit']})", *(v.replace("_", " ") for v in views),
                  title="with the previous request (nearest-rank percentiles)")
    for key in ("pairs", "min", "p10", "p25", "median", "p75", "p90", "max"):
        table.add_row(key, *(str(c["pairs"] if key == "pairs" else (c["common_prefix"] or {}).get(key, "-")) for c in views.values()))
    for key, label in ((f"share_under_{SHORT}", f"share < {SHORT}"), (f"share_at_least_{LONG}", f"share >= {LONG}"),
                       ("reusable_share", "reusable share")):
        table.add_row(label, *(_share(c[key]) for c in views.values()))
    console.print(table)


def print_load(console, r: dict) -> None:
    """Request rate, calls in flight (time-weighted over busy time) and prompt lengths per stage."""
    from rich.table import Table

    table = Table("stage", "calls", "req/s", "in flight p50", "p95", "max", "prompt p50", "p95", "max",
                  title="load (calls in flight weighted by time; prompt lengths nearest-rank)")
    for name, s in [*r["stages"].items(), ("total", {"load": r["load"], "prompt_length": None})]:
        load, c, p = s["load"], s["load"]["concurrency"] or {}, s.get("prompt_length") or {}
        table.add_row(name, str(load["calls"]), "-" if load["requests_per_s"] is None else f"{load['requests_per_s']:.3g}",
                      *(str(c.get(k, "-")) for k in ("p50", "p95", "max")),
                      *(f"{p[k]} {p['unit']}" if k in p else "-" for k in ("median", "p95", "max")))
    console.print(table)
    for why in r["load"]["cannot_report"]:
        console.print(f"cannot report {why}")


def print_telemetry(console, stages: dict, total: dict) -> None:
    """The prefill tax as the server reported it (captures from 'gatekeeper proxy'); '-' where not reported."""
    from rich.table import Table

    def num(v: Any, fmt: str = "{}") -> str:
        return "-" if v is None else fmt.format(v)

    table = Table("stage", "calls", "reported", "prompt tok", "cached tok", "prefill s", "decode s", "prefill share",
                  title="prefill tax, as the server reported it")
    for name, t in [*((n, s["telemetry"]) for n, s in stages.items()), ("total", total)]:
        if t:
            table.add_row(name, str(t["calls"]), str(t["calls_reported"]), num(t["prompt_tokens"]), num(t["cached_tokens"]),
                          num(t["prefill_s"], "{:.3f}"), num(t["decode_s"], "{:.3f}"), _share(t["prefill_share"]))
    console.print(table)


# --- the ledger --------------------------------------------------------------------------------


def print_evaluations(evaluations: list[EvaluationLine]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "flag", "status", "operator", "started", "cases")
    for e in evaluations:
        table.add_row(str(e["id"]), e["flag"], e["status"], e["operator"], e["started_at"], str(e.get("case_results", "")))
    Console().print(table)


def print_evaluation(ev: EvaluationRecord) -> None:
    typer.echo(f"evaluation {ev['id']}  flag {ev['flag']}  status {ev['status']}")
    typer.echo(f"  operator {ev['operator']}  started {ev['started_at']}  gate {ev['gate']}")
    for reason in ev.get("reasons") or []:
        typer.echo(f"  - {reason}")
    verdict = ev.get("verdict_record")
    if verdict and (looks := (verdict.get("summary") or {}).get("looks")):
        from ..gate.stats.looks import line

        typer.echo(f"  {line(looks)}")
    typer.echo(f"  case results: {len(ev['case_results'])}  comparisons: {len(ev['comparisons'])}")
    for c in ev["comparisons"]:
        if not c["equal"]:
            typer.echo(f"  differs: {c['case_id']} ({c['detail'].get('pair', '')})")


def print_verify(data: Integrity) -> None:
    checked = data.get("coverage")
    how = "" if checked is None else (f"checked: full ({checked['why']})" if checked["full"] else
                                      f"checked: from seq {checked['from_seq']} (the entries since the last good verify; "
                                      "--full rechecks them all)")
    if data["ok"]:
        extra = "".join([f", {data['signatures']['checked']} signatures good" if data["signatures"]["checked"] else "",
                         f", extends {len(data['checkpoints'])} checkpoint(s)" if data["checkpoints"] else ""])
        typer.echo(f"ledger ok: {data['entries']} entries, chain and records intact{extra}")
    else:
        typer.echo(f"ledger TAMPERED: {data['problem']}")
        for p in data["problems"][1:]:
            typer.echo(f"  - {p}")
    if how:
        typer.echo(how)


def print_checkpoint(data: dict[str, Any]) -> None:
    signed = f", signed by {data['signer']}" if data.get("signer") else ", unsigned"
    typer.echo(f"checkpoint: seq {data['seq']} ({data['entries']} entries), hash {data['hash']}{signed}"
               + (f"; written to {data['file']}" if data.get("file") else ""))


# --- hybrid models -----------------------------------------------------------------------------


def print_replay(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("policy", "trace", "req", "bound", "reused", "re-done", "share", "restores", "forced",
                  "snaps", "bytes", "same",
                  title=f"replay of {r['source']} ({'simulated' if r['simulated'] else 'engine ' + r['engine']})")
    for p in r["policies"]:
        for name, t in p["traces"].items():
            same = "-" if t["identical"] is None else ("yes" if t["identical"] else f"NO: {t['differing']}")
            table.add_row(p["policy"], name, str(t["requests"]), str(t["bound"]), str(t["reused"]), str(t["redone"]),
                          _share(t["realized_share"]), str(t["restores"]), str(t["forced_full"]),
                          *("-" if t[k] is None else str(t[k]) for k in ("snapshots_held", "snapshot_bytes")), same)
    Console().print(table)
    if r.get("hybrid") is False:
        Console().print("this model's state can be cut back (attention only): the prefix cache serves it, "
                        "and snapshot policies do not apply")


def print_calibration(c: CalibrationSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    linked = f" of evaluation {c['evaluation_id']}" if c["evaluation_id"] else ""
    linked += f" (measured on its twin {twin['engine']}: the served weights)" if (twin := c.get("twin")) else ""
    early = c.get("mode") == "early"
    table = Table("fault", "flagged", "share", "by outputs" + (" (at least)" if early else ""), "by drift",
                  "cached tok", "seconds",
                  title=f"calibration {c['calibration_id']}{linked}: {c['flag']} on {c['engine']}, {c['cases']} cases")
    for r in c["faults"]:
        if not r["supported"]:
            table.add_row(r["spec"], "-", "not supported by this engine", "-", "-", "-", "-")
        else:
            table.add_row(r["spec"], f"{r['flagged']} / {r['cases']}", f"{r['share']:.0%}", f"{r['share_outputs']:.0%}",
                          f"{r['share_drift']:.0%}", _na(r["cached_tokens"]), f"{r['seconds']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"by drift: {c['drift_rule']['rule']}" + ("; each case of a fault run stopped at its first flag "
                                                             "(calibrate --full for exact counts by outputs)" if early else ""))
    if "per_flag_on_run" in c["seconds"]:
        console.print(f"cost: {c['seconds']['per_flag_on_run']:.1f} flag-on runs")


def print_candidates(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("stage", "cases", "static chars", title=f"candidate cases from {report['capture']}")
    for name, st in report["stages"].items():
        table.add_row(name, str(st["cases"]), str(st["static_chars"]))
    Console().print(table)
    for path in report["written"]:
        print(f"wrote {path}")


def print_mined(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    probed = report.get("faults") or []
    table = Table("suite", "case", "score", "per s", "min margin", "near-ties", "steps", *(["catches"] if probed else []),
                  "source", title=f"mined {report['chosen']} of {report['candidates']} candidates on {report['engine']} "
                                  f"({report['seconds']:.1f} model s)")
    for name, st in report["suites"].items():
        for c in st["cases"]:
            table.add_row(name, c["id"], f"{c['score']:.2f}", f"{c['per_second']:.2f}", _na(c["min_margin"], "{:.4f}"),
                          str(c["near_ties"]), str(c["steps"]),
                          *([", ".join(c["catches"]) or "none"] if probed else []), c["source"])
    console = Console()
    console.print(table)
    chosen = [c for st in report["suites"].values() for c in st["cases"]]
    for fault in probed:
        console.print(f"{fault} changes the outputs of {sum(fault in c['catches'] for c in chosen)} of {len(chosen)} cases kept")
    for name, st in report["suites"].items():
        gain = f", {st['power_per_token']:.3f} score per extra token" if st["power_per_token"] is not None else ""
        console.print(f"{name}: max_tokens {st['max_tokens']}{gain}")
    for path in report["written"]:
        console.print(f"wrote {path}")


def _na(value, form: str = "{}") -> str:
    """A figure, or n/a where the engine did not report it (never a 0 it did not measure)."""
    return "n/a" if value is None else form.format(value)


# --- in-toto attestations ------------------------------------------------------------------------


def print_attested(data: dict[str, Any]) -> None:
    s, c = data["signer"], data["checkpoint"]
    typer.echo(f"evaluation {data['evaluation']} ({data['flag']}, {data['verdict']}) attested by {s['principal']} "
               f"({s['keyid']}, {s['scheme']}) at ledger seq {c['seq']}; written to {data['file']}")
    for subject in data["subjects"]:
        typer.echo(f"  {subject['name']}: sha256:{subject['digest']['sha256']}")


def print_attestation(data: VerificationRecord) -> None:
    if not data["ok"]:
        typer.echo(f"attestation BAD: {data['problem']}")
        for p in data["problems"][1:]:
            typer.echo(f"  - {p}")
        return
    st, s, lg = data["statement"], data["signer"], data["ledger"]
    assert st is not None and s is not None  # an attestation that verifies was read and its signer found
    ledger = (f"the ledger still extends its checkpoint (seq {lg['checkpoint']['seq']}) and holds what it states"
              if lg["checked"] else f"ledger not checked: {lg.get('why', 'none at hand')}")
    typer.echo(f"attestation ok: evaluation {st['evaluation']} ({st['flag']}, {st['verdict']}), signed by "
               f"{s['principal']} ({s['keyid']}); {ledger}")
