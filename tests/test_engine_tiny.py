"""Both built-in adapters on a tiny random llama: greedy loop, prefix cache, telemetry, parity."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_llama  # noqa: F401  (fixture)

from gatekeeper.cache import Hit, PrefixCache
from gatekeeper.engines.base import Engine
from gatekeeper.engines.registry import build_engine
from gatekeeper.workspace import EngineProfile

ADAPTERS = ["torch", "mlx"]

SYSTEM = (
    "You are a careful assistant. Answer the question using the notes below, and say when the notes "
    "do not cover it. The router reads the request, picks a tool, and passes the arguments on. "
    "Tools: search, calendar, calculator, mail."
)
QUESTIONS = [
    "What is 2+2?",
    "Book the cheapest flight from Lisbon to Porto.",
    "Write a short summary of the meeting notes.",
    "Return JSON with the keys name, date and total.",
]


def profile(model_dir, adapter, **over) -> EngineProfile:
    fields = {"adapter": adapter, "model": str(model_dir), "dtype": "float32", "device": "cpu", "prefill": "monolithic"}
    return EngineProfile(**{**fields, **over})


@pytest.fixture(scope="module", params=ADAPTERS)
def adapter(request):
    return request.param


@pytest.fixture(scope="module")
def model(tiny_llama, adapter):
    """One loaded model per adapter; every test opens its own sessions on it."""
    m = build_engine(profile(tiny_llama, adapter))
    yield m
    m.close()


@pytest.fixture
def off_on(model):
    """(cache-off session, cache-on session) of one model, both fresh: nothing cached, nothing pinned."""
    with model.session(cache=False) as off, model.session(cache=True) as on:
        yield off, on


def prompt(model: Engine, question: str, system: str = SYSTEM) -> list[int]:
    return model.tokenize(model.render([{"role": "system", "content": system}, {"role": "user", "content": question}]))


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- the greedy loop ---------------------------------------------------------------------------


def test_greedy_output_is_not_degenerate(model, off_on):
    off, _ = off_on
    g = off.generate(prompt(model, QUESTIONS[0]), max_tokens=16)
    assert len(g.tokens) == 16 and len(set(g.tokens)) >= 8
    assert g.text == model.detokenize(g.tokens) and g.cached_tokens == 0


def test_top2_records_each_step(model, off_on):
    off, _ = off_on
    g = off.generate(prompt(model, QUESTIONS[1]), max_tokens=8, top2=True)
    assert len(g.top2) == len(g.tokens)
    for tok, ((best, best_logit), (second, second_logit)) in zip(g.tokens, g.top2):
        assert best == tok and second != tok and best_logit >= second_logit


def test_eos_stops_and_is_kept_out_of_text(model, off_on):
    off, _ = off_on
    ids = prompt(model, QUESTIONS[2])
    full = off.generate(ids, max_tokens=16).tokens
    k = 5
    saved = model.tok.eos_ids
    try:
        model.tok.eos_ids = frozenset({full[k]})
        g = off.generate(ids, max_tokens=16)
    finally:
        model.tok.eos_ids = saved
    k = full.index(full[k])  # the first time that id comes out
    assert g.tokens == full[: k + 1]
    assert g.text == model.detokenize(full[:k])


def test_stop_string_cuts_text_and_keeps_completing_token(model, off_on):
    off, _ = off_on
    ids = prompt(model, QUESTIONS[3])
    full = off.generate(ids, max_tokens=24).tokens
    # A stop string made of one generated token's ASCII text, past the start.
    k, stop = next((i, model.detokenize([t])) for i, t in enumerate(full)
                   if i >= 3 and model.detokenize([t]).strip().isalpha())
    g = off.generate(ids, max_tokens=24, stop=[stop, "never-appears"])
    assert stop in model.detokenize(g.tokens) and stop not in model.detokenize(g.tokens[:-1])
    assert g.tokens == full[: len(g.tokens)] and len(g.tokens) <= k + 1
    assert g.text == model.detokenize(g.tokens)[: model.detokenize(g.tokens).find(stop)]


def test_telemetry_and_stats(model, off_on):
    _, on = off_on
    assert (on.stats.calls, on.stats.prompt_tokens, on.stats.cached_tokens) == (0, 0, 0)  # a fresh session
    gens = [on.generate(prompt(model, q), max_tokens=4) for q in QUESTIONS[:2]]
    for g in gens:
        assert g.prompt_tokens > 0 and g.prefill_s > 0 and g.decode_s >= 0
        assert g.prefill_s <= g.ttft_s <= g.prefill_s + g.decode_s
    assert on.stats.calls == 2
    assert on.stats.prompt_tokens == sum(g.prompt_tokens for g in gens)
    assert on.stats.cached_tokens == sum(g.cached_tokens for g in gens) > 0
    assert on.stats.prefill_s == pytest.approx(sum(g.prefill_s for g in gens))


# --- the prefix cache --------------------------------------------------------------------------


def test_cache_on_matches_cache_off_and_counts_shared_prefix(model, off_on):
    off, on = off_on
    stored: list[list[int]] = []
    for q in QUESTIONS:
        ids = prompt(model, q)
        g_off, g_on = off.generate(ids, max_tokens=12), on.generate(ids, max_tokens=12)
        assert g_on.tokens == g_off.tokens and g_on.text == g_off.text
        expected = min(max((lcp(s, ids) for s in stored), default=0), len(ids) - 1)
        assert g_on.cached_tokens == expected
        stored.append(ids + g_on.tokens[:-1])
    # every call after the first shared at least the system turn
    shared = lcp(prompt(model, QUESTIONS[0]), prompt(model, QUESTIONS[1]))
    assert shared > 40
    assert off.prefix_cache.entries == [] and off.stats.cached_tokens == 0


def test_repeat_prompt_recomputes_only_the_last_token(model, off_on):
    _, on = off_on
    ids = prompt(model, QUESTIONS[0])
    first = on.generate(ids, max_tokens=6)
    again = on.generate(ids, max_tokens=6)
    assert again.cached_tokens == len(ids) - 1 and again.tokens == first.tokens


def test_hit_leaves_the_stored_entry_unchanged(model, off_on):
    _, on = off_on
    ids = prompt(model, QUESTIONS[1])
    on.generate(ids, max_tokens=6)
    (entry,) = on.prefix_cache.entries
    before = arrays(entry.state)
    # diverge inside the entry, so the hit is a trimmed fork of it, then decode on the fork
    g = on.generate(ids[:-3] + [ids[-1], ids[-2]], max_tokens=6)
    assert 0 < g.cached_tokens < entry.length
    after = arrays(entry.state)
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))


def test_chaining_computes_only_new_tokens(model, off_on):
    off, on = off_on
    transcript = prompt(model, QUESTIONS[0])
    g = on.generate(transcript, max_tokens=8)
    for follow_up in ["And 3+3?", "Thanks, now in words please."]:
        seen = len(transcript) + len(g.tokens) - 1  # every position a forward pass computed
        transcript = transcript + g.tokens + model.tokenize(f"\n<|im_start|>user\n{follow_up}<|im_end|>\n<|im_start|>assistant\n")
        g = on.generate(transcript, max_tokens=8)
        assert g.cached_tokens == seen
        # computed: the appended turn, plus the previous reply's last token (never fed back)
        assert g.prompt_tokens - g.cached_tokens == len(transcript) - seen
        assert g.tokens == off.generate(transcript, max_tokens=8).tokens
    assert len(on.prefix_cache) == 1  # each turn's entry superseded the one before


def test_pinned_prefix_survives_eviction_pressure(tiny_llama, adapter):
    with build_engine(profile(tiny_llama, adapter, cache={"max_entries": 2, "max_bytes": 1 << 30})) as m:
        eng = m.session(cache=True)
        head = prompt(m, QUESTIONS[0])
        pinned = head[: lcp(head, prompt(m, QUESTIONS[1]))]
        eng.pin(pinned)
        assert eng.prefix_cache.get(pinned).pinned
        assert eng.pin_sources == {tuple(pinned): "computed"}
        for i in range(6):  # unrelated prompts that push the cache over its entry limit
            eng.generate(prompt(m, f"Question {i}?", system=f"Other system {i}."), max_tokens=3)
            assert len(eng.prefix_cache) <= 2
        assert eng.prefix_cache.get(pinned) is not None
        g = eng.generate(prompt(m, QUESTIONS[2]), max_tokens=3)
        assert g.cached_tokens == len(pinned)
        assert len(eng.prefix_cache) == 2  # the pin and the last call's entry
        # A fresh session of the same model starts empty: nothing cached, nothing pinned ...
        fresh = m.session(cache=True)
        assert len(fresh.prefix_cache) == 0 and fresh.pin_sources == {}
        assert fresh.generate(prompt(m, QUESTIONS[2]), max_tokens=3).cached_tokens == 0
        # ... and pinning there computes its own state, leaving the first session's untouched.
        fresh2 = m.session(cache=True)
        fresh2.pin(pinned)
        assert [e.tokens for e in fresh2.prefix_cache.entries] == [tuple(pinned)]
        assert eng.prefix_cache.get(pinned) is not None and len(eng.prefix_cache) == 2
        for s in (eng, fresh, fresh2):
            s.close()
        assert len(eng.prefix_cache) == 0  # close drops every state, the pin included


def test_eviction_by_bytes_stays_under_the_limit(tiny_llama, adapter):
    with build_engine(profile(tiny_llama, adapter)) as m, m.session(cache=True) as probe:
        probe.generate(prompt(m, "x", system="s"), max_tokens=2)
        one = probe.prefix_cache.entries[0].nbytes
    limit = int(2.5 * one)
    with build_engine(profile(tiny_llama, adapter, cache={"max_entries": 64, "max_bytes": limit})) as m, \
            m.session(cache=True) as eng:
        for i in range(6):
            eng.generate(prompt(m, f"{i}", system=f"{i}"), max_tokens=2)
            assert eng.prefix_cache.nbytes <= limit
            assert eng.prefix_cache.nbytes == sum(e.nbytes for e in eng.prefix_cache.entries)
            assert eng.held() == (len(eng.prefix_cache), eng.prefix_cache.nbytes)
        assert 1 <= len(eng.prefix_cache) <= 2


def test_cache_switch_belongs_to_the_session(model):
    with model.session(cache=True) as a, model.session(cache=False) as b:
        ids = prompt(model, QUESTIONS[0])
        a.generate(ids, max_tokens=2)
        b.generate(ids, max_tokens=2)
        assert a.cache and not b.cache
        assert len(a.prefix_cache) == 1 and len(b.prefix_cache) == 0
        assert a.generate(ids, max_tokens=2).cached_tokens > 0
        assert b.generate(ids, max_tokens=2).cached_tokens == 0


# --- a planted fault: the comparison must catch a cache that restores one position short -----------


class OneShortCache(PrefixCache):
    """Claims ``n`` cached positions but restores ``n - 1``: every later position shifts by one."""

    def _restore(self, entry, n):
        hit = super()._restore(entry, n - 1)
        return Hit(hit.state, n)

    def store(self, tokens, state, *, pinned=False):
        # it believes its states: keys them by the length they really have
        return super().store(list(tokens)[: self.ops.length(state)], state, pinned=pinned)


def test_cache_on_vs_off_comparison_catches_a_one_short_restore(model):
    off, bad, good = model.session(cache=False), model.session(cache=True), model.session(cache=True)
    bad.prefix_cache = OneShortCache(model.state_ops, max_entries=64, max_bytes=1 << 30)
    differs = []
    for q in QUESTIONS:
        ids = prompt(model, q)
        ref = off.generate(ids, max_tokens=12).tokens
        assert good.generate(ids, max_tokens=12).tokens == ref
        g = bad.generate(ids, max_tokens=12)
        if g.cached_tokens:
            differs.append(g.tokens != ref)
    assert len(differs) == len(QUESTIONS) - 1  # the fault was exercised on every hit ...
    assert any(differs)  # ... and the token comparison flags it


# --- torch and mlx agree -----------------------------------------------------------------------


def test_torch_and_mlx_give_the_same_tokens(tiny_llama):
    with build_engine(profile(tiny_llama, "torch")) as tm, build_engine(profile(tiny_llama, "mlx")) as mm:
        t, m = tm.session(cache=True), mm.session(cache=True)
        for q in QUESTIONS:
            ids = prompt(tm, q)
            assert prompt(mm, q) == ids
            gt, gm = t.generate(ids, max_tokens=16), m.generate(ids, max_tokens=16)
            assert gt.tokens == gm.tokens and gt.text == gm.text
            assert gt.cached_tokens == gm.cached_tokens


# --- helpers -----------------------------------------------------------------------------------


def arrays(state) -> list[np.ndarray]:
    """Every stored K/V array of a torch DynamicCache or an mlx cache list, as numpy."""
    if hasattr(state, "layers"):
        return [t.detach().cpu().numpy().copy() for layer in state.layers for t in (layer.keys, layer.values)]
    return [np.array(a) for c in state for a in (c.keys, c.values)]


def test_mlx_samples_with_mlx_lms_own_sampler_keyed_per_turn(tiny_llama):
    """``sampler: mlx_lm``: mlx-lm's make_sampler draws, reseeded from the key each turn, so a key gives its tokens
    again and through the cache; its draws follow mlx-lm's documented chain (the installed release's sampler is read
    against it: uniform transforms), and the identity names that chain."""
    from gatekeeper.engines.sampler import Draw, key
    from gatekeeper.gate.stats.pit import ks_uniform
    from gatekeeper.workspace import Decoding

    m = build_engine(profile(tiny_llama, "mlx", options={"sampler": "mlx_lm"}))
    d = Decoding(max_tokens=12, temperature=1.0, top_k=40, top_p=0.95, repetition_penalty=1.1)
    try:
        assert m.sampler()["sampler"] == "mlx_lm" and m.sampler()["chain"][1:4] == ["top_p", "min_p", "top_k"]
        with m.session(cache=False) as off, m.session(cache=True) as on:
            p = prompt(m, QUESTIONS[2])
            on.generate(p, max_tokens=4)  # the prompt cached, so the next call is a hit
            draws = [off.generate(p, max_tokens=12, sampling=Draw(d, key(0, "c", s, 0))) for s in range(8)]
            again = off.generate(p, max_tokens=12, sampling=Draw(d, key(0, "c", 0, 0)))
            hit = on.generate(p, max_tokens=12, sampling=Draw(d, key(0, "c", 0, 0)))
        assert again.tokens == draws[0].tokens == hit.tokens and hit.cached_tokens > 0
        assert len({tuple(g.tokens) for g in draws}) > 4  # other keys draw apart
        values = [w[3] for g in draws for w in g.draws]
        assert len(values) == 96 and min(values) >= 0  # no draw the declared decoding gives no chance
        assert ks_uniform(values)[1] > 0.001
    finally:
        m.close()
