"""Flag commands: status, flip, and what the flags in force make of the pipeline (hash, pin)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import EngineName, Json, Settings, emit, reporting


@reporting
def status(ctx: typer.Context, json_: Json = False) -> None:
    """Each flag's state as the ledger records it, and whether the evidence behind it is still current."""
    from .. import flags, gate

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    rows = []
    with settings.opened_ledger(ws, create=False) as ledger:
        for flag, st in flags.states(ws, ledger).items():
            row = {"flag": flag, **st, "evidence_current": None, "evidence_problems": []}
            if st["state"] == "on" and st["evaluation_id"] is not None:
                evaluation = ledger.evaluation(st["evaluation_id"])
                problems = flags.evidence_problems(ws, flag, evaluation, lambda ev: gate.identity_now(ws, ev, ledger))
                row.update(evidence_current=not problems, evidence_problems=problems)
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
    json_: Json = False,
) -> None:
    """Turn a flag on (one approval per distinct operator, on current passing evidence) or off."""
    import getpass

    from .. import flags, gate

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ws.policy(flag)
    if state not in ("on", "off"):
        raise GatekeeperError(f"state must be 'on' or 'off', not {state!r}")
    if not reason.strip():
        raise GatekeeperError("--reason is required: say why the flag changes")
    with settings.opened_ledger(ws, create=True) as ledger:
        result = flags.flip(ws, ledger, flag, state, evaluation_id=evaluation, operator=operator or getpass.getuser(),
                            reason=reason, identity_now=lambda ev: gate.identity_now(ws, ev, ledger))
    emit(json_, result.to_dict(), lambda: tables.print_flip(flag, result))
    if result.action == "refused":
        raise typer.Exit(1)


@reporting
def hash_(ctx: typer.Context, engine: EngineName = "auto",
          json_: Json = False) -> None:
    """Print the pipeline-version hash (it keys the response cache) and its parts."""
    from .. import flags, pipeline
    from ..engines.registry import build_engine

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        force = pipeline.in_force(ws, ledger)
    with build_engine(pipeline.engine_profile(ws, engine, force), workspace_root=ws.root) as model:
        parts, digest = pipeline.version(ws, force, model.identity())
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
