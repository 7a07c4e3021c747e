"""Flag evaluations from a verified ledger: what ``gatekeeper flags serve`` and the in-process provider answer.

A ``Resolver`` holds the workspace's flags as one ``Snapshot``: per flag its value (the ledger's state as a
boolean), variant (``on``/``off``), reason and metadata (the evaluation the state rests on, the
pipeline-version hash), or one error for all of them.

The failure rule: a snapshot is made only from a ledger that passes what ``gatekeeper ledger verify`` checks
by default (the chain and every row, the signatures, every checkpoint the workspace records and the
policies' ``checkpoint_after_flip``). A ledger that does not, or cannot be read, or a workspace whose pipeline
cannot be resolved, makes an error snapshot: every evaluation is then an error, never the last known "on".
Flag states are read before the verification that vouches for them, so an edit made in between is caught.

Re-verification is paid only on change. Each call reads a cheap stamp: for a SQLite ledger, ``PRAGMA
data_version`` on one read-only connection held open (it moves on every commit by any other connection, an
edit with the sqlite3 shell included) and the chain's last entry (one index lookup); for other databases the
last entry, plus a full recheck every ``recheck_s`` seconds; and (looked at once a second at most) the names,
sizes and times of the workspace's policies, engine profiles, suites and checkpoints. An unchanged stamp
returns the snapshot made before, whatever the ledger's length. The engine identity (from the model's files, or
by loading it where the adapter cannot tell it otherwise) is computed once per resolved engine profile.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

from ..engines.registry import identity, resolve_profile
from ..errors import GatekeeperError
from ..gate.enable import attestation
from ..gate.state import flags as flag_states
from ..gate.state import pipeline, rollout
from ..identity import digest
from ..ledger import CURRENT_VERSION, Ledger
from ..ledger import checkpoint as checkpoints
from ..ledger.stamp import LedgerStamp
from ..ledger.store import shown
from ..workspace import EngineProfile, Workspace, files_stamp, find_root

# OpenFeature's reasons, as the spec defines them.
DEFAULT = "DEFAULT"  # never flipped: the policy's default (off), "a pre-configured value"
STATIC = "STATIC"  # the ledger's latest flip: one value for every context, "no dynamic evaluation"
SPLIT = "SPLIT"  # a rollout's step: "a pseudorandom assignment", by the targeting key
RECHECK_S = 60.0  # databases without data_version (PostgreSQL): a full re-verification at least this often
FILES_EVERY_S = 1.0  # the workspace's files are looked at no more often: an edited policy shows within a second


class Unservable(GatekeeperError):
    """No flag can be served: the ledger does not verify or cannot be read, or the pipeline cannot be resolved."""

    code = "GENERAL"


class FlagNotFound(GatekeeperError):
    code = "FLAG_NOT_FOUND"


@dataclass(frozen=True)
class Resolution:
    key: str
    value: bool
    reason: str
    metadata: dict[str, Any]  # OpenFeature flag metadata: strings, numbers and booleans only
    share: float = 1.0  # a rollout's step in force (the policy's rollout:): the share of targeting keys served on

    @property
    def variant(self) -> str:
        return "on" if self.value else "off"

    def for_key(self, targeting_key: str | None) -> "Resolution":
        """The value for one evaluation context: during a rollout, on for the targeting keys within the step's share
        (OpenFeature's fractional evaluation, reason SPLIT; the proxy and the Runtime draw the same way), off for the
        rest and for a context with no targeting key."""
        if not self.value or self.share >= 1:
            return self
        on = targeting_key is not None and rollout.serves_on(self.key, targeting_key, self.share)
        return replace(self, value=on, reason=SPLIT, metadata={**self.metadata, "rolloutShare": self.share})


@dataclass(frozen=True)
class Snapshot:
    flags: dict[str, Resolution]
    error: str | None = None  # set: every evaluation is this error
    version: str = ""  # a digest of every resolution: changes when any value, reason or metadata does

    @classmethod
    def of(cls, resolutions: list[Resolution]) -> "Snapshot":
        flags = {r.key: r for r in resolutions}
        return cls(flags, version=digest([[r.key, r.value, r.reason, r.metadata, r.share] for r in resolutions]))

    @classmethod
    def failed(cls, why: str) -> "Snapshot":
        return cls({}, error=why)

    def resolve(self, key: str) -> Resolution:
        if self.error is not None:
            raise Unservable(self.error)
        if key not in self.flags:
            known = ", ".join(self.flags) or "none"
            raise FlagNotFound(f"no flag {key!r}: the workspace has no policies/{key}.yaml (flags: {known})")
        return self.flags[key]


class Resolver:
    """The workspace's flags, re-read and re-verified only when the ledger or the workspace's files change."""

    def __init__(self, workspace: str | os.PathLike | None = None, *, ledger: str | None = None,
                 engine: str = "auto", recheck_s: float = RECHECK_S):
        self.root = find_root(workspace)
        ws = Workspace(self.root)
        # A workspace that cannot be read is an error here, before anything is served.
        _ = ws.policies
        ws.engine(engine)
        self.url = ledger or f"sqlite:///{ws.ledger_path}"
        self.engine = engine
        self.checkpoints = (ws.checkpoint_path, checkpoints.log_path(ws))
        self._probe = LedgerStamp(self.url, recheck_s)
        self._identities: dict[str, dict[str, Any]] = {}  # resolved engine profile -> its identity
        self._building = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._stamp: tuple | None = None
        self._files: tuple = ()
        self._files_at = -FILES_EVERY_S

    def close(self) -> None:
        self._probe.close()

    def __enter__(self) -> "Resolver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stamp(self) -> tuple:
        now = time.monotonic()
        if now - self._files_at >= FILES_EVERY_S:  # a stat per file: 0.2 ms for 100 policies, so not every call
            self._files, self._files_at = files_stamp(self.root, self.checkpoints), now
        return (self._probe.stamp(), self._files)

    def fresh(self) -> Snapshot | None:
        """The snapshot made before if nothing it rests on changed since (cheap); None when it must be remade."""
        snapshot = self._snapshot
        return snapshot if snapshot is not None and self.stamp() == self._stamp else None

    def snapshot(self) -> Snapshot:
        """The current snapshot, remade (read, verified) if the ledger or the workspace changed."""
        if (snapshot := self.fresh()) is not None:
            return snapshot
        with self._building:  # one rebuild at a time; callers that waited find it done
            stamp = self.stamp()
            if self._snapshot is None or stamp != self._stamp:
                # Stored with the stamp from before it was read: a change during the build means a rebuild next time.
                self._snapshot, self._stamp = self._build(), stamp
            return self._snapshot

    def resolve(self, key: str) -> Resolution:
        return self.snapshot().resolve(key)

    def _build(self) -> Snapshot:
        try:
            return self._read()
        except GatekeeperError as e:
            return Snapshot.failed(str(e))
        except Exception as e:  # noqa: BLE001 - a database that cannot be read, or a bug: an error, never a value
            from sqlalchemy.exc import DBAPIError

            cause = getattr(e, "orig", None) or e
            line = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
            if isinstance(e, (DBAPIError, sqlite3.Error)):
                return Snapshot.failed(f"the ledger at {shown(self.url)} cannot be read ({line}); "
                                       "run 'gatekeeper ledger verify' to see what is wrong with it")
            return Snapshot.failed(f"flag states cannot be served: internal error, a bug in gatekeeper ({line}); "
                                   "please report it")

    def _read(self) -> Snapshot:
        ws = Workspace(self.root)
        with self._opened() as ledger:
            try:
                read: Any = (flag_states.states(ws, ledger), pipeline.in_force(ws, ledger))
            except Exception as e:  # noqa: BLE001 - on a damaged ledger, say what verify finds, not what broke here
                read = e
            problems = verify(ws, ledger, self.url)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Unservable(f"the ledger at {shown(self.url)} does not verify: {problems[0]}{more}; no flag is "
                             "served from it; run 'gatekeeper ledger verify' to see every problem")
        if isinstance(read, Exception):
            raise read
        states, force = read
        _, pipeline_hash = pipeline.version(ws, force, self._identity(pipeline.engine_profile(ws, self.engine, force)))
        out = []
        for flag, st in states.items():
            metadata: dict[str, Any] = {"pipelineHash": pipeline_hash}
            if st["evaluation_id"] is not None:
                metadata["evaluationId"] = st["evaluation_id"]
            if st["since"] is not None:
                metadata["flippedAt"] = st["since"]
            out.append(Resolution(flag, st["state"] == "on", STATIC if st["since"] is not None else DEFAULT, metadata,
                                  _share(ws, ledger, flag) if st["state"] == "on" else 1.0))
        return Snapshot.of(out)

    @contextmanager
    def _opened(self) -> Iterator[Ledger | None]:
        """The ledger, opened read-only (None when its SQLite file does not exist). Its version is read first, so a
        file that is no database is the resolver's 'cannot be read' and an older ledger says how to upgrade it."""
        from ..ledger.database import make_engine
        from ..ledger.migrations import schema_version

        if self._probe.path is not None and not self._probe.path.is_file():
            yield None
            return
        engine = make_engine(self.url)
        try:
            version = schema_version(engine)
        finally:
            engine.dispose()
        if version < CURRENT_VERSION:
            raise Unservable(f"the ledger at {shown(self.url)} is at schema version {version}, older than this "
                             f"gatekeeper's {CURRENT_VERSION}, and serving never writes; upgrade it once with "
                             "'gatekeeper ledger verify'")
        ledger = Ledger(self.url, read_only=True)
        try:
            yield ledger
        finally:
            ledger.close()

    def _identity(self, profile: EngineProfile) -> dict[str, Any]:
        key = resolve_profile(profile).model_dump_json()
        if key not in self._identities:
            self._identities[key] = identity(profile, workspace_root=self.root)
        return self._identities[key]


def _share(ws: Workspace, ledger: Ledger | None, flag: str) -> float:
    """A flag that is on: its rollout's step in force, as the guard's batches of the flip to on record it (1: none)."""
    policy = ws.policy(flag).rollout
    if policy is None or ledger is None:  # the ledger is read only for a flag that has a rollout
        return 1.0
    last = ledger.flag_states().get(flag)
    if last is None:
        return 1.0
    return policy.steps[min(rollout.step_of(ledger.shadows(flag, last["id"])), len(policy.steps) - 1)]


def verify(ws: Workspace, ledger: Ledger | None, url: str) -> list[str]:
    """What ``gatekeeper ledger verify`` finds wrong with the ledger and the workspace's checkpoints; [] when
    nothing. No ledger is fine (nothing was ever flipped) unless a checkpoint says there was one."""
    recorded = checkpoints.recorded(ws)
    if ledger is None:
        if recorded:
            name, newest = max(recorded, key=lambda r: r[1]["seq"])
            return [f"there is no ledger at {shown(url)}, yet {name} records one up to seq {newest['seq']}: "
                    "it was deleted or moved"]
        return []
    report = ledger.verify(ws.root, record=False)  # recorded below, once the checkpoints passed too
    if chain := [p for p in report.problems if p != report.behind]:
        return chain  # the rest reads rows that verify has found damaged
    out = [p for _, p in attestation.audit_signatures(ws, ledger).problems]
    where = checkpoints.location(ledger.url, ws.root)
    checked = [checkpoints.check(c, name, ledger, where, ws.allowed_signers) for name, c in recorded]
    out += [p for c in checked for p in c.problems]
    out += checkpoints.uncovered_flips(ws, ledger, [c for c in checked if c.ok])
    out += [report.behind] if report.behind else []  # a cut tail: a checkpoint that shows it says more, first
    if not out:
        ledger.record_verified(ws.root, report)
    return out
