"""The runtime environments and tiny real-bug models the suite needs, made once under $GATEKEEPER_HOME by `make
runtimes` before the tests run (each shown with its time), so no test spends its minutes in pip. A test that finds
one missing still makes it, by the same calls.

    python tests/runtimes.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# test_runtime_releases.py: the oldest admitted transformers, and the one that keeps a recurrent state as one tensor
RELEASES = {"oldest": "5.0.0", "single": "5.10.4"}
# test_real_bugs.py: the entries of bench/real_bugs/ it evaluates (each at its last affected and first fixed release)
REAL_BUGS = ("transformers-37574", "transformers-48280", "transformers-37574-base")


def release(version: str) -> str:
    """The python of transformers ``version``'s environment, made once."""
    from gatekeeper.setup.runtimes import prepare

    return prepare(f"transformers-{version}", [f"transformers=={version}"])["python"]


def main() -> None:
    import real_bugs

    def timed(what: str, make, *args) -> None:
        t0 = time.perf_counter()
        make(*args)
        print(f"runtimes: {what} ready in {time.perf_counter() - t0:.1f} s", flush=True)

    for version in RELEASES.values():
        timed(f"transformers {version}", release, version)
    for entry in real_bugs.entries(list(REAL_BUGS)):
        for side in ("affected", "fixed"):
            timed(f"{entry['id']} {side} ({entry['runtime']} {entry[side]['release']})", real_bugs.environment, entry, side)
        timed(f"{entry['id']} model", real_bugs.model, entry)


if __name__ == "__main__":
    main()
