"""Every statistical test a verdict uses, simulated on the project's own functions: its size at the null (how often it
says yes when it must not) and its power at two effects, each with its Monte Carlo error, beside what the docs claim.

    python bench/verdict_statistics.py [--runs N] [--seed S] [--json]

(Not bench/statistics.py: run as a script, that name would shadow the standard library's statistics module.)

Each row draws ``--runs`` seeded replicates (fewer for the costly watches, as the row says). A size is within its
claim when it is at most alpha plus two Monte Carlo standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from gatekeeper.gate.stats import coupling, evalues, paired, pit, sequential  # noqa: E402

ALPHA = 0.05


@dataclass
class Row:
    test: str  # the test and the function that computes it
    null: str  # the null it is simulated at
    size: float  # how often it rejected the null (a false PASS, a false rollback)
    size_se: float
    effects: list[tuple[str, float, float]]  # (effect, power, its Monte Carlo error)
    runs: int
    claim: str  # what docs say

    @property
    def holds(self) -> bool:
        return self.size <= ALPHA + 2 * self.size_se


def rate(hits: int, runs: int) -> tuple[float, float]:
    p = hits / runs
    return p, math.sqrt(max(p * (1 - p), 1 / runs) / runs)


def trials(runs: int, seed: int, one: Callable) -> tuple[float, float]:
    """The share of ``runs`` seeded replicates for which ``one(rng)`` is true, with its standard error."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rate(sum(bool(one(rng)) for _ in range(runs)), runs)


def ever(hits, every: int, holds: Callable[[int, int], bool]) -> bool:
    """Whether ``holds(k, n)`` at some look, every ``every`` trials of ``hits`` (k of the first n true)."""
    counts = hits.cumsum()
    return any(holds(int(counts[n - 1]), n) for n in range(every, len(hits) + 1, every))


# --- the rows ---------------------------------------------------------------------------------------------------


def paired_bound(runs: int, seed: int) -> Row:
    """Non-inferiority on a fixed battery: 200 cases of 4 assertions, a case's assertions flipping together."""
    margin, cases, k, discord = 0.05, 200, 4, 0.12

    def passes(loss: float):
        def one(rng) -> bool:
            pairs = []
            for i in range(cases):  # a discordant case flips all its assertions one way: harmful w.p. (d + loss)/2d
                u = rng.random()
                if u < discord:
                    harm = rng.random() < (discord + loss) / (2 * discord)
                    pairs += [(f"c{i}", harm, not harm)] * k
                else:
                    pairs += [(f"c{i}", True, True)] * k
            return paired.decide(pairs, margin, ALPHA).verdict == "pass"
        return one

    size, se = trials(runs, seed, passes(margin))
    return Row("paired loss bound (paired.decide: Tango, worst-case design effect)", f"true loss = margin {margin}",
               size, se, [(f"loss {x}", *trials(runs, seed + 1, passes(x))) for x in (0.0, -0.02)], runs,
               "false PASS at most alpha (docs/verdicts.md)")


def looked_again(runs: int, seed: int) -> Row:
    """The same bound looked at twice (100 cases, then 100 more) at the full alpha both times: the defect the
    history of a change's looks answers (docs/verdicts.md, "Looks")."""
    margin, k, discord = 0.05, 4, 0.12

    def passes(loss: float):
        def one(rng) -> bool:
            pairs = []
            for look in range(2):
                for i in range(100):
                    if rng.random() < discord:
                        harm = rng.random() < (discord + loss) / (2 * discord)
                        pairs += [(f"c{look}-{i}", harm, not harm)] * k
                    else:
                        pairs += [(f"c{look}-{i}", True, True)] * k
                if paired.decide(pairs, margin, ALPHA).verdict == "pass":
                    return True
            return False
        return one

    size, se = trials(runs, seed, passes(margin))
    return Row("paired bound looked at twice at full alpha (no spending)", f"true loss = margin {margin}", size, se,
               [(f"loss {x}", *trials(runs, seed + 1, passes(x))) for x in (0.0,)], runs,
               "exceeds alpha: why looks are spent")


def sequential_bound(runs: int, seed: int) -> Row:
    """The betting confidence sequence, looked at after every case up to 400 cases."""
    margin, discord = 0.1, 0.3

    def passes(loss: float):
        def one(rng) -> bool:
            rule = sequential.Sequential("non_inferiority", margin, ALPHA)
            for _ in range(400):
                d = 0.0
                if rng.random() < discord:
                    d = 1.0 if rng.random() < (discord + loss) / (2 * discord) else -1.0
                decision = rule.update(d)
                if decision != "continue":
                    return decision == "pass"
            return False
        return one

    n = max(runs // 4, 50)
    size, se = trials(n, seed, passes(margin))
    return Row("sequential loss bound (sequential.Sequential, betting)", f"true loss = margin {margin}, a look a case",
               size, se, [(f"loss {x}", *trials(n, seed + 1, passes(x))) for x in (0.0, 0.05)], n,
               "false PASS at most alpha at any stop (docs/verdicts.md)")


def coupled_bound(runs: int, seed: int) -> Row:
    """The coupled steps' Clopper-Pearson bound on a mismatch rate: 500 steps."""
    limit, steps = 0.02, 500

    def within(p: float):
        return lambda rng: coupling.upper(int(rng.binomial(steps, p)), steps, ALPHA) <= limit

    size, se = trials(runs, seed, within(limit))
    return Row("coupled TV bound (coupling.upper, Clopper-Pearson)", f"mismatch rate = max_tv {limit}, {steps} steps",
               size, se, [(f"rate {x}", *trials(runs, seed + 1, within(x))) for x in (0.005, 0.01)], runs,
               "bound below the rate with chance at most alpha (docs/sampling.md)")


def anytime_bound(runs: int, seed: int) -> Row:
    """The anytime bound on a rate (coupling.upper_anytime), looked at every 10 steps up to 2,000."""
    limit = 0.02

    def ever_within(p: float):
        return lambda rng: ever(rng.random(2000) < p, 10, lambda k, n: coupling.upper_anytime(k, n, ALPHA) <= limit)

    n = max(runs // 4, 50)
    size, se = trials(n, seed, ever_within(limit))
    return Row("anytime rate bound (coupling.upper_anytime)", f"rate = {limit}, a look every 10 of 2,000", size, se,
               [(f"rate {x}", *trials(n, seed + 1, ever_within(x))) for x in (0.005, 0.01)], n,
               "below the rate at some look with chance at most alpha")


def guard_one_sample(runs: int, seed: int) -> Row:
    """The guard's mixture test against a limit, a look every 16 comparisons for 3,000."""
    limit, watch = 0.02, 3000

    def rolls_back(p: float):
        return lambda rng: ever(rng.random(watch) < p, 16, lambda k, n: evalues.log_evalue(k, n, limit) >= math.log(1 / ALPHA))

    n = max(runs // 4, 50)
    size, se = trials(n, seed, rolls_back(limit))
    return Row("guard rule, one sample (evalues.log_evalue)", f"mismatch rate = limit {limit}, {watch} compared",
               size, se, [(f"rate {x}", *trials(n, seed + 1, rolls_back(x))) for x in (0.03, 0.04)], n,
               "false rollback at most alpha over the watch (docs/guard.md)")


def guard_baseline(runs: int, seed: int) -> Row:
    """The guard's A/A baseline test: both sides part by batch noise at 3%, a look every 16 requests for 3,000."""
    base, watch = 0.03, 3000

    def rolls_back(extra: float):
        def one(rng) -> bool:
            ab = rng.random(watch) < base + extra
            aa = rng.random(watch) < base
            for n in range(16, watch + 1, 16):
                b, c = int((ab[:n] & ~aa[:n]).sum()), int((aa[:n] & ~ab[:n]).sum())
                if evalues.log_evalue_paired(b, c, n, 0.0) >= math.log(1 / ALPHA):
                    return True
            return False
        return one

    n = max(runs // 4, 50)
    size, se = trials(n, seed, rolls_back(0.0))
    return Row("guard rule, A/A baseline (evalues.log_evalue_paired)", f"both sides part at {base}, {watch} requests",
               size, se, [(f"flag adds {x}", *trials(n, seed + 1, rolls_back(x))) for x in (0.01, 0.02)], n,
               "false rollback at most alpha (docs/guard.md)")


def pit_uniform(runs: int, seed: int) -> Row:
    """The draws-against-the-declared-decoding check: KS on 300 randomized PIT values."""
    def rejects(power: float):  # u ** power: 1 is the declared decoding, above 1 a sampler that runs flatter
        return lambda rng: pit.ks_uniform(list(rng.random(300) ** power))[1] < ALPHA

    size, se = trials(runs, seed, rejects(1.0))
    return Row("draws against the declared decoding (pit.ks_uniform)", "draws follow the declared decoding, 300 steps",
               size, se, [(f"u^{x}", *trials(runs, seed + 1, rejects(x))) for x in (1.2, 1.5)], runs,
               "rejects at most alpha (docs/sampling.md)")


def pit_serial(runs: int, seed: int) -> Row:
    """The independence check beside it: the lag-1 serial test on 30 turns of 10 PIT values each."""
    def rejects(reuse: float):  # a step that reuses the step before's randomness with chance ``reuse``
        def one(rng) -> bool:
            u = rng.random((30, 10))
            for t in range(1, 10):
                again = rng.random(30) < reuse
                u[again, t] = u[again, t - 1]
            return pit.serial([list(row) for row in u])[2] < ALPHA
        return one

    size, se = trials(runs, seed, rejects(0.0))
    return Row("consecutive draws independent (pit.serial)", "independent uniform steps, 30 turns of 10",
               size, se, [(f"reused {x:.0%}", *trials(runs, seed + 1, rejects(x))) for x in (0.1, 0.3)], runs,
               "rejects at most alpha (docs/sampling.md)")


ROWS = (paired_bound, looked_again, sequential_bound, coupled_bound, anytime_bound, guard_one_sample, guard_baseline,
        pit_uniform, pit_serial)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=400, help="replicates per row (a quarter for the watches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [make(args.runs, args.seed + 10 * i) for i, make in enumerate(ROWS)]
    if args.json:
        print(json.dumps([{**asdict(r), "holds": r.holds} for r in rows], indent=2))
        return
    print(f"alpha {ALPHA}; size: how often the test said yes at its null (+- one Monte Carlo standard error)\n")
    print("| test | null | size | power | runs | docs claim |\n|---|---|---|---|---|---|")
    for r in rows:
        power = "; ".join(f"{e}: {p:.3f} +- {s:.3f}" for e, p, s in r.effects)
        mark = "" if r.holds else " (above alpha)"
        print(f"| {r.test} | {r.null} | {r.size:.3f} +- {r.size_se:.3f}{mark} | {power} | {r.runs} | {r.claim} |")


if __name__ == "__main__":
    main()
