"""Flag commands: status, flip, and what the flags in force make of the pipeline (hash, pin)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import EngineName, Json, Settings, emit, reporting

if TYPE_CHECKING:
    from ..gate.enable.attestation import Attestation


@reporting
def status(ctx: typer.Context, json_: Json = False) -> None:
    """Each flag's state as the ledger records it, and whether the evidence behind it is still current."""
    from ..gate import guard
    from ..gate.state import flags

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    rows: list[flags.StatusRow] = []
    with settings.reading_ledger(ws) as ledger:
        for flag, st in flags.states(ws, ledger).items():
            row: flags.StatusRow = {"flag": flag, **st, "evidence_current": None, "evidence_problems": [],
                                    "currency_error": None, "live": guard.live(ledger, flag)}
            if st["state"] == "on" and st["evaluation_id"] is not None:
                from ..gate.enable import current  # the battery and engines: only to check the evidence of a flag that is on

                try:  # an engine that cannot be reached now: said beside the ledger's facts, never instead of them
                    problems = current.evidence_problems(ws, ledger, flag, ledger.evaluation(st["evaluation_id"]))
                    row["evidence_current"], row["evidence_problems"] = not problems, problems
                except GatekeeperError as e:
                    row["currency_error"] = str(e)
            rows.append(row)
    emit(json_, {"workspace": str(ws.root), "flags": rows}, lambda: tables.print_status(rows))


@reporting
def flip(
    ctx: typer.Context,
    flag: Annotated[str, typer.Argument(help="The flag (a policy in policies/).")],
    state: Annotated[str, typer.Argument(help="on or off.")],
    evaluation: Annotated[Optional[int], typer.Option(help="The passing evaluation that justifies turning it on.")] = None,
    operator: Annotated[Optional[str], typer.Option(help="Who approves (default: the login name).")] = None,
    reason: Annotated[str, typer.Option(help="Why the flag changes (recorded).")] = "",
    sign: Annotated[Optional[Path], typer.Option(
        help="Sign the act with this SSH private key (default: $GATEKEEPER_SIGNING_KEY); its public key must be "
             "in policies/allowed_signers.")] = None,
    signature: Annotated[Optional[Path], typer.Option(
        help="A signature made elsewhere (ssh-keygen -Y sign -n gatekeeper) over the --record file.")] = None,
    record: Annotated[Optional[Path], typer.Option(help="The record --signature signs (made by --print-record).")] = None,
    print_record: Annotated[bool, typer.Option(
        "--print-record", help="Print the record this flip would sign, dated now, and write nothing.")] = False,
    json_: Json = False,
) -> None:
    """Turn a flag on (one approval per distinct operator, on current passing evidence) or off."""
    import getpass
    import os
    from functools import partial

    from .. import signing
    from ..gate.enable import attestation
    from ..gate.enable import flip as flip_
    from ..ledger import checkpoint

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    policy = ws.policy(flag)
    if state not in ("on", "off"):
        raise GatekeeperError(f"state must be 'on' or 'off', not {state!r}")
    if not reason.strip():
        raise GatekeeperError("--reason is required: say why the flag changes")
    operator = operator or getpass.getuser()
    if print_record:
        if sign or signature or record:
            raise GatekeeperError("--print-record only prints the record to sign; leave out --sign, --signature and --record")
        with settings.opened_ledger(ws, create=False) as ledger:
            message = attestation.print_record(ws, ledger, flag, state, evaluation_id=evaluation, operator=operator, reason=reason)
        if json_:
            typer.echo(json.dumps({"record": json.loads(message), "message": message.decode()}, indent=2))
        else:
            typer.echo(message.decode(), nl=False)
        return
    attest = _attestation(sign, signature, record, os.environ.get(signing.SIGNING_KEY_ENV))
    _ = ws.allowed_signers  # a malformed allowed_signers is exit 2 before anything is written
    if policy.approvals.checkpoint_after_flip:
        for path in (checkpoint.log_path(ws), ws.checkpoint_path):
            _writable(path)
    with settings.opened_ledger(ws, create=True) as ledger:
        result = flip_.flip(ws, ledger, flag, state, evaluation_id=evaluation, operator=operator, reason=reason,
                            attestation=attest, record_checkpoint=partial(checkpoint.after_flip, ws, ledger))
    emit(json_, result.to_dict(), lambda: tables.print_flip(flag, result, result.checkpoint))
    if result.action == "refused" or "error" in (result.checkpoint or {}):
        raise typer.Exit(1)


def _attestation(sign: Optional[Path], signature: Optional[Path], record: Optional[Path],
                 env_key: Optional[str]) -> Attestation | None:
    """What vouches for this flip: --sign KEY, --signature with --record, $GATEKEEPER_SIGNING_KEY, or nothing."""
    from .. import signing
    from ..gate.enable import attestation

    if (signature is None) != (record is None):
        raise GatekeeperError("--signature and --record go together: the record (flip ... --print-record) "
                              "and its signature (ssh-keygen -Y sign -n gatekeeper -f KEY RECORD)")
    if signature is not None:
        if sign is not None:
            raise GatekeeperError("give --sign KEY or --signature with --record, not both")
        assert record is not None  # checked above: --signature and --record go together
        return attestation.Attestation(record=_read(record, "--record").encode(), signature=_read(signature, "--signature"),
                                 source=f"--signature {signature}")
    path = sign or (Path(env_key) if env_key else None)
    return attestation.Attestation(key=signing.load_key(path)) if path is not None else None


def _read(path: Path, option: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GatekeeperError(f"{option} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GatekeeperError(f"{option} {path}: cannot read it as text ({e})") from None


def _writable(path: Path) -> None:
    """The policy's checkpoint can be written after the flip, so the flip never goes unrecorded there."""
    import os

    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise GatekeeperError(f"{path}: cannot be written, and the policy wants a checkpoint there after every flip")


@reporting
def hash_(ctx: typer.Context, engine: EngineName = "auto",
          json_: Json = False) -> None:
    """Print the pipeline-version hash (it keys the response cache) and its parts."""
    from ..engines import registry
    from ..gate.state import flags, pipeline

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.reading_ledger(ws) as ledger:
        force = pipeline.in_force(ws, ledger)
    identity = registry.identity(pipeline.engine_profile(ws, engine, force), workspace_root=ws.root)
    parts, digest = pipeline.version(ws, force, identity)
    data = {"pipeline_hash": digest, "hash_parts": flags.hash_parts(ws), "parts": parts}
    emit(json_, data, lambda: tables.print_hash(data))


@reporting
def pin(ctx: typer.Context, engine: EngineName = "auto", json_: Json = False) -> None:
    """Save each stage's static prefix state on this machine and write the recipe to the workspace."""
    from ..runtime import Runtime

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    if "prefix_cache" not in ws.policies:
        raise GatekeeperError(f"no policy for prefix_cache in {ws.root / 'policies'}; pinned prefixes serve that flag: "
                              "add policies/prefix_cache.yaml (gatekeeper init writes one)")
    with Runtime(ws.root, engine=engine, ledger=settings.ledger_url(ws), flags={"prefix_cache": "on"},
                 response_cache=False, persist=True) as rt:
        recipe, sources = rt.write_recipe(), rt.prefix_sources
    rows = [{"stage": stage, **entry, "state": sources.get(stage)} for stage, entry in recipe["stages"].items()]
    data = {"recipe": str(ws.root / "recipe.json"), "stages": rows}
    emit(json_, data, lambda: tables.print_pin(data))
