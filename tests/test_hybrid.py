"""Hybrid models: snapshot placement, the erase rule, and restores on a tiny random Gated DeltaNet
model (real forward passes on CPU) that must give the bits of a full recompute."""

from __future__ import annotations

import copy
import random

import pytest
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.cache import Hit, PrefixCache
from gatekeeper.cache.snapshots import Policy, SnapshotStore, layout, parse
from gatekeeper.engines.greedy import GreedySession
from gatekeeper.engines.registry import build_engine
from gatekeeper.engines.sim import Count, CountOps
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.traffic.captures import replay
from gatekeeper.workspace import EngineProfile


def profile(model, **over) -> EngineProfile:
    fields = {"adapter": "torch", "model": str(model), "dtype": "float32", "device": "cpu",
              "prefill": "aligned", "chunk": 32, "snapshots": "boundaries"}
    return EngineProfile(**{**fields, **over})


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 256) for _ in range(n)]


# --- placement and the store (no model) -----------------------------------------------------------


def test_parse_accepts_the_three_policies_and_the_erase_suffix():
    assert parse("tail") == Policy("tail")
    assert parse("interval:512+erase") == Policy("interval", 512, True)
    assert parse("boundaries+erase").spec == "boundaries+erase"
    for bad in ("interval:0", "interval:x", "tail:3", "boundaries+keep", "every", ""):
        with pytest.raises(ValueError, match="'tail', 'boundaries' or 'interval:N'"):
            parse(bad)


def test_layout_places_snapshots_from_the_prompt_alone():
    n = 1000
    # monolithic: no cold cuts; tail keeps the last steps before the end, plus the end itself
    tail = layout(parse("tail"), range(n), [], chunk=256, aligned_cuts=None)
    assert tail.cuts is None and sorted(tail.snaps) == [256, 512, 768, 1000]
    assert tail.passes(cache=False) == [] and tail.passes(cache=True) == [256, 512, 768, 1000]
    every = layout(parse("interval:300"), range(n), [], chunk=256, aligned_cuts=None)
    assert sorted(every.snaps) == [300, 600, 900, 1000]
    bounds = layout(parse("boundaries"), range(n), [400], chunk=256, aligned_cuts=None)
    assert bounds.snaps == {400: True, 1000: False}  # the stage boundary is pinned, the end is not
    # aligned: interval positions join the cold plan (cache off too); the end is the last cut
    aligned = layout(parse("interval:300"), range(n), [], chunk=256, aligned_cuts=[256, 512, 768])
    assert aligned.cuts == [256, 300, 512, 600, 768, 900] and aligned.snaps == {300: False, 600: False, 900: False}
    assert aligned.edges(600) == (256, 300, 512, 600)


def _store(policy: str, max_entries: int = 8) -> SnapshotStore:
    return SnapshotStore(PrefixCache(CountOps(10, 1), max_entries=max_entries, max_bytes=10**9), parse(policy))


def test_erase_rule_drops_every_unpinned_snapshot_above_the_reentry_point():
    store = _store("boundaries+erase")
    a = list(range(100))
    store.take(a[:40], Count(40), pinned=True, edges=None)
    store.take(a[:80], Count(80), pinned=False, edges=None)
    store.take(a, Count(100), pinned=False, edges=None)
    hit = store.restore(a[:90] + [7, 7], limit=91, at=None)  # re-enters at 80: the 100 goes
    assert isinstance(hit, Hit) and hit.length == 80
    assert sorted(e.length for e in store.cache.entries) == [40, 80]
    assert store.restore([5, 5, 5], limit=2, at=None) is None  # unrelated: re-enters at 0
    assert [e.length for e in store.cache.entries] == [40]  # the pinned boundary survives
    assert store.stats.erased == 2 and store.stats.restored == 1 and store.stats.bytes_restored == 90
    # without the rule nothing is erased
    keep = _store("boundaries")
    keep.take(a, Count(100), pinned=False, edges=None)
    assert keep.restore([5, 5, 5], limit=2, at=None) is None and len(keep.cache) == 1


def test_snapshots_are_evicted_lru_but_pinned_ones_stay():
    store = _store("tail", max_entries=2)
    a = list(range(50))
    store.take(a[:10], Count(10), pinned=True, edges=None)
    for n in (20, 30, 40):
        store.take(a[:n], Count(n), pinned=False, edges=None)
    assert sorted(e.length for e in store.cache.entries) == [10, 40]


# --- a real hybrid model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_model(tiny_hybrid):
    model = build_engine(profile(tiny_hybrid))
    yield model
    model.close()


def test_the_tiny_model_is_hybrid_and_its_snapshots_count_recurrent_state(hybrid_model):
    model = hybrid_model
    assert model.hybrid and model.identity()["snapshots"] == "boundaries"
    state = model._new_state()
    model._forward(state, [40, 41, 42])
    kv_only = sum(t.untyped_storage().nbytes() for layer in state.layers
                  for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
    assert model.state_ops.nbytes(state) > kv_only > 0


@pytest.mark.slow
def test_restore_then_continue_is_bit_identical_to_a_full_recompute(hybrid_model):
    off, on = hybrid_model.session(cache=False), hybrid_model.session(cache=True)
    rng = random.Random(1)
    stage = ids(rng, 150)
    for e in (off, on):
        e.pin(stage)
    assert len(on.prefix_cache) == 0  # hybrid pins are lazy: nothing is prefilled outside a request
    prompts = [stage + ids(rng, 60), stage + ids(rng, 45), stage + ids(rng, 70)]
    prompts.append(prompts[0] + ids(rng, 40))  # a later turn extends the first prompt
    for i, p in enumerate(prompts):
        cold = off.generate(p, max_tokens=6, top2=True)
        warm = on.generate(p, max_tokens=6, top2=True)
        assert warm.tokens == cold.tokens and warm.top2 == cold.top2  # logits bit for bit, not just argmax
        # the stage boundary (pinned), then for the later turn the first prompt's end: under the
        # aligned plan its last cut, 150 + 32 (chunk steps after the boundary)
        assert warm.cached_tokens == [0, 150, 150, 182][i]
    stats = on.snapshots.stats
    assert stats.restored == 3 and stats.taken == 5 and stats.bytes_taken > 0 and stats.take_s > 0
    assert on.snapshot_stats() == stats.to_dict() and off.snapshot_stats()["taken"] == 0
    pinned = [e.length for e in on.prefix_cache.entries if e.pinned]
    assert pinned == [150]
    assert len(off.prefix_cache) == 0
    off.close()
    on.close()


class Stale(SnapshotStore):
    """A planted fault: each snapshot's recurrent layers hold the state of the previous snapshot's
    position (the first one's: position 0), while its attention KV is right, so lengths check out."""

    prev = None

    def take(self, tokens, state, *, pinned, edges):
        now = [copy.deepcopy(layer.recurrent_states) for layer in state.layers if hasattr(layer, "recurrent_states")]
        if self.prev is None:
            self.prev = [{i: t.clone().zero_() for i, t in rec.items()} for rec in now]
        entry = super().take(tokens, state, pinned=pinned, edges=edges)
        if entry is not None:
            layers = [layer for layer in entry.state.layers if hasattr(layer, "recurrent_states")]
            for layer, rec in zip(layers, self.prev):
                layer.recurrent_states = copy.deepcopy(rec)
        self.prev = now
        return entry


class StaleSession(GreedySession):
    """Sessions with the cache on keep their snapshots in a ``Stale`` store."""

    def __init__(self, model, *, cache=False, results=None):
        super().__init__(model, cache=cache, results=results)
        if cache:
            self.snapshots = Stale(self.prefix_cache, self.snapshots.policy)


class StaleEngine(TorchEngine):
    session_class = StaleSession


@pytest.mark.slow
def test_a_snapshot_recorded_at_the_wrong_position_is_caught_by_the_parity_comparison(tiny_hybrid):
    rng = random.Random(2)
    stage = tuple(ids(rng, 96))
    trace = {"t": [replay.Item("s", f"r{i}", stage + tuple(ids(rng, 40)), len(stage)) for i in range(3)]}

    def make(spec):
        p = profile(tiny_hybrid, snapshots=spec)
        return StaleEngine(p) if faulty else build_engine(p)

    faulty = False
    good = replay.replay(trace, ["boundaries"], make, parity=True, max_tokens=6)["policies"][0]["traces"]["t"]
    assert good["identical"] and good["restores"] == 2
    faulty = True
    bad = replay.replay(trace, ["boundaries"], make, parity=True, max_tokens=6)["policies"][0]["traces"]["t"]
    assert bad["restores"] == 2 and bad["identical"] is False and bad["differing"] == [1, 2]


@pytest.mark.slow
def test_mlx_restores_hybrid_snapshots_with_the_bits_of_a_full_recompute(tiny_hybrid):
    """mlx-lm's caches for the same weights: ``ArraysCache`` recurrent layers, snapshots copied whole."""
    model = build_engine(profile(tiny_hybrid, adapter="mlx", chunk=16))
    assert model.hybrid
    off, on = model.session(cache=False), model.session(cache=True)
    rng = random.Random(4)
    stage = ids(rng, 48)
    for e in (off, on):
        e.pin(stage)
    for i in range(3):
        p = stage + ids(rng, 12)
        cold, warm = off.generate(p, max_tokens=4, top2=True), on.generate(p, max_tokens=4, top2=True)
        assert warm.tokens == cold.tokens and warm.top2 == cold.top2
        assert warm.cached_tokens == (48 if i else 0)
    with build_engine(profile(tiny_hybrid, chunk=16)) as torch_model, torch_model.session(cache=False) as torch_off:
        torch_off.pin(stage)
        assert torch_off.generate(p, max_tokens=4).tokens == cold.tokens  # one set of weights, two runtimes
