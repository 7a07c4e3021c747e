"""Snapshot placement on a hybrid model, side by side in one run (prints figures; no pass/fail).

  scenario   the interleave scenario (A ~4,500 tokens, C sharing A's first 56%, B ~100 unrelated;
             sequences A->C and A->B->C) on a tiny random hybrid model (Gated DeltaNet + attention,
             built locally), real forward passes, every output checked against the cache-off run;
             then the same in the simulator, which must give the same counts.
  synthetic  an interleaved single-slot trace of --requests requests (several conversations over a
             few stage prompts plus unrelated one-off requests) in the simulator, with snapshot
             bytes modelled from the tiny model's measured state sizes.
Per policy: tokens re-done (reusable but recomputed), the share of the reusable bound realized,
restores, forced full re-prefills, snapshots and bytes held. ``+erase`` reproduces the single-slot
server rule (a request erases every snapshot above its re-entry point). ``--peers`` then runs the
scenario as chat requests on llama-server and mlx-lm's server with the same weights
(``bench/hybrid_peers.py``), beside gatekeeper.

    python bench/hybrid_replay.py [--requests 1000] [--scale 1.0] [--chunk 256] [--prefill aligned] [--peers]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from gatekeeper.setup.tiny_hybrid import build  # noqa: E402
from gatekeeper.traffic.captures import replay  # noqa: E402
from gatekeeper.workspace import EngineProfile  # noqa: E402

POLICIES = list(replay.DEFAULT_POLICIES)


def table(title: str, report: dict, trace_names: list[str]) -> None:
    print(f"\n{title}")
    head = f"{'policy':22} {'trace':10} {'bound':>9} {'reused':>9} {'re-done':>9} {'realized':>9} {'restores':>8} {'forced':>7} {'snaps':>6} {'MiB held':>9} {'identical':>9}"
    print(head)
    print("-" * len(head))
    for p in report["policies"]:
        for name in trace_names:
            t = p["traces"][name]
            share = "-" if t["realized_share"] is None else f"{t['realized_share']:.1%}"
            same = "-" if t["identical"] is None else ("yes" if t["identical"] else f"NO {t['differing']}")
            print(f"{p['policy']:22} {name:10} {t['bound']:>9} {t['reused']:>9} {t['redone']:>9} {share:>9} "
                  f"{t['restores']:>8} {t['forced_full']:>7} {t['snapshots_held']:>6} {t['snapshot_bytes'] / 2**20:>9.2f} {same:>9}")


def state_bytes(model: Path, base: EngineProfile) -> tuple[int, int]:
    """(fixed, per token) bytes of the tiny model's state, fitted on two lengths."""
    loaded = replay.maker(base, None, simulate=False)("boundaries")
    sizes = []
    for n in (64, 1088):
        state = loaded._new_state()
        loaded._forward(state, [40] * n)
        sizes.append(loaded.state_ops.nbytes(state))
    per = (sizes[1] - sizes[0]) // 1024
    loaded.close()
    return sizes[0] - 64 * per, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--scale", type=float, default=1.0, help="scenario prompt lengths times this")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prefill", default="aligned", choices=["aligned", "monolithic"])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--peers", action="store_true", help="also llama-server and mlx_lm.server (bench/hybrid_peers.py)")
    ap.add_argument("--peer-requests", type=int, default=300, help="synthetic requests replayed on llama-server")
    args = ap.parse_args()

    model = build(Path(tempfile.mkdtemp(prefix="tiny-hybrid-")))
    base = EngineProfile(adapter="torch", model=str(model), dtype="float32", device="cpu",
                         prefill=args.prefill, chunk=args.chunk)
    print(f"tiny random hybrid model (3 Gated DeltaNet + 1 attention layer) in {model}; "
          f"plan {args.prefill}, chunk {args.chunk}; cache {base.cache.max_entries} entries")

    scenario = replay.interleave(args.scale)
    start = time.perf_counter()
    real = replay.replay(scenario, POLICIES, replay.maker(base, None, simulate=False), parity=True,
                         max_tokens=args.max_tokens)
    real_s = time.perf_counter() - start
    table(f"interleave scenario, real forward passes ({real_s:.0f} s, cache-off runs included)", real, list(scenario))
    fixed, per = state_bytes(model, base)
    sim = replay.replay(scenario, POLICIES, replay.maker(base, None, simulate=True, state_bytes=(fixed, per)), parity=False)
    agree = all(r["traces"][n][k] == s["traces"][n][k] for r, s in zip(real["policies"], sim["policies"])
                for n in scenario for k in ("reused", "restores", "forced_full", "snapshots_held"))
    print(f"simulator gives the same counts on the scenario: {'yes' if agree else 'NO'}")

    trace = replay.synthetic(args.requests)
    # The profile's plan and cache; the monolithic plan, where snapshots sit on batch edges as in a
    # server rather than on the aligned plan's stage-boundary cuts; and a cache of ten entries.
    other = "monolithic" if args.prefill == "aligned" else "aligned"
    for label, update in ((f"{args.prefill}, {base.cache.max_entries} entries", {}),
                          (f"{other}, {base.cache.max_entries} entries", {"prefill": other}),
                          (f"{args.prefill}, 10 entries", {"cache": {"max_entries": 10, "max_bytes": base.cache.max_bytes}})):
        profile = EngineProfile(**{**base.model_dump(exclude={"name"}), **update})
        start = time.perf_counter()
        big = replay.replay(trace, POLICIES, replay.maker(profile, None, simulate=True, state_bytes=(fixed, per)), parity=False)
        t = big["traces"]["synthetic"]
        table(f"synthetic interleaved trace ({label}): {t['requests']} requests, {t['prompt_tokens']:,} prompt tokens, "
              f"bound {t['bound']:,} (simulator, {time.perf_counter() - start:.1f} s; state {fixed} B + {per} B/token)",
              big, ["synthetic"])
    if args.peers:
        from hybrid_peers import run as peers

        peers(args.scale, model, args.chunk, args.peer_requests)


if __name__ == "__main__":
    main()
