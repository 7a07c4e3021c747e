"""Ledger commands: list, show, verify, checkpoint and export the recorded evidence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import Json, Settings, emit, reporting, writable_file

if TYPE_CHECKING:
    from ..evidence import EvaluationRecord

ledger_app = typer.Typer(help="Read, verify and export the evidence ledger.", no_args_is_help=True)


@ledger_app.command("list")
@reporting
def ledger_list(ctx: typer.Context, limit: Annotated[Optional[int], typer.Option(help="Newest N only.")] = None,
                json_: Json = False) -> None:
    """Evaluations, newest first, with their derived status."""
    from ..gate import guard

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        evaluations = ledger.evaluations(limit=limit) if ledger else []
        live = {flag: e for flag in ws.policies if (e := guard.live(ledger, flag)) is not None}

    def show() -> None:
        tables.print_evaluations(evaluations)
        for flag, evidence in live.items():
            typer.echo(f"live evidence of {flag} (flip {evidence['flip_id']}): {guard.line(evidence)}; "
                       f"'gatekeeper ledger live {flag}' shows it")

    emit(json_, {"evaluations": evaluations, **({"live": live} if live else {})}, show)


@ledger_app.command("live")
@reporting
def ledger_live(ctx: typer.Context, flag: Annotated[str, typer.Argument(help="The flag the guard watched.")],
                json_: Json = False) -> None:
    """A flag's live evidence: what the guard compared since the flip it watched, per stage, and its tests."""
    from ..gate import guard

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ws.policy(flag)
    with settings.opened_ledger(ws, create=False) as ledger:
        evidence = guard.live(ledger, flag)
    if evidence is None:
        raise GatekeeperError(f"no live evidence of {flag}: the guard never watched it "
                              f"(gatekeeper proxy --guard {flag} --shadow URL, with a guard: section in its policy)")
    emit(json_, evidence, lambda: tables.print_live(evidence))


def _evaluation(settings: Settings, ws, evaluation_id: int) -> EvaluationRecord:
    """One evaluation's record, or the error that points at ``gatekeeper ledger list``."""
    with settings.opened_ledger(ws, create=False) as ledger:
        record = ledger.evaluation(evaluation_id) if ledger else None
    if record is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
    return record


@ledger_app.command("show")
@reporting
def ledger_show(ctx: typer.Context, evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
                json_: Json = False) -> None:
    """One evaluation with all its evidence."""
    settings: Settings = ctx.obj
    record = _evaluation(settings, settings.open_workspace(), evaluation_id)
    emit(json_, record, lambda: tables.print_evaluation(record))


@ledger_app.command("verify")
@reporting
def ledger_verify(
    ctx: typer.Context,
    checkpoint: Annotated[Optional[list[Path]], typer.Option(
        help="A checkpoint the ledger must still extend (repeatable), besides the workspace's own (every one in "
             "ledger/checkpoints.jsonl, and ledger/checkpoint.json).")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="Recheck the whole chain, every row and SQLite's integrity_check, not only what was appended "
                       "since the last good verify (an old row edited since is found this way only).")] = False,
    json_: Json = False,
) -> None:
    """Recheck the hash chain, every record against its entry, every signature, and that the ledger still
    extends every checkpoint the workspace records and each one given; exit 1 naming the first problem. The chain
    is rechecked from where the last good verify got to, or whole with --full (or without one)."""
    from ..gate.enable import attestation
    from ..ledger.audit import audit_ledger

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    result = audit_ledger(settings.ledger_url(ws), ws, checkpoint or [],
                          lambda ledger: attestation.audit_signatures(ws, ledger), full=full)
    data = result.to_dict()
    if result.unreadable is not None:
        emit(json_, data, lambda: typer.echo(f"ledger DAMAGED: {result.unreadable}"))
    else:
        emit(json_, data, lambda: tables.print_verify(data))
    if not result.ok:
        raise typer.Exit(1)


@ledger_app.command("checkpoint")
@reporting
def ledger_checkpoint(
    ctx: typer.Context,
    sign: Annotated[Optional[Path], typer.Option(
        help="Sign it with this SSH private key (default: $GATEKEEPER_SIGNING_KEY); its public key must be in "
             "policies/allowed_signers.")] = None,
    output: Annotated[Optional[Path], typer.Option(help="Write it to this file (default: print it).")] = None,
    record: Annotated[bool, typer.Option(
        "--record", help="Record it in the workspace (append it to ledger/checkpoints.jsonl, which 'ledger verify' "
                         "checks), as a flip does under its policy's checkpoint_after_flip.")] = False,
    json_: Json = False,
) -> None:
    """Write the ledger's head (seq, hash, time, entries, where it lives) as a small JSON checkpoint, to commit
    with the workspace or hand to an auditor; 'ledger verify --checkpoint FILE' proves the ledger still extends it."""
    import os

    from .. import signing
    from ..ledger import checkpoint as cp

    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        raise GatekeeperError(f"--output {output}: name a file in an existing folder")
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    env_key = os.environ.get(signing.SIGNING_KEY_ENV)
    key_path = sign or env_key
    key = signing.load_key(key_path) if key_path else None
    allowed = ws.allowed_signers if key is not None else None
    with settings.opened_ledger(ws, create=False) as ledger:
        if ledger is None:
            raise GatekeeperError(f"no ledger at {settings.ledger_url(ws)}; nothing has been recorded yet")
        checkpoint = cp.make(ledger, cp.location(ledger.url, ws.root), key, allowed)
    if output is not None:
        cp.write(checkpoint, output)
    try:
        recorded = cp.record(checkpoint, ws) if record else None
    except OSError as e:
        raise GatekeeperError(f"{cp.log_path(ws)}: cannot record the checkpoint there ({e}); make the folder writable") from None
    data = {**checkpoint, "file": str(output) if output else None, "recorded": str(recorded) if recorded else None}
    if json_:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    elif recorded is not None:
        tables.print_checkpoint({**data, "file": ", ".join(str(p) for p in (output, recorded) if p)})
    elif output is None:
        typer.echo(cp.text(checkpoint), nl=False)
    else:
        tables.print_checkpoint(data)


@ledger_app.command("signature")
@reporting
def ledger_signature(
    ctx: typer.Context,
    kind: Annotated[str, typer.Argument(help="approval or flip.")],
    record_id: Annotated[int, typer.Argument(metavar="ID")],
    output: Annotated[Path, typer.Option(help="Folder to write KIND-ID.record and KIND-ID.record.sig into.")] = Path("."),
    json_: Json = False,
) -> None:
    """Write a signed approval's or flip's record and signature as files, to check them with ssh-keygen -Y verify."""
    from ..gate.enable import attestation

    if kind not in ("approval", "flip"):
        raise GatekeeperError(f"KIND must be approval or flip, not {kind!r}")
    if not output.is_dir():
        raise GatekeeperError(f"--output {output}: not a folder")
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        rows = [r for r in (ledger.records(kind) if ledger else []) if r["id"] == record_id]
        if not rows:
            raise GatekeeperError(f"no {kind} {record_id} in {settings.ledger_url(ws)}")
        row = rows[0]
        if row.get("signature") is None:
            raise GatekeeperError(f"{kind} {record_id} is not signed")
        evaluation = ledger.evaluation(row["evaluation_id"]) if row["evaluation_id"] is not None else None
    record = attestation.flip_record(row["flag"], row.get("state", "on"), row["evaluation_id"], attestation.identity_digest(evaluation),
                               row["operator"], row["reason"], row["signed_at"])
    message_file, sig_file = output / f"{kind}-{record_id}.record", output / f"{kind}-{record_id}.record.sig"
    message_file.write_bytes(attestation.record_message(record))
    sig_file.write_text(row["signature"], encoding="utf-8")
    command = (f"ssh-keygen -Y verify -f {ws.allowed_signers_path} -I {row['signer']} -n gatekeeper "
               f"-s {sig_file} < {message_file}")
    data = {"kind": kind, "id": record_id, "signer": row["signer"], "record": str(message_file),
            "signature": str(sig_file), "verify": command}
    emit(json_, data, lambda: typer.echo(f"{kind} {record_id}, signed by {row['signer']}: {message_file}, {sig_file}\n"
                                         f"check it with: {command}"))


@ledger_app.command("export")
@reporting
def ledger_export(
    ctx: typer.Context,
    evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
    format_: Annotated[str, typer.Option("--format", help="md, html (one self-contained page), json or junit (JUnit XML).")] = "md",
    output: Annotated[Optional[Path], typer.Option(help="Write here instead of stdout.")] = None,
    json_: Json = False,
) -> None:
    """Export one evaluation for a reviewer: verdict, identities, per-stage figures, differing cases."""
    from ..reports.export import FORMATS, render

    if format_ not in FORMATS:
        raise GatekeeperError(f"--format must be one of {', '.join(FORMATS)}, not {format_!r}")
    if output is not None:
        writable_file(output, "--output")
    settings: Settings = ctx.obj
    text = render(_evaluation(settings, settings.open_workspace(), evaluation_id), format_)
    if output is not None:
        output.write_text(text, encoding="utf-8")
    if json_:  # one JSON document on stdout, whatever the format
        doc = json.loads(text) if format_ == "json" and output is None else {
            "evaluation": evaluation_id, "format": format_, "output": str(output) if output else None,
            **({} if output else {"content": text})}
        typer.echo(json.dumps(doc, indent=2, default=str))
    elif output is None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"evaluation {evaluation_id} exported as {format_} to {output}", err=True)


@ledger_app.command("diff")
@reporting
def ledger_diff(
    ctx: typer.Context,
    a: Annotated[int, typer.Argument(metavar="A", help="An evaluation id.")],
    b: Annotated[int, typer.Argument(metavar="B", help="The evaluation to compare it with.")],
    format_: Annotated[str, typer.Option("--format", help="table (on the terminal) or md.")] = "table",
    json_: Json = False,
) -> None:
    """Compare two evaluations case by case: outcome changes, first divergence, drift, timing, and the identity
    fields that differ."""
    from ..reports.diff import diff, markdown

    if format_ not in ("table", "md"):
        raise GatekeeperError(f"--format must be table or md, not {format_!r} (--json prints JSON)")
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    d = diff(_evaluation(settings, ws, a), _evaluation(settings, ws, b))
    emit(json_, d, lambda: typer.echo(markdown(d), nl=False) if format_ == "md" else tables.print_diff(d))


@ledger_app.command("copy")
@reporting
def ledger_copy(
    source: Annotated[str, typer.Argument(metavar="SRC", help="URL of the ledger to copy, e.g. sqlite:///ledger/evidence.db.")],
    destination: Annotated[str, typer.Argument(
        metavar="DST", help="URL of an empty ledger, e.g. postgresql+psycopg://USER@HOST/DATABASE.")],
    json_: Json = False,
) -> None:
    """Move a ledger to another database (the team's PostgreSQL server, say) entry by entry, keeping every seq, id
    and hash, then verify the copy and report its entries. DST must be empty; a source or a copy that does not
    verify is exit 1 and leaves DST empty."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from ..errors import LedgerIntegrityError
    from ..ledger import copy_ledger, open_ledger
    from ..ledger.store import shown

    for name, url in (("SRC", source), ("DST", destination)):
        try:
            make_url(url)
        except ArgumentError as e:
            raise GatekeeperError(f"{name} {url!r} is not a ledger URL ({e}); use e.g. sqlite:///ledger/evidence.db "
                                  "or postgresql+psycopg://USER@HOST/DATABASE") from e
    src = open_ledger(source, create=False)
    if src is None:
        raise GatekeeperError(f"no ledger at {source}; nothing to copy")
    with src, open_ledger(destination, create=True) as dst:
        try:
            report = copy_ledger(src, dst)
        except LedgerIntegrityError as e:
            typer.echo(json.dumps({"ok": False, "error": str(e)}) if json_ else f"error: {e}", err=not json_)
            raise typer.Exit(1) from None
        head = dst.head()
    data = {"ok": report.ok, "source": shown(source), "destination": shown(destination), "entries": report.entries,
            "head": head}
    emit(json_, data, lambda: typer.echo(
        f"copied {report.entries} entries from {data['source']} to {data['destination']}; verify: "
        + (("ok" + (f" (head seq {head['seq']}, {head['hash'][:12]})" if head else "")) if report.ok else report.problem)))
    if not report.ok:
        raise typer.Exit(1)


# --- in-toto attestations: ledger attest, ledger verify-attestation -----------------------------


@ledger_app.command("attest")
@reporting
def ledger_attest(
    ctx: typer.Context,
    evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
    sign: Annotated[Optional[Path], typer.Option(
        help="SSH private key to sign with (default: $GATEKEEPER_SIGNING_KEY); its public key must be in "
             "policies/allowed_signers.")] = None,
    output: Annotated[Optional[Path], typer.Option(help="Write the envelope to this file (default: print it).")] = None,
    json_: Json = False,
) -> None:
    """Write an in-toto Statement v1 about one evaluation (subjects: its model, adapter, battery and policy digests;
    predicate: verdict, reasons, identity, strength, calibrations, approvals, flips, a ledger checkpoint) in a DSSE
    envelope signed with an SSH key; 'ledger verify-attestation FILE' checks it (docs/attestations.md)."""
    import os

    from .. import signing
    from ..ledger import checkpoint as cp
    from ..ledger import intoto

    if output is not None:
        writable_file(output, "--output")
    key_file = sign or os.environ.get(signing.SIGNING_KEY_ENV)
    if not key_file:
        raise GatekeeperError(f"an attestation is signed: pass --sign KEY (an SSH private key whose public key is in "
                              f"policies/allowed_signers) or set ${signing.SIGNING_KEY_ENV}")
    key = signing.load_key(key_file)
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        if ledger is None:
            raise GatekeeperError(f"no ledger at {settings.ledger_url(ws)}; nothing has been recorded yet")
        envelope, statement = intoto.attest(ledger, evaluation_id, key, ws.allowed_signers, cp.location(ledger.url, ws.root))
    if output is not None:
        intoto.write(envelope, output)
    pred = statement["predicate"]
    head = pred["ledger"]
    data = {"evaluation": evaluation_id, "flag": pred["evaluation"]["flag"], "verdict": pred["verdict"],
            "file": str(output) if output else None, "signer": pred["signer"], "predicate_type": statement["predicateType"],
            "subjects": statement["subject"],
            "checkpoint": {"seq": head["seq"], "hash": head["hash"], "entries": head["entries"], "at": head["at"]},
            "envelope": envelope.to_dict()}
    if json_:
        typer.echo(json.dumps(data, indent=2))
    elif output is None:
        typer.echo(intoto.text(envelope), nl=False)
    else:
        tables.print_attested(data)


@ledger_app.command("verify-attestation")
@reporting
def ledger_verify_attestation(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A DSSE envelope 'ledger attest' wrote.")],
    allowed_signers: Annotated[Optional[Path], typer.Option(
        help="Who may sign, in git's allowed_signers format (default: the workspace's policies/allowed_signers).")] = None,
    json_: Json = False,
) -> None:
    """Check an attestation: its DSSE signature over the statement, that the key is in allowed_signers, that it is a
    gatekeeper in-toto statement, and, where the workspace's ledger is at hand, that the ledger still extends its
    checkpoint and still holds the evaluation, approvals and flips as stated; exit 1 naming the first problem."""
    from .. import signing
    from ..ledger import checkpoint as cp
    from ..ledger import intoto
    from ..ledger.store import shown

    envelope = intoto.load(file)  # not an envelope: exit 2 before anything else
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    if allowed_signers is not None:
        if not allowed_signers.is_file():
            raise GatekeeperError(f"--allowed-signers {allowed_signers}: no such file; pass an allowed_signers file "
                                  "(lines 'principal key-type key')")
        allowed = signing.AllowedSigners.load(allowed_signers)
    elif ws.allowed_signers is None:
        raise GatekeeperError(f"{ws.allowed_signers_path}: missing; pass --allowed-signers FILE (lines 'principal "
                              "key-type key') to say whose keys may sign")
    else:
        allowed = ws.allowed_signers
    url = settings.ledger_url(ws)
    with settings.opened_ledger(ws, create=False) as ledger:
        where = cp.location(ledger.url, ws.root) if ledger is not None else None
        result = intoto.verify(envelope, str(file), allowed, ledger, where)
    if ledger is None:
        result.ledger = {"checked": False, "why": f"no ledger at {shown(url)}"}
    data = result.to_dict()
    emit(json_, data, lambda: tables.print_attestation(data))
    if not result.ok:
        raise typer.Exit(1)
