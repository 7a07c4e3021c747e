"""Proving the ledger was not edited: recheck the chain and every typed row against it, and what the
chain does not hash: the append-only triggers, the table layout and the ``migrations`` table.

Everything read here may be damaged (a flipped byte in the file, an edit with the sqlite3 shell), so
nothing is assumed of a stored value: a value that is not the type its column holds, text that is not
UTF-8, a table that cannot be read, each is a named problem, never an exception.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Sequence

from sqlalchemy import Boolean, Connection, Integer, text
from sqlalchemy.exc import SQLAlchemyError

from gatekeeper.errors import LedgerIntegrityError
from gatekeeper.identity import canonical_json
from gatekeeper.ledger.chain import GENESIS, entry_hash
from gatekeeper.ledger.records import encode
from gatekeeper.ledger.tables import KINDS, Entry, Migration

# The kinds a ledger holds by the thousand (an evaluation's cases, the guard's batches): a verify from a mark reads only
# their new rows. Every row of the others (evaluations, verdicts, approvals, flips: what flags and gates rest on, one
# per decision) is rechecked against its entry on every verify, so an edited flip is never served.
BULKY = ("case_result", "comparison", "shadow")


@dataclass(frozen=True)
class Point:
    """Where a verify got to (``mark`` records it): its last entry, how many entries, the first entry's hash (which
    ledger), and each kind's largest row id, so the next verify reads only entries and rows after them."""

    seq: int
    hash: str
    entries: int
    first: str
    rows: dict[str, int]


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    entries: int
    first_bad_seq: int | None  # None when ok, or when the only fault is a row with no entry
    problem: str  # the first problem, naming its seq; "" when ok
    problems: tuple[str, ...] = ()  # every problem found, in seq order
    since: int | None = None  # checked the entries after this seq only; None: the whole chain
    why_full: str = ""  # why the whole chain was checked (--full, no mark, ...); "" when from a mark
    reached: Point | None = None  # where it got to, when ok: what the next verify starts from
    behind: str = ""  # the ledger no longer extends where an earlier verify got to (a cut or rewritten tail)

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise LedgerIntegrityError(f"ledger verification failed: {self.problem}")


class _Fault:
    """A stored value that cannot be what its column holds; equal to nothing, so it never matches an entry."""

    def __init__(self, problem: str):
        self.problem = problem

    def __repr__(self) -> str:
        return f"<{self.problem}>"


def _why(e: BaseException) -> str:
    """One line for a database error: the driver's message, not SQLAlchemy's statement dump."""
    lines = str(getattr(e, "orig", None) or e).splitlines()
    return lines[0] if lines else type(e).__name__


def _sqlite(conn: Connection) -> bool:
    return conn.dialect.name == "sqlite"


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _select(conn: Connection, table: str, where: str = "") -> list[dict[str, Any]]:
    """Every row of ``table`` as stored (those ``where`` holds, SQL made here of names and integers), with
    ``__rowid`` on SQLite. There, text is fetched as bytes and decoded here, so one value that is not UTF-8 is a
    ``_Fault`` in its row instead of an error for the whole table."""
    where = f" WHERE {where}" if where else ""
    if not _sqlite(conn):
        return [dict(r) for r in conn.execute(text(f"SELECT * FROM {_quote(table)}{where}")).mappings()]
    columns = [str(r[1]) for r in conn.exec_driver_sql(f"PRAGMA table_info({_quote(table)})").fetchall()]
    if not columns:
        raise LookupError(f"no table {table}")
    parts = ["rowid"]
    for c in columns:
        q = _quote(c)
        parts += [f"typeof({q})", f"CASE typeof({q}) WHEN 'text' THEN CAST({q} AS BLOB) ELSE {q} END"]
    out = []
    for raw in conn.exec_driver_sql(f"SELECT {', '.join(parts)} FROM {_quote(table)}{where}").fetchall():
        row: dict[str, Any] = {"__rowid": raw[0]}
        for n, c in enumerate(columns):
            kind, value = raw[1 + 2 * n], raw[2 + 2 * n]
            if kind == "text":
                try:
                    value = bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    value = _Fault("is not UTF-8 text")
            elif kind == "blob":
                value = _Fault("holds bytes (a blob), not text or a number")
            row[c] = value
        out.append(row)
    return out


def _faults(model: Any, row: dict[str, Any]) -> list[str]:
    """What is wrong with the stored values of one row, field by field, against its table's model."""
    out = []
    for name, value in row.items():
        if name == "__rowid":
            continue
        if isinstance(value, _Fault):
            out.append(f"field {name!r} {value.problem}")
            continue
        col = model.__table__.c.get(name)
        if col is None or value is None:
            if col is not None and not col.nullable and not col.primary_key:
                out.append(f"field {name!r} is NULL")
            continue
        if isinstance(col.type, Boolean):
            ok = isinstance(value, bool) or (type(value) is int and value in (0, 1))
            want = "0 or 1"
        elif isinstance(col.type, Integer):
            ok, want = type(value) is int, "an integer"
        else:
            ok, want = isinstance(value, str), "text"
        if not ok:
            out.append(f"field {name!r} is {type(value).__name__} {value!r:.40}, not {want}")
    return out


def _mismatch(kind: str, row: dict[str, Any], payload: Any) -> str | None:
    """The first field in which a stored row differs from its entry's payload, else None."""
    if not isinstance(payload, dict):
        return "payload"
    row = {k: v for k, v in row.items() if k != "__rowid"}
    for name in sorted(set(row) | set(payload)):
        if name not in row:
            return name
        # A column missing from the payload was added by a later migration: it must still be NULL.
        try:
            want = encode(kind, {name: payload[name]})[name] if name in payload else None
        except (TypeError, ValueError):
            return name
        have = int(row[name]) if isinstance(row[name], bool) else row[name]
        if type(have) is not type(want) or have != want:
            return name
    return None


# --- what the chain does not hash: layout, triggers, migrations ---------------------------------


@lru_cache(maxsize=None)
def reference(version: int | None = None) -> dict[str, Any]:
    """The SQLite layout the migrations make, up to ``version`` (default: all): table -> column names,
    index names per table, and trigger name -> (table, sql). Built once, on a blank in-memory database."""
    from gatekeeper.ledger.database import make_engine, read
    from gatekeeper.ledger.migrations import migrate

    engine = make_engine("sqlite://")
    try:
        migrate(engine, target=version)
        with read(engine) as conn:
            return layout(conn)
    finally:
        engine.dispose()


def layout(conn: Connection) -> dict[str, Any]:
    """A SQLite database's tables (column names; and, under ``declared``, each column's declared type, NOT NULL and
    key), indexes and triggers, as ``reference`` gives them."""
    tables: dict[str, tuple[str, ...]] = {}
    declared: dict[str, tuple[str, ...]] = {}
    indexes: dict[str, tuple[str, ...]] = {}
    triggers: dict[str, tuple[str, str]] = {}
    sql_master = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
    master: Sequence[Any] = conn.exec_driver_sql(sql_master).fetchall()  # rows of four values
    for kind, name, table, sql in master:
        if str(name).startswith("sqlite_"):
            continue
        if kind == "table":
            info = conn.exec_driver_sql(f"PRAGMA table_info({_quote(name)})").fetchall()
            tables[name] = tuple(str(r[1]) for r in info)
            # a declared type edited in the schema changes how SQLite stores values (TEXT -> TEXR: numeric affinity)
            declared[name] = tuple(f"{r[1]} {r[2]}{' NOT NULL' if r[3] else ''}{' KEY' if r[5] else ''}" for r in info)
        elif kind == "trigger":
            triggers[name] = (table, sql)
    for kind, name, table, _sql in master:
        if kind == "index" and not str(name).startswith("sqlite_"):
            indexes[table] = (*indexes.get(table, ()), name)
    return {"tables": tables, "declared": declared, "indexes": indexes, "triggers": triggers}


def tables(conn: Connection) -> dict[str, tuple[str, ...]]:
    """The database's tables (in the current schema on PostgreSQL), each with its column names in order, as
    ``reference()["tables"]`` gives them."""
    return layout(conn)["tables"] if _sqlite(conn) else _pg_tables(conn)


def _pg_tables(conn: Connection) -> dict[str, tuple[str, ...]]:
    """A PostgreSQL database's tables in the current schema, each with its column names in order."""
    tables: dict[str, tuple[str, ...]] = {}
    rows: Iterable[Any] = conn.execute(text(
        "SELECT c.relname, a.attname FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid "
        "WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) "
        "AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped ORDER BY c.relname, a.attnum"))
    for table, column in rows:
        tables[table] = (*tables.get(table, ()), column)
    return tables


def _pg_schema_problems(conn: Connection) -> list[str]:
    """PostgreSQL: the append-only function unaltered; on ``entry`` and every record table its three triggers,
    present, enabled and unaltered, and no other; and every table with the columns the migrations gave it."""
    from gatekeeper.ledger.migrations import PG_APPEND_ONLY_BODY, PG_APPEND_ONLY_EVENTS, PG_APPEND_ONLY_FUNCTION, pg_trigger_sql

    schema = conn.scalar(text("SELECT quote_ident(current_schema())"))
    out = []
    function = conn.execute(text(
        "SELECT p.oid, p.prosrc, l.lanname, p.prorettype = 'trigger'::regtype, p.pronargs, p.prosecdef, p.proconfig "
        "FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
        "WHERE p.proname = :name AND p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())"),
        {"name": PG_APPEND_ONLY_FUNCTION}).all()
    ours = None
    if not function:
        out.append(f"function {PG_APPEND_ONLY_FUNCTION}: missing; no table is append-only (it was dropped)")
    elif len(function) > 1 or tuple(function[0][1:]) != (PG_APPEND_ONLY_BODY, "plpgsql", True, 0, False, None):
        out.append(f"function {PG_APPEND_ONLY_FUNCTION}: altered; it is not the append-only function the migrations created")
    else:
        ours = function[0][0]
    want = {f"{table}_no_{op.lower()}": (table, pg_trigger_sql(table, op, each, on=f"{schema}.{table}"))
            for table in ("entry", *KINDS) for op, each in PG_APPEND_ONLY_EVENTS}
    # name -> (table, tgenabled, the function's oid, the definition as PostgreSQL gives it back)
    have = {r[0]: tuple(r[1:]) for r in conn.execute(text(
        "SELECT t.tgname, c.relname, t.tgenabled, t.tgfoid, pg_get_triggerdef(t.oid) "
        "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
        "WHERE NOT t.tgisinternal "
        "AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())"))}
    for name, (table, sql) in sorted(want.items()):
        if name not in have:
            out.append(f"trigger {name}: missing; {table} is no longer append-only (it was dropped)")
            continue
        on, enabled, calls, definition = have[name]
        if (on, definition) != (table, sql) or (ours is not None and calls != ours):
            out.append(f"trigger {name}: altered; it is not the append-only trigger on {table} the migrations created")
        elif enabled not in ("O", "A"):  # D: disabled; R: fires only in a replication session
            how = "disabled" if enabled == "D" else "enabled for replication sessions only"
            out.append(f"trigger {name}: {how}; {table} is no longer append-only (ALTER TABLE ... DISABLE TRIGGER)")
    for name, (table, *_) in sorted(have.items()):
        if name not in want:
            out.append(f"trigger {name} (on {table}): not one gatekeeper creates; someone added it")
    return out + _table_problems(reference(), {"tables": _pg_tables(conn)}, indexes=False)


def _table_problems(want: dict[str, Any], have: dict[str, Any], indexes: bool = True) -> list[str]:
    """Every table of ``want`` (a ``layout``) in ``have`` with the same columns, and (if ``indexes``) indexes."""
    out = []
    for table, columns in sorted(want["tables"].items()):
        got = have["tables"].get(table)
        if got is None:
            out.append(f"table {table}: missing")
        elif got != columns:
            out.append(f"table {table}: columns are {', '.join(got)}; the schema has {', '.join(columns)}")
        elif "declared" in have and have["declared"][table] != want["declared"][table]:
            edited = [f"{g} (the schema has {w})" for g, w in zip(have["declared"][table], want["declared"][table]) if g != w]
            out.append(f"table {table}: column declarations edited: {', '.join(edited)}")
        elif indexes and have["indexes"].get(table, ()) != want["indexes"].get(table, ()):
            out.append(f"table {table}: indexes are {', '.join(have['indexes'].get(table, ())) or 'none'}; "
                       f"the schema has {', '.join(want['indexes'].get(table, ())) or 'none'}")
    for table in sorted(set(have["tables"]) - set(want["tables"])):
        out.append(f"table {table}: not one gatekeeper creates")
    return out


def _schema_problems(conn: Connection) -> list[str]:
    """The triggers present and unaltered, and every table with the columns and indexes the migrations gave it
    (on PostgreSQL: the columns, and the triggers enabled and their function unaltered too)."""
    if conn.dialect.name == "postgresql":
        return _pg_schema_problems(conn)
    if not _sqlite(conn):
        return []
    want, have = reference(), layout(conn)
    out = []
    for name, (table, sql) in sorted(want["triggers"].items()):
        got = have["triggers"].get(name)
        if got is None:
            out.append(f"trigger {name}: missing; {table} is no longer append-only (it was dropped)")
        elif got != (table, sql):
            out.append(f"trigger {name}: altered; it is not the append-only trigger on {table} the migrations created")
    for name, (table, _) in sorted(have["triggers"].items()):
        if name not in want["triggers"]:
            out.append(f"trigger {name} (on {table}): not one gatekeeper creates; someone added it")
    return out + _table_problems(want, have)


def _timestamp(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")) if isinstance(value, str) else None
    except ValueError:
        return None


def migration_problems(conn: Connection, upto: int | None = None) -> list[str]:
    """The ``migrations`` table against the migrations this gatekeeper has, through ``upto`` (default: all):
    each version once, under its own name, with a timestamp no earlier than the one before it."""
    from gatekeeper.ledger.migrations import MIGRATIONS

    try:
        rows = _select(conn, "migrations")
    except (LookupError, SQLAlchemyError) as e:
        return [f"migrations: the table cannot be read ({_why(e)})"]
    out: list[str] = []
    by_version: dict[int, dict[str, Any]] = {}
    for r in rows:
        faults = _faults(Migration, r)
        v = r.get("version")
        if faults or type(v) is not int:
            out += [f"migrations: row {v!r}: {f}" for f in faults] or [f"migrations: row {v!r}: field 'version' is not an integer"]
            continue
        by_version[v] = r
    known = {v: name for v, name, _ in MIGRATIONS if upto is None or v <= upto}
    names: dict[str | None, int] = {name: v for v, name, _ in MIGRATIONS}  # looked up by a stored name, maybe missing
    previous: datetime | None = None
    for v, name in sorted(known.items()):
        if v not in by_version:
            out.append(f"migrations: version {v} ({name}) is not recorded, yet the schema is past it (its row was deleted or changed)")
            continue
        r = by_version[v]
        if r.get("name") != name:
            out.append(f"migrations: version {v} is recorded as {r.get('name')!r}, not {name!r}")
        at = _timestamp(r.get("applied_at"))
        if at is None:
            out.append(f"migrations: version {v}: field 'applied_at' {r.get('applied_at')!r} is not a timestamp")
        elif previous is not None and at.tzinfo is not None and previous.tzinfo is not None and at < previous:
            out.append(f"migrations: version {v} was applied at {r.get('applied_at')}, before the version before it")
        previous = at or previous
    for v, r in sorted(by_version.items()):
        if v not in known:
            theirs = names.get(r.get("name"))
            also = f" (that is migration {theirs}'s name)" if theirs is not None and theirs != v else ""
            out.append(f"migrations: version {v} ({r.get('name')!r}){also} is not a migration of this schema")
    return out


def preflight(conn: Connection) -> list[str]:
    """Before opening (which migrates): problems in the ``migrations`` table that would make opening act on a
    damaged ledger, judged against the layout the database has. [] when it is blank, a version this gatekeeper
    can upgrade, or newer than it knows (opening says so)."""
    from gatekeeper.ledger.migrations import CURRENT_VERSION, MIGRATIONS

    if conn.dialect.name not in ("sqlite", "postgresql"):
        return []
    have = tables(conn)
    if not have:
        return []  # blank: opening lays out a new ledger
    if "migrations" not in have:
        return ["migrations: the table is missing, yet the database has the ledger's tables"]
    try:
        recorded = {r.get("version"): r.get("name") for r in _select(conn, "migrations")}
    except (LookupError, SQLAlchemyError) as e:
        return [f"migrations: the table cannot be read ({_why(e)})"]
    if all(recorded.get(v) == name for v, name, _ in MIGRATIONS) and any(
            type(v) is int and v > CURRENT_VERSION for v in recorded):
        return []  # a newer gatekeeper's ledger: opening refuses it, naming its version
    at = next((v for v in (*(v for v, _, _ in reversed(MIGRATIONS)), 0) if reference(v)["tables"] == have), None)
    if at is None:
        return [*migration_problems(conn), "schema: the tables match no schema version this gatekeeper knows"]
    return migration_problems(conn, upto=at)


def verify(conn: Connection, since: Point | None = None, behind: str = "") -> VerifyReport:
    """The whole chain, every row, the schema, the migrations and SQLite's ``integrity_check``. With ``since`` (the
    point an earlier verify reached, ``mark``): only the entries and rows after it, linked to its entry, with the
    schema and migrations; an old row edited since is found by the whole check only. ``behind``: the problem that
    the ledger no longer extends a mark, named last (a checkpoint that shows the same says more)."""
    found: list[tuple[float, str]] = []  # (seq, text); rows without an entry, then the schema, sort last
    after = {k: n for k, n in since.rows.items() if k in BULKY} if since is not None else {}
    rows: dict[str, dict[Any, dict[str, Any]]] = {}
    faults: dict[tuple[str, Any], list[str]] = {}
    for kind, model in KINDS.items():
        rows[kind] = {}
        try:
            stored = _select(conn, kind, f"id > {int(after[kind])}" if kind in after else "")
        except (LookupError, SQLAlchemyError) as err:
            found.append((math.inf, f"table {kind}: cannot be read ({_why(err)})"))
            continue
        for r in stored:
            key = r.get("id") if type(r.get("id")) is int else r.get("__rowid")
            rows[kind][key] = r
            if problems := _faults(model, r):
                faults[(kind, key)] = problems

    pinned: list[dict[str, Any]] = []  # from a mark: the entries before it of the kinds rechecked whole
    try:
        stored_entries = _select(conn, "entry", f"seq > {int(since.seq)}" if since is not None else "")
        if since is not None:
            kinds = ", ".join(f"'{k}'" for k in KINDS if k not in BULKY)
            pinned = _select(conn, "entry", f"kind IN ({kinds}) AND seq <= {int(since.seq)}")
    except (LookupError, SQLAlchemyError) as err:
        found.append((0, f"table entry: cannot be read ({_why(err)})"))
        stored_entries = []
    entries = []
    for e in stored_entries:
        if type(e.get("seq")) is not int:
            found.append((math.inf, f"entry at rowid {e.get('__rowid')}: field 'seq' is {e.get('seq')!r}, not an integer"))
        else:
            entries.append(e)
    entries.sort(key=lambda e: e["seq"])
    pinned = [e for e in pinned if type(e.get("seq")) is int]  # the seq itself was checked by the verify that made the mark
    found += _links(conn, pinned)

    seen: set[tuple[str, Any]] = set()
    expected, count = (since.seq + 1, since.entries) if since is not None else (1, 0)
    count += len(stored_entries)
    prev: object = since.hash if since is not None else GENESIS  # the hash the entry before holds, as stored
    for e in (*sorted(pinned, key=lambda e: e["seq"]), *entries):
        seq = e["seq"]

        def bad(msg: str, seq=seq) -> None:  # bound now: called in this iteration
            found.append((seq, f"seq {seq}: {msg}"))

        if since is not None and seq <= since.seq:
            pass  # an old entry rechecked for its row: its place in the chain is _links'
        elif seq > expected:
            gap = f"{expected}" if seq - 1 == expected else f"{expected}..{seq - 1}"
            bad(f"seq {gap} missing before it")
        elif seq < expected:
            bad("seq out of order")
        if since is None or seq > since.seq:
            expected = seq + 1
            if e.get("prev_hash") != prev:
                bad("prev_hash does not link to the entry before it")
            prev = e.get("hash")
        if problems := _faults(Entry, e):
            for p in problems:
                bad(f"entry {p}")
            continue
        try:
            payload = json.loads(e["payload"])
            canonical = canonical_json(payload).decode()
        except (TypeError, ValueError, RecursionError):
            bad("payload is not valid JSON")
            continue
        if canonical != e["payload"]:
            bad("payload is not canonical JSON")
        elif entry_hash(seq, e["prev_hash"], e["kind"], e["record_id"], payload) != e["hash"]:
            bad("hash does not match the entry's contents")

        kind, record_id = e["kind"], e["record_id"]
        if kind not in KINDS:
            bad(f"unknown kind {kind!r}")
            continue
        if (kind, record_id) in seen or record_id <= after.get(kind, 0):
            bad(f"a second entry for {kind} {record_id}")
            continue
        seen.add((kind, record_id))
        row = rows[kind].get(record_id)
        if row is None:
            bad(f"{kind} {record_id} is missing (its entry has no row)")
        elif (kind, record_id) in faults:
            for p in faults[(kind, record_id)]:
                bad(f"{kind} {record_id}: {p}")
        elif (field := _mismatch(kind, row, payload)) is not None:
            bad(f"{kind} {record_id} does not match its entry (field {field!r})")

    for kind, by_id in rows.items():
        for record_id in by_id:
            if (kind, record_id) not in seen:
                more = "".join(f"; {p}" for p in faults.get((kind, record_id), []))
                found.append((math.inf, f"{kind} {record_id} has no entry in the chain{more}"))

    whole = (_integrity,) if since is None else ()  # integrity_check reads every page of the file
    for check in (_schema_problems, migration_problems, *whole):
        found += [(math.inf, problem) for problem in _checked(check, conn)]
    found += [(math.inf, behind)] if behind else []

    at = since.seq if since is not None else None
    if not found:
        last = entries[-1] if entries else None
        reached = since if last is None else Point(
            seq=last["seq"], hash=last["hash"], entries=count,
            first=since.first if since is not None else entries[0]["hash"],
            rows={kind: max([after.get(kind, 0), *by_id]) for kind, by_id in rows.items()})
        return VerifyReport(ok=True, entries=count, first_bad_seq=None, problem="", since=at, reached=reached)
    found.sort(key=lambda p: p[0])  # stable: within one seq, checks keep their order
    first_seq, first_problem = found[0]
    return VerifyReport(
        ok=False,
        entries=count,
        first_bad_seq=None if first_seq == math.inf else int(first_seq),
        problem=first_problem,
        problems=tuple(p for _, p in found),
        since=at,
        behind=behind,
    )


def _links(conn: Connection, old: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """The entry after each of ``old`` still links to it: an old entry rewritten and re-hashed alone breaks that link
    (one rewritten with everything after it moves the mark's entry: ``mark.start`` says so)."""
    out: list[tuple[float, str]] = []
    for n in range(0, len(old), 500):
        chunk = {e["seq"] + 1: e for e in old[n:n + 500]}
        sql = f"SELECT seq, prev_hash FROM entry WHERE seq IN ({', '.join(map(str, chunk))})"
        after: dict[Any, Any] = {r[0]: r[1] for r in conn.execute(text(sql))}
        for seq, e in chunk.items():
            if seq in after and after[seq] != e.get("hash"):
                out.append((seq, f"seq {seq}: prev_hash does not link to the entry before it"))
    return out


def _checked(check: Any, conn: Connection) -> list[str]:
    try:
        return check(conn)
    except (LookupError, SQLAlchemyError) as e:
        return [f"schema: cannot be read ({_why(e)})"]


def _integrity(conn: Connection) -> list[str]:
    """SQLite's own check of the file: pages, b-trees, every index against its table."""
    if not _sqlite(conn):
        return []
    lines = [str(r[0]) for r in conn.exec_driver_sql("PRAGMA integrity_check(20)").fetchall()]
    return [] if lines == ["ok"] else [f"database file: {line}" for line in lines]
