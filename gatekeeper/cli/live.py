"""Live-deployment commands: meter traffic through a capturing proxy, and read a server's own log."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import GatekeeperError
from .common import Json, Settings, emit, reporting


@reporting
def proxy(
    ctx: typer.Context,
    upstream: Annotated[str, typer.Option(help="The OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8080.")],
    capture: Annotated[Optional[Path], typer.Option(
        help="Local JSONL file: one line per completion call, with its telemetry (optional with --guard).")] = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on; point the pipeline's client here.")] = "127.0.0.1:8081",
    no_text: Annotated[bool, typer.Option("--no-text", help="Capture (and the guard records) lengths, digests and telemetry only, no prompt text or ids.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds the upstream may stay silent before a call gets 504.")] = 600.0,
    guard: Annotated[Optional[str], typer.Option(
        help="Watch this flag, which is on and served by --upstream: shadow live requests to --shadow, per the "
             "policy's guard: section, and turn the flag off on a breach.")] = None,
    shadow: Annotated[Optional[str], typer.Option(help="With --guard: the flag-off deployment's base URL.")] = None,
    shadow_engine: Annotated[Optional[str], typer.Option(
        help="With --guard, instead of --shadow: an http engine profile in engines/ whose flag-off side (url, or the "
             "serve: command gatekeeper starts and stops) is the flag-off deployment.")] = None,
    sign: Annotated[Optional[Path], typer.Option(
        help="With --guard: the service key that signs a rollback (default: $GATEKEEPER_SIGNING_KEY); its public "
             "key must be in policies/allowed_signers.")] = None,
    webhook: Annotated[Optional[str], typer.Option(help="With --guard: a URL that gets a JSON POST on a rollback.")] = None,
    name: Annotated[Optional[str], typer.Option(
        help="With --guard: this proxy's name in a fleet (proxies in front of replicas that share one --ledger are "
             "one test); each batch it writes names it. Default: this host and --listen.")] = None,
) -> None:
    """Forward traffic to the upstream unchanged (streams included) and capture each completion call with its
    telemetry; with --guard, compare a share of live calls with the flag-off side and roll the flag back on a breach
    (exit 1 when it stops after a rollback)."""
    from ..traffic.live.proxy import serve

    if timeout <= 0:
        raise GatekeeperError("--timeout must be above 0 seconds")
    if capture is None and not guard:
        raise GatekeeperError("--capture FILE is required (the proxy's record of each call), unless --guard watches a flag")
    if shadow and shadow_engine:
        raise GatekeeperError("give --shadow URL or --shadow-engine NAME, not both")
    servers: dict = {}
    watch = None
    if guard or shadow or shadow_engine:
        settings: Settings = ctx.obj
        ws = settings.open_workspace()
        if guard:
            ws.policy(guard)  # an unknown flag or a bad guard: section is exit 2 before any server starts
        shadow, servers = _other_side(ws, shadow, shadow_engine)
        watch = _guard(ws, settings.ledger_url(ws), guard, shadow, sign, webhook, no_text, servers, name or _here(listen),
                       lambda: _reader(ws, guard, upstream, shadow, shadow_engine))

    def ready(url: str, up: str) -> None:
        doing = [f"capturing to {capture} (local file)"] if capture else []
        if watch is not None:
            aa = f", {watch.policy.aa_rate:.0%} of those twice for an A/A baseline" if watch.policy.aa_rate else ""
            doing.append(f"guarding {guard} against {watch.other} ({watch.policy.rate:.0%} shadowed{aa}; metrics at {url}/metrics)")
        lines = [f"gatekeeper proxy: listening on {url}, forwarding to {up}, {', '.join(doing)}; Ctrl-C stops"]
        if watch is not None and not watch.policy.aa_rate:
            lines.append(f"gatekeeper guard: aa_rate is 0 in policies/{guard}.yaml: no A/A baseline, so every parting "
                         "counts against the rule's limits as the flag's; right only where both sides are batch-invariant "
                         "(vLLM with VLLM_BATCH_INVARIANT=1, SGLang with --enable-deterministic-inference, llama.cpp with "
                         "one slot), else batch noise rolls the flag back (docs/guard.md)")
        typer.echo("\n".join(lines), err=True)

    try:
        serve(upstream, listen, capture, no_text=no_text, timeout=timeout, ready=ready, guard=watch)
    finally:
        from ..engines.served import serve as servers_

        servers_.stop(servers)
    if watch is not None and watch.rollback is not None:
        raise typer.Exit(1)


def _other_side(ws, shadow: Optional[str], engine: Optional[str]) -> tuple[Optional[str], dict]:
    """The flag-off deployment's URL: --shadow, or the flag-off side of an http engine profile (its server started
    here when the profile says ``serve:``), with the servers started."""
    from ..engines.served import serve as servers_

    if engine is None:
        return shadow, {}
    profile = ws.engine(engine)
    if profile.adapter != "http":
        raise GatekeeperError(f"{profile.where}: field 'adapter' is {profile.adapter}; --shadow-engine takes an http "
                              "profile (url, or serve: the command that starts the flag-off server)")
    if profile.started("off") is None:
        url = profile.url if isinstance(profile.url, str) else (profile.url or [None])[0]
        return url, {}
    started = servers_.start(profile.model_copy(update={"serve_on": None, "url_on": None}), ws.root)
    return started["off"].url, started


def _reader(ws, flag: Optional[str], upstream: str, shadow: Optional[str], engine: Optional[str]):
    """With the policy's ``guard.distance``: an http engine of the --shadow-engine profile's dialect whose flag-off side
    is the shadow and flag-on side the upstream, to read both teacher-forced (``traffic/live/judge.py``); else None."""
    policy = ws.policy(flag).guard if flag else None
    if not shadow or engine is None or policy is None or not policy.distance:
        return None
    from ..engines.served.http import HTTPEngine

    profile = ws.engine(engine)
    return HTTPEngine(profile.model_copy(update={"serve": None, "serve_on": None, "url": shadow,
                                                 "url_on": upstream.rstrip("/")}), workspace_root=ws.root)


def _here(listen: str) -> str:
    """This proxy's default name in a fleet: the host it runs on and the address it listens at."""
    import socket

    return f"{socket.gethostname()}/{listen}"


def _guard(ws, ledger_url: str, flag: Optional[str], shadow: Optional[str], sign: Optional[Path],
           webhook: Optional[str], no_text: bool, servers: dict, name: str, reader=lambda: None):
    """The guard for ``--guard``: every check that can fail (policy, ledger, flag state, key) runs before listening;
    a server started for it is stopped when one fails."""
    import os

    from .. import signing
    from ..engines.served import serve as servers_
    from ..traffic.live.guarded import Guarded
    from ..traffic.live.proxy import check_upstream

    try:
        if not flag or not shadow:
            raise GatekeeperError("--guard FLAG and --shadow URL (or --shadow-engine NAME) go together: the flag to "
                                  "watch and its flag-off deployment")
        check_upstream(shadow)
        if webhook is not None and not webhook.startswith(("http://", "https://")):
            raise GatekeeperError(f"--webhook {webhook!r}: give an http(s) URL")
        key = sign or (Path(os.environ[signing.SIGNING_KEY_ENV]) if os.environ.get(signing.SIGNING_KEY_ENV) else None)
        if key is None:
            raise GatekeeperError(f"--guard needs a service key to sign its rollbacks: pass --sign KEY or set "
                                  f"${signing.SIGNING_KEY_ENV} (its public key in policies/allowed_signers)")

        def say(line: str) -> None:
            typer.echo(line, err=True)

        return Guarded(ws, ledger_url, flag, shadow, signing.load_key(key), no_text=no_text, webhook=webhook, say=say,
                       name=name, reader=reader())
    except BaseException:
        servers_.stop(servers)
        raise


@reporting
def forensics(
    logs: Annotated[list[Path], typer.Argument(help="The server's log file(s), oldest first.")],
    capture: Annotated[Optional[Path], typer.Option(
        help="A capture of the same traffic with token ids (gatekeeper proxy): reuse across requests, and advice.")] = None,
    unit: Annotated[int, typer.Option(help="Tokens: shared prefixes below this are not reuse; the advice's checkpoint spacing.")] = 256,
    cache_ram: Annotated[Optional[list[int]], typer.Option(
        help="Host prompt cache sizes (MiB, repeatable) the advice simulates. Default: 1024, 8192, 32768.")] = None,
    advise: Annotated[bool, typer.Option("--advice/--no-advice",
        help="With --capture: simulate each server setting on the traffic (minutes per 10,000 requests).")] = True,
    json_: Json = False,
) -> None:
    """Reconstruct a llama.cpp-family server's prompt reuse and checkpoint life cycle from its log; with a capture,
    reuse across requests and what each server setting would have re-used."""
    from ..traffic.logs import advice
    from ..traffic.logs import forensics as reading

    if cache_ram and any(m < 1 for m in cache_ram):
        raise GatekeeperError("--cache-ram sizes must be at least 1 MiB")
    report = reading.read(logs, capture, unit=unit, cache_ram=cache_ram or advice.CACHE_RAM, advise=advise)
    emit(json_, report, lambda: print_forensics(report))


def _n(v: Any, fmt: str = "{:,}") -> str:
    return "-" if v is None else fmt.format(v)


def print_forensics(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    views = {**{f"slot {k}": v for k, v in r["slots"].items()}, "total": r}
    table = Table("", *views, title=f"{r['requests']} requests in {len(r['files'])} log file(s), {r['lines']:,} lines")
    rows = [("prompt tokens", lambda v: _n(v["prompt_tokens"])), ("re-used", lambda v: _n(v["reused"])),
            ("re-processed", lambda v: _n(v["processed"])), ("reusable, re-processed", lambda v: _n(v["lost"])),
            ("reusable share", lambda v: _n(v["reusable_share"], "{:.1%}")),
            ("re-used share", lambda v: _n(v["reused_share"], "{:.1%}")),
            ("forced full re-processing", lambda v: str(v["full_reprocessing"]["forced"])),
            ("silent full re-processing", lambda v: str(v["full_reprocessing"]["silent"])),
            ("checkpoints created", lambda v: str(v["checkpoints"]["created"])),
            ("checkpoints restored", lambda v: str(v["checkpoints"]["restored"])),
            ("checkpoints erased", lambda v: ", ".join(f"{k} {n}" for k, n in v["checkpoints"]["erased_by_reason"].items()) or "0"),
            ("all checkpoints wiped", lambda v: str(v["checkpoints"]["wipes"])),
            ("prompt cache loads", lambda v: str(v["prompt_cache"]["loaded"])),
            ("prefill s / decode s", lambda v: f"{_n(v['prefill_s'], '{:.3f}')} / {_n(v['decode_s'], '{:.3f}')}")]
    for label, cell in rows:
        table.add_row(label, *(cell(v) for v in views.values()))
    dist = r["common_prefix"]
    if dist:
        table.add_row("common prefix min/median/max", *(
            "-" if not v["common_prefix"] else f"{v['common_prefix']['min']:,} / {v['common_prefix']['median']:,} / "
            f"{v['common_prefix']['max']:,}" for v in views.values()))
    console.print(table)
    for p in r["problems"]:
        console.print(f"[yellow]partial:[/yellow] {p}" if not r["complete"] else p, highlight=False)
    for u in r["unparsed"]["examples"][:5]:
        console.print(f"  {u['file']}:{u['line']}: {u['text'][:160]}", highlight=False, markup=False)
    for line in r["cannot_report"]:
        console.print(f"not reported: {line}", highlight=False, markup=False)
    if r["reuse"]:
        _print_reuse(console, r["reuse"])
    if r["advice"]:
        _print_advice(console, r["advice"])


def _print_reuse(console: Any, u: dict) -> None:
    from rich.table import Table

    table = Table("", "tokens", "share of possible",
                  title=f"reuse across requests ({u['requests']} requests matched, {u['unmatched']} not; unit {u['unit']})")
    table.add_row("possible (shared with any earlier request)", _n(u["possible"]), "")
    table.add_row("obtained", _n(u["obtained"]), _n(u["obtained_share"], "{:.1%}"))
    for cause, n in u["lost_by_cause"].items():
        table.add_row(f"lost: {cause.replace('_', ' ')}", _n(n), _n(n / u["possible"] if u["possible"] else None, "{:.1%}"))
    table.add_row("silent full re-processing (requests)", str(u["silent"]), "")
    console.print(table)
    for reason, n in u["forced_reasons"].items():
        console.print(f"  forced {n}x: {reason}", highlight=False, markup=False)


def _print_advice(console: Any, a: dict) -> None:
    from rich.table import Table

    advice = Table("setting", "re-used", "share of possible", "memory MiB",
                   title=f"advice: each setting simulated on these {a['requests']} requests")
    for line in a["lines"]:
        advice.add_row(line["setting"], _n(line["reused"]), _n(line["share"], "{:.1%}"), _n(line["memory_mib"], "{:,.1f}"))
    console.print(advice)
