"""What the ledger's trust costs: appends per second and `ledger verify` seconds per 10,000 entries on
SQLite and on PostgreSQL, and the cost of signing and verifying one approval, measured in one run.

Each backend gets a fresh ledger (a SQLite file in a temporary folder; a PostgreSQL server started
from the system's binaries, as the tests do, but with fsync on, as deployed) and N appends of case
results to one evaluation, one transaction each, as `evaluate` writes them; then `verify` rereads
and rehashes the whole chain. Signing is gatekeeper's own SSHSIG over a flip record, per key type,
on keys made by the real ssh-keygen; verifying includes the allowed_signers lookup.

    python bench/ledger.py [--entries 2000] [--signatures 200]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
PER = 10_000
KEY_TYPES = (("ed25519", []), ("ecdsa", []), ("rsa", ["-b", "3072"]))
RESULT = {"tokens": list(range(48)), "text": "x" * 200, "prompt_tokens": 900, "cached_tokens": 836,
          "prefill_s": 0.01, "decode_s": 0.2, "assertions": [{"type": "contains", "pass": True}] * 4}


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
    ap.add_argument("--entries", type=int, default=2000, help="appends per backend (verify is scaled to 10,000)")
    ap.add_argument("--signatures", type=int, default=200, help="signatures per key type")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with ledger_urls(folder) as urls:
            rows = {name: backend(url, args.entries) for name, url in urls.items()}
        signed = signatures(folder, args.signatures)
    print(f"ledger, {args.entries} appends per backend (fsync on)")
    print(f"{'backend':<12}{'appends/s':>12}{'verify s / 10k':>16}")
    for name, (rate, verify) in rows.items():
        print(f"{name:<12}{rate:>12.0f}{verify:>16.2f}")
    print(f"sqlite/postgresql: appends {rows['sqlite'][0] / rows['postgresql'][0]:.2f}x, "
          f"verify {rows['sqlite'][1] / rows['postgresql'][1]:.2f}x the time")
    print(f"\n{'key':<12}{'sign ms':>12}{'verify ms':>16}   (one approval's flip record)")
    for kind, sign_ms, verify_ms in signed:
        print(f"{kind:<12}{sign_ms:>12.3f}{verify_ms:>16.3f}")


if __name__ == "__main__":
    main()
