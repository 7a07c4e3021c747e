"""What the ledger's trust costs: appends per second and `ledger verify` seconds per 10,000 entries on
SQLite and on PostgreSQL, and the cost of signing and verifying one approval, measured in one run.

Each backend gets a fresh ledger (a SQLite file in a temporary folder; a PostgreSQL server started
from the system's binaries, as the tests do, but with fsync on, as deployed) and N appends of case
results to one evaluation, one transaction each, as `evaluate` writes them; then `verify` rereads
and rehashes the whole chain. Signing is gatekeeper's own SSHSIG over a flip record, per key type,
on keys made by the real ssh-keygen; verifying includes the allowed_signers lookup.

At scale (``--entries N``, e.g. 1000000): per backend, a ledger of N entries that a guarded flag's shadow batches
fill (``bench/ledger_bulk.py``: the flag turned on by the real appends, the batches bulk-written as the real append
writes them), verified once with ``--full`` (timed: the whole chain), then 1,000 batches appended the real way and
verified from the mark (timed: O(new entries)), the whole of ``ledger verify`` from the mark (signatures and
checkpoints too), ``gatekeeper review`` from its launch until its first page, and each page after, and the guard's
start (``Guarded``, as ``proxy --guard`` makes it), printed side by side.

    python bench/ledger.py [--entries 2000] [--appends 2000] [--signatures 200]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Iterator

import ledger_bulk

ROOT = Path(__file__).resolve().parent.parent
PER = 10_000
KEY_TYPES = (("ed25519", []), ("ecdsa", []), ("rsa", ["-b", "3072"]))
RESULT = {"tokens": list(range(48)), "text": "x" * 200, "prompt_tokens": 900, "cached_tokens": 836,
          "prefill_s": 0.01, "decode_s": 0.2, "assertions": [{"type": "contains", "pass": True}] * 4}


sys.path.insert(0, str(ROOT / "bench"))  # ledger_bulk, beside this file


@contextmanager
def ledger_urls(folder: Path) -> Iterator[dict[str, str]]:
    """One fresh ledger URL per backend; the PostgreSQL server lives as long as the caller holds them."""
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres import start_server  # the tests' own server set-up

    server = start_server(durable=True)
    try:
        server.connect().execute("CREATE DATABASE bench")
        yield {"sqlite": f"sqlite:///{folder / 'bench.db'}", "postgresql": server.url("bench")}
    finally:
        server.stop()


def backend(url: str, entries: int) -> tuple[float, float]:
    """Appends per second, and verify seconds per PER entries, on a fresh ledger at ``url``."""
    from gatekeeper.ledger import open_ledger

    ledger = open_ledger(url, create=True)
    try:
        evaluation = ledger.start_evaluation("prefix_cache", "bench", "byte_equivalence", {"engine": "bench"}, {})
        start = perf_counter()
        for i in range(entries):
            ledger.add_case_result(evaluation, f"case-{i}", "on" if i % 2 else "off", 0, RESULT)
        append_s = perf_counter() - start
        start = perf_counter()
        report = ledger.verify()
        verify_s = perf_counter() - start
        if not report.ok or report.entries != entries + 1:
            sys.exit(f"{url}: verify said {report.problem or report.entries}")
    finally:
        ledger.close()
    return entries / append_s, verify_s * PER / report.entries


NEW = 1000  # appended after the full verify, then verified from the mark
PAGES = ("/flags", "/live", "/integrity", "/evaluations", "/evaluations/1", "/integrity.json", "/live.json")


def timed(f, *args, **kwargs):
    start = perf_counter()
    out = f(*args, **kwargs)
    return perf_counter() - start, out


def scale(folder: Path, urls: dict[str, str], entries: int) -> dict[str, dict[str, float]]:
    """Per backend: full verify, verify from the mark after NEW appends, `ledger verify` whole from the mark, the
    review app's start and slowest page, the guard's start, on a ledger of ``entries`` entries."""
    from gatekeeper import signing
    from gatekeeper.gate.enable import attestation
    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.audit import audit_ledger
    from gatekeeper.workspace import Workspace

    key_path = folder / "guard_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "guard", "-f", str(key_path)], check=True)
    key_pub = " ".join(key_path.with_name("guard_key.pub").read_text().split()[:2])
    out: dict[str, dict[str, float]] = {}
    db = None
    for name, url in urls.items():
        root = folder / f"ws-{name}"
        ledger_bulk.workspace(root, key_pub)
        start = perf_counter()
        if db is None:  # SQLite first: built here, then copied to PostgreSQL as it is
            ledger_bulk.flag_on(url)
            ledger_bulk.add_batches(url, 1)
            ledger_bulk.bulk(Path(url[len("sqlite:///"):]), entries - NEW - 5)
            db = shutil.copy(url[len("sqlite:///"):], folder / "built.db")  # before this backend's appends
        else:
            ledger_bulk.to_postgres(db, url)
        ledger_bulk.checkpoint(root, url)
        row = {"build": perf_counter() - start}
        with Ledger(url) as ledger:
            row["full"], report = timed(ledger.verify, root, full=True)
            if not report.ok or report.entries != entries - NEW:
                sys.exit(f"{name}: the full verify said {report.problem or report.entries}")
        ledger_bulk.add_batches(url, NEW)
        with Ledger(url) as ledger:
            row["incremental"], report = timed(ledger.verify, root)
            if not report.ok or report.since != entries - NEW or report.entries != entries:
                sys.exit(f"{name}: the verify from the mark said {report.problem or report.since}")
        ledger_bulk.add_batches(url, NEW)
        ws = Workspace(root)
        row["command"], audit = timed(audit_ledger, url, ws, [], lambda lg, ws=ws: attestation.audit_signatures(ws, lg))
        if not audit.ok:
            sys.exit(f"{name}: ledger verify said {audit.problems[0]}")
        row["review_start"], row["review_page"] = review(root, url)
        row["guard_start"] = guard_start(ws, url, signing.load_key(key_path))
        out[name] = row
    return out


def review(root: Path, url: str) -> tuple[float, float]:
    """``gatekeeper review``: seconds from its launch until its first page answers, and its slowest page after."""
    import http.client
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    start = perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(root), "--ledger", url, "review",
                             "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                conn.request("GET", "/")
                response = conn.getresponse()
                response.read()
                break
            except OSError:
                if proc.poll() is not None:
                    sys.exit(f"gatekeeper review exited: {proc.stderr.read().decode()[-800:] if proc.stderr else ''}")
                time.sleep(0.05)
        started = perf_counter() - start
        slowest = 0.0
        for page in PAGES:
            t0 = perf_counter()
            conn.request("GET", page)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                sys.exit(f"review {page}: {response.status}")
            slowest = max(slowest, perf_counter() - t0)
        return started, slowest
    finally:
        proc.terminate()
        proc.wait()


def guard_start(ws, url: str, key) -> float:
    """Seconds to make the guard, as ``proxy --guard`` does at its start: verify, then read the flip's watch."""
    from gatekeeper.traffic.live.guarded import Guarded

    start = perf_counter()
    guard = Guarded(ws, url, ledger_bulk.FLAG, "http://127.0.0.1:9", key)
    took = perf_counter() - start
    guard.writer.shutdown()
    guard.stamp.close()
    return took


def signatures(folder: Path, count: int) -> list[tuple[str, float, float]]:
    """Per key type: milliseconds to sign one flip record, and to verify it against allowed_signers."""
    from gatekeeper import signing
    from gatekeeper.gate.enable import attestation

    at = signing.parse_time("2026-12-01T00:00:00Z")
    record = attestation.flip_record("prefix_cache", "on", 1, "sha256:" + "0" * 64, "ana", "bench", attestation.iso(at))
    message = attestation.record_message(record)
    out = []
    for kind, extra in KEY_TYPES:
        path = folder / kind
        subprocess.run(["ssh-keygen", "-q", "-t", kind, *extra, "-N", "", "-C", "ana", "-f", str(path)], check=True)
        key_type, b64 = path.with_name(kind + ".pub").read_text().split()[:2]
        allowed = folder / f"allowed_{kind}"
        allowed.write_text(f"ana {key_type} {b64}\n")
        signers = signing.AllowedSigners.load(allowed)
        key = signing.load_key(path)
        start = perf_counter()
        for _ in range(count):
            armored = key.sign(message)
        sign_ms = (perf_counter() - start) * 1000 / count
        start = perf_counter()
        for _ in range(count):
            sig = signing.verify(armored, message)
            if signers.principal(sig.blob, at) != "ana":
                sys.exit(f"{kind}: allowed_signers does not name the signer")
        verify_ms = (perf_counter() - start) * 1000 / count
        out.append((kind, sign_ms, verify_ms))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=2000, help="appends per backend (verify is scaled to 10,000); "
                    "above --appends, also a ledger of this many entries per backend, timed at that scale")
    ap.add_argument("--appends", type=int, default=2000, help="real appends timed per backend, at most --entries")
    ap.add_argument("--signatures", type=int, default=200, help="signatures per key type")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with ledger_urls(folder) as urls:
            appends = min(args.entries, args.appends)
            rows = {name: backend(url, appends) for name, url in urls.items()}
        at_scale = {}
        if args.entries > appends:
            with ledger_urls(folder / "scale") as urls:
                at_scale = scale(folder, urls, args.entries)
        signed = signatures(folder, args.signatures)
    print(f"ledger, {appends} appends per backend (fsync on)")
    print(f"{'backend':<12}{'appends/s':>12}{'verify s / 10k':>16}")
    for name, (rate, verify) in rows.items():
        print(f"{name:<12}{rate:>12.0f}{verify:>16.2f}")
    print(f"sqlite/postgresql: appends {rows['sqlite'][0] / rows['postgresql'][0]:.2f}x, "
          f"verify {rows['sqlite'][1] / rows['postgresql'][1]:.2f}x the time")
    print(f"\n{'key':<12}{'sign ms':>12}{'verify ms':>16}   (one approval's flip record)")
    for kind, sign_ms, verify_ms in signed:
        print(f"{kind:<12}{sign_ms:>12.3f}{verify_ms:>16.3f}")
    if at_scale:
        print(f"\nat {args.entries:,} entries (a guarded flag's shadow batches), seconds")
        names = {"build": "build (bulk)", "full": "verify --full", "incremental": f"verify from mark, +{NEW:,} new",
                 "command": f"ledger verify (all checks), +{NEW:,}", "review_start": "review: launch to first page",
                 "review_page": "review: slowest page after", "guard_start": "guard start (proxy --guard)"}
        print(f"{'':<36}" + "".join(f"{b:>12}" for b in at_scale))
        for key, label in names.items():
            print(f"{label:<36}" + "".join(f"{r[key]:>12.2f}" for r in at_scale.values()))


if __name__ == "__main__":
    main()
