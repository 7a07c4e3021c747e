"""Ledger commands: list, show, verify, checkpoint and export the recorded evidence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import Json, Settings, emit, reporting, writable_file

ledger_app = typer.Typer(help="Read, verify and export the evidence ledger.", no_args_is_help=True)


@ledger_app.command("list")
@reporting
def ledger_list(ctx: typer.Context, limit: Annotated[Optional[int], typer.Option(help="Newest N only.")] = None,
                json_: Json = False) -> None:
    """Evaluations, newest first, with their derived status."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        evaluations = ledger.evaluations(limit=limit) if ledger else []
    emit(json_, {"evaluations": evaluations}, lambda: tables.print_evaluations(evaluations))


def _evaluation(settings: Settings, ws, evaluation_id: int) -> dict:
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
    json_: Json = False,
) -> None:
    """Recheck the hash chain, every record against its entry, every signature, and that the ledger still
    extends every checkpoint the workspace records and each one given; exit 1 naming the first problem."""
    from ..gate import attestation
    from ..ledger import checkpoint as cp

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    # a file or line that is no checkpoint: exit 2, before anything else
    given = [(str(f), cp.load(f)) for f in checkpoint or []]
    own = [(name, c) for name, c in cp.recorded(ws) if all(c != g for _, g in given)]
    loaded = given + own
    source = {"workspace": len(own), "given": len(given)}
    url = settings.ledger_url(ws)
    try:
        early, unopened = _preflight(url)  # before opening, which would migrate a ledger whose migrations were edited
        if early:
            _report_verify(json_, [], early, entries=unopened.entries if unopened else None,
                           first_bad=unopened.first_bad_seq if unopened else None, signatures=None, source=source)
        with settings.opened_ledger(ws, create=False) as ledger:
            if ledger is None:
                raise GatekeeperError(f"no ledger at {url}; nothing has been recorded yet")
            report = ledger.verify()
            # On a damaged ledger these read rows verify has already named; what they cannot read is one more problem.
            audit = _reached(report, "signatures", lambda: attestation.audit_signatures(ws, ledger))
            where = cp.location(ledger.url, ws.root)
            checked = [_reached(report, f"checkpoint {name}", lambda c=c, name=name: cp.check(
                c, name, ledger, where, ws.allowed_signers)) for name, c in loaded]
            fresh = _reached(report, "checkpoint_after_flip", lambda: cp.uncovered_flips(
                ws, ledger, [c for c in checked if not isinstance(c, str) and c.ok]))
    except typer.Exit:
        raise
    except Exception as e:  # noqa: BLE001 - only a database error is turned into one line; anything else re-raised
        _unreadable(url, e, json_)
        raise
    unreached = [x for x in (audit, *checked, fresh) if isinstance(x, str)]
    audit = None if isinstance(audit, str) else audit
    checked = [c for c in checked if not isinstance(c, str)]
    fresh = [] if isinstance(fresh, str) else fresh
    problems = [*report.problems, *(p for _, p in (audit.problems if audit else [])),
                *(p for c in checked for p in c.problems), *fresh, *unreached]
    first_bad = report.first_bad_seq if not report.ok else next(
        (s for s, _ in (audit.problems if audit else []) if s is not None), None)
    signatures = {"checked": audit.checked, "problems": [p for _, p in audit.problems]} if audit else None
    _report_verify(json_, checked, problems, entries=report.entries, first_bad=first_bad, signatures=signatures,
                   source=source)


def _report_verify(json_: bool, checked: list, problems: list[str], *, entries, first_bad, signatures, source) -> None:
    # checkpoint_sources: how many checkpoints the workspace recorded and --checkpoint gave (none: a cut-off or
    # forged tail cannot show)
    data = {"ok": not problems, "entries": entries, "first_bad_seq": first_bad,
            "problem": problems[0] if problems else "", "problems": problems,
            "signatures": signatures or {"checked": 0, "problems": []},
            "checkpoints": [c.to_dict() for c in checked], "checkpoint_sources": source}
    emit(json_, data, lambda: tables.print_verify(data))
    if problems:
        raise typer.Exit(1)


def _reached(report, what: str, check):
    """``check()``; on a ledger verify found damaged, an error reading it is the line saying what went unchecked."""
    try:
        return check()
    except GatekeeperError:
        raise
    except Exception as e:  # noqa: BLE001
        if report.ok:
            raise  # an intact ledger: a bug, exit 3
        return f"{what}: not checked, the damaged ledger cannot be read for it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _preflight(url: str):
    """Problems in a ledger's ``migrations`` table and layout, read without opening (migrating) it, with
    everything else verify finds where the tables are the current ones; and that report, if made."""
    from sqlalchemy.exc import OperationalError

    from ..ledger.engine import make_engine, read
    from ..ledger.verify import preflight, reference, tables, verify

    sqlite = url.startswith("sqlite:///")
    if sqlite and not Path(url[len("sqlite:///"):]).is_file() or not (sqlite or url.startswith("postgresql")):
        return [], None  # none there, or another database: opening it says what there is
    engine = make_engine(url)
    try:
        with read(engine) as conn:
            early = preflight(conn)
            if early and tables(conn) == reference()["tables"]:  # the rest can be checked unopened too
                report = verify(conn)
                return list(dict.fromkeys([*report.problems, *early])), report
            return early, None
    except OperationalError:
        return [], None  # a server that cannot be reached: opening the ledger says so
    finally:
        engine.dispose()


def _unreadable(url: str, e: Exception, json_: bool) -> None:
    """A SQLite ledger that cannot be read at all: one line. Exit 2 when the file is not an SQLite database
    (or cannot be opened), exit 1 when it is one but damaged. Anything else: returns, and the caller re-raises."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    cause = e if isinstance(e, DBAPIError) else e.__cause__
    orig = getattr(cause, "orig", None)
    if isinstance(e, UnicodeDecodeError) and url.startswith("sqlite:"):
        why = "its schema holds bytes that are not UTF-8"  # pysqlite failed to decode SQLite's own message
    elif not url.startswith("sqlite:") or not isinstance(orig, sqlite3.DatabaseError):
        return
    else:
        why = (str(orig).splitlines() or [type(orig).__name__])[0]
    where = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url
    if "file is not a database" in why or "unable to open" in why:
        raise GatekeeperError(f"{where}: not a ledger: SQLite cannot open it as a database ({why})") from None
    line = f"{where}: the ledger is damaged and SQLite cannot read it ({why})"
    if json_:
        typer.echo(json.dumps({"ok": False, "error": line, "problem": line, "problems": [line]}, indent=2))
    else:
        typer.echo(f"ledger DAMAGED: {line}")
    raise typer.Exit(1) from None


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
    from ..gate import attestation

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
    from ..ledger.export import FORMATS, render

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
    from ..ledger.diff import diff, markdown

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
    data = {"evaluation": evaluation_id, "flag": pred["evaluation"]["flag"], "verdict": pred["verdict"],
            "file": str(output) if output else None, "signer": pred["signer"], "predicate_type": statement["predicateType"],
            "subjects": statement["subject"], "checkpoint": {k: pred["ledger"][k] for k in ("seq", "hash", "entries", "at")},
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
