"""The aligned prefill plan: cuts fixed by the prompt and its registered boundaries, cache on or off,
and hits that land only where the cold run's passes agree, so cache-on logits equal cache-off
logits bit for bit: on a stand-in model whose logits depend on every pass (deterministic anywhere)
and in bfloat16 on a tiny random llama (both adapters).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tiny_models import tiny_llama  # noqa: F401  (fixture)

from gatekeeper.cache import PrefixCache
from gatekeeper.engines.greedy import GreedyEngine, GreedySession
from gatekeeper.engines.prefill import segments, splits
from gatekeeper.engines.registry import build_engine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.workspace import EngineProfile

SYSTEM = (
    "You are a careful assistant. Answer the question using the notes below, and say when the notes do not "
    "cover it. The router reads the request, picks a tool, and passes the arguments on. Tools: search, "
    "calendar, calculator, mail. Flights from Lisbon to Porto leave every hour between six in the morning "
    "and ten at night. The cheapest fare this week is 39 euros."
)
# Questions share a stem past the system turn, so the cache holds more than the pinned boundary and
# a hit could land between cuts if the cache let it.
QUESTIONS = [
    "Please book the cheapest option, then send a confirmation mail to the traveller.",
    "Please book the cheapest option, then send a confirmation mail to the office.",
    "Please book the cheapest flight from Lisbon to Porto.",
    "What is 2+2? The answer is 4. What is 7*6?",
    "Write a short summary of the meeting notes.",
]
CHUNK = 16  # small, so a tiny prompt crosses several cuts
STEPS = 10


def profile(model_dir, adapter, prefill="aligned", **over) -> EngineProfile:
    fields = {"adapter": adapter, "model": str(model_dir), "dtype": "bfloat16", "device": "cpu",
              "prefill": prefill, "chunk": CHUNK}
    return EngineProfile(**{**fields, **over})


def chat(model, question: str, history=()) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
    return model.tokenize(model.render(msgs))


def system_turn(model) -> list[int]:
    """The tokens every prompt shares: the stage boundary a pipeline would pin."""
    a, b = chat(model, "x"), chat(model, "y")
    n = 0
    while a[n] == b[n]:
        n += 1
    return a[:n]


def run_pair(off, on, prompts: list[list[int]]) -> list[tuple]:
    """Generate every prompt cache-off and cache-on; (prompt, off, on) per prompt."""
    return [(p, off.generate(p, max_tokens=STEPS, top2=True), on.generate(p, max_tokens=STEPS, top2=True)) for p in prompts]


def run_chains(off, on, turns: int = 3) -> list[tuple]:
    """Each question as a stream of ``turns`` turns, each extending the last at the token level
    (prompt + the reply's tokens + a new user turn), so a chained hit could reuse decoded positions."""
    out = []
    model = off.model
    follow_up = model.tokenize("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    for q in QUESTIONS:
        p = chat(model, q)
        for _ in range(turns):
            (p, a, b), = run_pair(off, on, [p])
            out.append((p, a, b))
            p = p + b.tokens + follow_up
    return out


# --- the plan itself ---------------------------------------------------------------------------


def test_splits_cut_at_boundaries_and_step_after_them():
    tokens = list(range(100))
    assert splits(tokens, [], 32) == [32, 64, 96]  # no boundary: steps from 0
    assert splits(tokens, [tuple(range(40))], 32) == [40, 72]  # one pass up to the boundary
    assert splits(tokens, [tuple(range(40)), tuple(range(50))], 32) == [40, 50, 82]
    assert splits(tokens, [tuple(range(10)), tuple(range(80))], 32) == [10, 42, 74, 80]
    assert splits(tokens, [(1, 2, 3)], 32) == [32, 64, 96]  # not a prefix of the prompt: no cut
    assert splits(tokens, [tuple(tokens)], 32) == []  # a boundary itself: planned as a prompt extending it
    assert splits(tokens[:10], [], 32) == []
    assert segments([40, 72], 0, 100) == [(0, 40), (40, 72), (72, 100)]
    assert segments([40, 72], 40, 100) == [(40, 72), (72, 100)]
    assert segments([], 7, 9) == [(7, 9)]


# --- the cache serves hits only where the passes agree -------------------------------------------


class ListOps:
    def length(self, s):
        return len(s)

    def nbytes(self, s):
        return 8 * len(s)

    def trimmable(self, s):
        return True

    def fork(self, s, n):
        return list(s[:n])


def test_lookup_lands_on_the_last_cut_where_the_passes_agree():
    c = PrefixCache(ListOps(), max_entries=8, max_bytes=1 << 20)
    c.store(list(range(50)), list(range(50)), edges=[16, 32, 40, 50])
    query = list(range(45)) + [99, 99]
    assert c.lookup(query).length == 45  # monolithic: the whole shared prefix
    hit = c.lookup(query, at=[16, 32, 40, 46])
    assert hit.length == 40 and hit.state == list(range(40))
    assert c.lookup(query, at=[16, 30, 40, 46]).length == 16  # passes part after 16
    assert c.lookup(query, at=[20, 40]) is None  # the entry's first pass is not the query's
    assert c.lookup(list(range(50)), limit=31, at=[16, 32]).length == 16
    with pytest.raises(ValueError):
        c.store([1, 2], [1, 2], edges=[1])  # edges end where the state does


def test_entries_with_other_passes_neither_supersede_nor_serve():
    c = PrefixCache(ListOps(), max_entries=8, max_bytes=1 << 20)
    c.store(list(range(20)), list(range(20)), edges=[10, 20])
    c.store(list(range(30)), list(range(30)), edges=[20, 30])  # same tokens, other passes
    assert len(c) == 2  # the longer one does not cover the shorter one's hits
    assert c.lookup(list(range(25)), at=[10, 20]).length == 20
    assert c.lookup(list(range(35)), at=[20, 30]).length == 30
    c.store(list(range(40)), list(range(40)), edges=[20, 30, 40])
    assert [e.length for e in c.entries] == [20, 40]  # this one does supersede the 30-token entry
    assert c.drop_covering(list(range(20))) == 2 and len(c) == 0  # a new boundary at 20


# --- a model whose logits depend on how the prefill was cut -----------------------------------------


class PassOps(ListOps):
    """States are lists of (token, start, end): the pass that computed each position."""


class PassTokenizer:
    eos_ids = frozenset()

    def detokenize(self, tokens):
        return " ".join(map(str, tokens))


class PassEngine(GreedyEngine):
    """The real greedy loop, plan and cache over a stand-in model whose logits hash every
    position's token and the pass that computed it: the worst case of shape-sensitive kernels,
    deterministic on any machine. Equal logits mean every position was computed in the same pass."""

    name = "passes"
    vocab = 5

    def _load(self):
        self.tok, self.state_ops = PassTokenizer(), PassOps()
        self.dtype_name, self.device_name = "bfloat16", "cpu"

    def _new_state(self):
        return []

    def _forward(self, state, tokens):
        start = len(state)
        state += [(t, start, start + len(tokens)) for t in tokens]
        return np.random.default_rng(hash(tuple(state)) % 2**32).standard_normal(self.vocab).astype(np.float32)

    def _libraries(self):
        return {}


@pytest.fixture
def pass_engines(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    def make(prefill, chunk, engine=PassEngine):
        """A cache-off and a cache-on session of one stand-in model."""
        prof = EngineProfile(adapter="passes", model=str(tmp_path), prefill=prefill, chunk=chunk)
        model = engine(prof)
        return model.session(cache=False), model.session(cache=True)

    return make


def random_workload(off, on, seed: int) -> list[tuple]:
    """Streams over a 3-token alphabet that share prefixes, boundaries registered along the way
    (in both sessions), chained turns extending a reply; (prompt, off, on) per call."""
    rng = random.Random(seed)
    base = [rng.randrange(3) for _ in range(60)]
    out = []
    for _ in range(40):
        if rng.random() < 0.15:
            boundary = base[: rng.randint(4, 40)]
            off.pin(boundary)
            on.pin(boundary)
        if out and rng.random() < 0.4:  # the next turn of the last stream
            p = out[-1][0] + out[-1][2].tokens + [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        else:
            p = base[: rng.randint(0, 50)] + [rng.randrange(3) for _ in range(rng.randint(1, 15))]
        a = off.generate(p, max_tokens=rng.randint(1, 5), top2=True)
        b = on.generate(p, max_tokens=len(a.tokens), top2=True)
        out.append((p, a, b))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_aligned_hits_reuse_only_positions_computed_in_the_cold_runs_passes(pass_engines, seed):
    off, on = pass_engines("aligned", chunk=random.Random(seed).randint(2, 9))
    results = random_workload(off, on, seed)
    assert sum(b.cached_tokens for _, _, b in results) > 0  # the cache served ...
    for p, a, b in results:  # ... and never changed a pass
        assert b.top2 == a.top2, (seed, p, b.cached_tokens)


def test_monolithic_hits_change_the_passes(pass_engines):
    off, on = pass_engines("monolithic", chunk=4)
    results = random_workload(off, on, 0)
    hits = [(a, b) for _, a, b in results if b.cached_tokens]
    assert hits and all(a.top2 != b.top2 for a, b in hits)


class Misaligned(PrefixCache):
    """The planted fault: ignores the query's cuts and serves the whole common prefix."""

    def lookup(self, tokens, *, limit=None, at=None):
        return super().lookup(tokens, limit=limit)


def test_a_cache_that_ignores_the_cuts_is_caught(pass_engines):
    off, bad = pass_engines("aligned", chunk=4)
    bad.prefix_cache = Misaligned(bad.ops, max_entries=64, max_bytes=1 << 30)
    results = random_workload(off, bad, 1)
    assert any(b.cached_tokens not in (bad._cuts(p) or []) for p, _, b in results)
    assert any(a.top2 != b.top2 for _, a, b in results)


# --- bit-exact reuse on a tiny model -----------------------------------------------------------


@pytest.fixture(scope="module", params=["torch", "mlx"])
def adapter(request):
    return request.param


def test_aligned_cache_on_logits_equal_cache_off_bit_for_bit(tiny_llama, adapter):
    model = build_engine(profile(tiny_llama, adapter))
    off, on = model.session(cache=False), model.session(cache=True)
    boundary = system_turn(model)
    off.pin(boundary)  # the cache-off session registers the cut and stores nothing
    on.pin(boundary)
    assert len(off.prefix_cache) == 0 and len(boundary) in off._cuts(chat(model, "x"))
    assert len(on.prefix_cache) == 1 and on.prefix_cache.get(boundary).pinned

    results = run_chains(off, on)
    results += run_pair(off, on, [chat(model, QUESTIONS[0])])  # a repeated prompt
    # a later turn as the gate renders it: the reply's text, re-tokenized with the new turn
    history = [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": results[6][2].text}]
    results += run_pair(off, on, [chat(model, "And the fastest train?", history)])

    for p, a, b in results:
        assert b.cached_tokens in on._cuts(p) and b.cached_tokens >= len(boundary)
        assert a.cached_tokens == 0
        # exact comparison: every step's top-2 ids and logits, no tolerance
        assert b.top2 == a.top2 and b.tokens == a.tokens
    # hits went past the boundary: the shared question stem, and each chained turn's previous turn
    assert results[3][2].cached_tokens > len(boundary)
    chained = [(results[i - 1][0], b) for i, (_, _, b) in enumerate(results[:15]) if i % 3]
    assert all(b.cached_tokens >= on._cuts(prev)[-1] for prev, b in chained)


def test_monolithic_plan_documents_its_difference(tiny_llama, adapter, record_property):
    """One pass cold, the common prefix on a hit: logits may differ in the last bits (torch's bf16
    CPU matmuls do; mlx's CPU backend has not so far). Recorded, never asserted equal."""
    model = build_engine(profile(tiny_llama, adapter, "monolithic"))
    off, on = model.session(cache=False), model.session(cache=True)
    on.pin(system_turn(model))
    results = run_pair(off, on, [chat(model, q) for q in QUESTIONS])
    assert all(b.cached_tokens >= len(system_turn(model)) for _, _, b in results)
    differ = sum(a.top2 != b.top2 for _, a, b in results)
    flipped = sum(a.tokens != b.tokens for _, a, b in results)
    record_property("monolithic_logits_differ", f"{differ}/{len(results)}")
    record_property("monolithic_tokens_differ", f"{flipped}/{len(results)}")
    print(f"{adapter} monolithic bf16: logits differ on {differ}/{len(results)} prompts, tokens on {flipped}")


# --- a planted fault: hits that land between cuts ----------------------------------------------


class WholeChainAlignedSession(GreedySession):
    """Prefills by the aligned plan but keeps each turn's state whole and serves the whole common
    prefix, as a monolithic cache does: a chained hit lands past the prompt's last cut, on positions
    decoded one at a time that the cold run prefills in a chunk."""

    def _begin(self, prompt):
        hit = self.prefix_cache.lookup(prompt, limit=len(prompt) - 1) if self.cache else None  # the plan's cuts ignored
        return (hit.state, hit.length) if hit else (self.model._new_state(), 0)

    def _store(self, prompt, tokens, state, kept):
        self.prefix_cache.store(prompt + tokens[:-1], state)


class WholeChainAligned(TorchEngine):
    session_class = WholeChainAlignedSession


def test_bit_exact_comparison_catches_a_hit_between_cuts(tiny_llama):
    honest = build_engine(profile(tiny_llama, "torch", chunk=64))
    planted = WholeChainAligned(profile(tiny_llama, "torch", chunk=64))
    off, bad = honest.session(cache=False), planted.session(cache=True)
    for s in (off, bad):
        s.pin(system_turn(honest))
    results = run_chains(off, bad)
    between = [(a, b) for p, a, b in results if b.cached_tokens not in bad._cuts(p)]
    assert between  # the fault was exercised ...
    assert any(a.top2 != b.top2 for a, b in between)  # ... and the exact comparison flags it


# --- identity ------------------------------------------------------------------------------------


def test_identity_records_the_plan(tiny_llama):
    with build_engine(profile(tiny_llama, "torch", chunk=64)) as m:
        aligned = m.identity()
    with build_engine(profile(tiny_llama, "torch", "monolithic")) as m:
        mono = m.identity()
    assert (aligned["prefill"], aligned["chunk"]) == ("aligned", 64)
    assert mono["prefill"] == "monolithic" and "chunk" not in mono
    assert EngineProfile(adapter="torch").prefill == "aligned"
