"""Teacher-forced distribution distance (gate/stats/distance.py) and the engines' ``Session.score``."""

from __future__ import annotations

import math
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tiny_models import CORPUS, tiny_llama  # noqa: F401  (fixture)

from gatekeeper.engines.base import Scored, Session
from gatekeeper.engines.registry import build_engine
from gatekeeper.gate.stats.distance import APPROXIMATION, Bound, Summary, beyond, check, compare, distance, positions
from gatekeeper.setup.models import prepare_default_model
from gatekeeper.workspace import EngineProfile

SYSTEM = ("You are a careful assistant. Answer the question using the notes below, and say when the notes do not cover it. "
          "The router reads the request, picks a tool, and passes the arguments on. Tools: search, calendar, calculator, mail.")


def profile(model, adapter="torch", **over) -> EngineProfile:
    fields = {"adapter": adapter, "model": str(model), "dtype": "float32", "device": "cpu", "prefill": "monolithic"}
    return EngineProfile(**{**fields, **over})


def chat(model, question: str) -> list[int]:
    return model.tokenize(model.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))


def rows(*dists: list[float]) -> np.ndarray:
    return np.log(np.array(dists, dtype=np.float64))


# --- the statistics ----------------------------------------------------------------------------


def test_identical_distributions_give_exactly_zero():
    logits = np.random.default_rng(0).normal(size=(40, 300)).astype(np.float32) * 3
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 300, 40)]
    a, b = Scored.from_logits(logits, tokens), Scored.from_logits(logits.copy(), tokens)
    d = distance(a, b)
    assert d.positions == 40 and d.approximation is None
    assert d.kld.mean == 0.0 and d.kld.max == 0.0 and d.kld.min == 0.0 and d.kld.se == 0.0
    assert d.same_top1 == 1.0 and d.same_top1_se == 0.0
    assert d.delta_p.max == 0.0 and d.delta_p.min == 0.0 and d.delta_p_rms == 0.0 and d.ln_ppl_ratio == 0.0
    assert d.reason().startswith("kld: mean 0 ± 0, p99 0, max 0 over 40 positions; same top-1 100.0% ± 0.0%; Δp RMS 0%")
    lumped = distance(a.top(5), b.top(5))  # the lumped form of equal rows is 0 too
    assert lumped.kld.max == 0.0 and lumped.approximation == APPROXIMATION.format(k=5)


def test_three_way_categoricals_against_the_closed_form():
    # p = (0.5, 0.3, 0.2), q = (0.25, 0.25, 0.5); the next token is 1; a second position has p = q.
    a = Scored.from_logprobs(rows([0.5, 0.3, 0.2], [0.6, 0.3, 0.1]), [1, 0])
    b = Scored.from_logprobs(rows([0.25, 0.25, 0.5], [0.6, 0.3, 0.1]), [1, 0])
    kl = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)  # = 0.2180119...
    assert kl == pytest.approx(0.2180119, abs=1e-7)
    per = positions(a, b)
    assert per.kld[0] == pytest.approx(kl, rel=1e-6) and abs(per.kld[1]) < 1e-7
    d = per.summary()
    # llama.cpp's mean ± uncertainty of {x, 0}: mean x/2, sqrt((x²/2 − x²/4) / 1) = x/2
    assert d.kld.mean == pytest.approx(kl / 2, rel=1e-6) and d.kld.se == pytest.approx(kl / 2, rel=1e-6)
    assert d.same_top1 == 0.5  # argmax 0 against 2, then 0 against 0
    assert per.delta_p[0] == pytest.approx(0.25 - 0.3, abs=1e-7) and per.delta_p[1] == pytest.approx(0.0, abs=1e-7)
    assert d.delta_p_rms == pytest.approx(math.sqrt(0.05 ** 2 / 2), rel=1e-5)
    assert d.ln_ppl_ratio == pytest.approx((-math.log(0.25) + math.log(0.3)) / 2, rel=1e-5)
    # A's top-1 against B whole: tokens 0 (A's best) and 1 (the next) are known, token 2 alone is "other"
    assert positions(a.top(1), b).kld[0] == pytest.approx(kl, rel=1e-6)  # nothing was grouped
    # top-1 on both sides: only the next token 1 is known to both (A's best is 0, B's 2); {0, 2} are lumped
    lumped = positions(a.top(1), b.top(1)).kld[0]
    assert lumped == pytest.approx(0.3 * math.log(1.2) + 0.7 * math.log(0.7 / 0.75), rel=1e-6) and lumped < kl
    # next token 0 instead: only token 0 is known, {1, 2} are lumped: 0.5 ln 2 + 0.5 ln(0.5/0.75)
    a0, b0 = (Scored.from_logprobs(r[:1], [0], top_k=1) for r in (a.logprobs, b.logprobs))
    lumped0 = positions(a0, b0).kld[0]
    assert lumped0 == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel=1e-6) and lumped0 < kl


def test_quantiles_interpolate_as_llama_perplexity():
    s = Summary.of(np.arange(101, dtype=np.float64))  # value = rank: quantile q is 100 q
    assert (s.min, s.p1, s.p10, s.median, s.p90, s.p99, s.max) == (0, 1, 10, 50, 90, 99, 100)
    assert s.p999 == pytest.approx(99.9)
    assert Summary.of([1.0, 2.0, 3.0, 4.0]).median == 2.5  # the two middle values averaged


def test_bounds_are_judged_against_the_floor():
    def made(kl: float, same: float, n: int = 200):
        """A uniform over 4 ids; B moves ±e on ids 0 and 1: KL = −ln(1 − 16e²)/4 = kl at e = sqrt(kl)/2
        (to first order); the first (1 − same) of the positions favour id 1 instead of A's argmax 0."""
        a = Scored.from_logprobs(np.log(np.full((n, 4), 0.25)), [0] * n)
        e = math.sqrt(kl) / 2
        q = np.tile([0.25 + e, 0.25 - e, 0.25, 0.25], (n, 1))
        q[: round((1 - same) * n)] = [0.25 - e, 0.25 + e, 0.25, 0.25]
        return distance(a, Scored.from_logprobs(np.log(q), [0] * n))

    floor, moved = made(1e-4, 0.99), made(6e-4, 0.97)
    assert moved.kld.mean == pytest.approx(-math.log(1 - 4 * 6e-4) / 4, rel=1e-4) and moved.same_top1 == 0.97
    ok = check(moved, floor, Bound(max_kld=6e-4, min_same_top1=0.975))
    assert ok.met, ok.reason()  # 5e-4 above the floor; 2 points below a floor of 99%
    assert not check(moved, None, Bound(min_same_top1=0.975)).met  # against a perfect floor: 3 points short
    bad = check(moved, floor, Bound(max_kld=3e-4, min_same_top1=0.99))
    assert not bad.met and bad.lines[0].startswith("kld mean") and "above the A/A floor" in bad.lines[0]
    assert len([line for line in bad.lines if "same top-1" in line]) == 1
    assert not check(moved, floor, Bound(max_kld=1e-4, kld_stat="max")).met
    with pytest.raises(ValueError):
        Bound(kld_stat="p42")


def test_only_a_distance_far_outside_its_bound_is_beyond_doubt():
    n = 100  # B moves ids 0/1 of a uniform by e on half the positions and 2e on the rest (so the KL has an SE);
    a = Scored.from_logprobs(np.log(np.full((n, 4), 0.25)), [0] * n)  # its first 20 positions favour id 1
    q = np.array([[0.25 + e, 0.25 - e, 0.25, 0.25] for e in [0.02, 0.04] * (n // 2)])
    q[:20, :2] = q[:20, 1::-1]
    moved = distance(a, Scored.from_logprobs(np.log(q), [0] * n))
    k, z = moved.kld, 1.6448536269514722
    assert k.se > 0 and moved.same_top1 == 0.8 and moved.same_top1_se > 0
    far = beyond(moved, None, Bound(max_kld=(k.mean - z * k.se) / 2, min_same_top1=0.95), 0.05)
    assert len(far) == 2 and far[0].startswith("kld mean") and "even its lower 95% bound" in far[0], far
    near = Bound(max_kld=k.mean - k.se, min_same_top1=1 - (0.2 - moved.same_top1_se))  # over at the point estimate only
    assert not check(moved, None, near).met and beyond(moved, None, near, 0.05) == []
    assert beyond(moved, None, Bound(max_kld=k.p99 / 100, kld_stat="p99"), 0.05) == []  # a quantile has no SE
    assert beyond(moved, moved, Bound(max_kld=k.se, min_same_top1=0.99), 0.05) == []  # against itself: the floor


def test_different_tokens_are_refused():
    lp = rows([0.5, 0.5])
    with pytest.raises(ValueError, match="different tokens"):
        distance(Scored.from_logprobs(lp, [0]), Scored.from_logprobs(lp, [1]))


def test_an_engine_that_cannot_score_says_none():
    class Opaque(Session):
        def generate(self, prompt, *, max_tokens, stop=(), top2=False, until=None):
            raise NotImplementedError

    assert Opaque(model=None).score([1, 2], [3]) is None  # type: ignore[arg-type]


# --- teacher-forced scoring on the in-process adapters ------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with build_engine(profile(tiny_llama)) as m:
        yield m


@pytest.mark.parametrize("adapter", ["torch", "mlx"])
def test_score_is_what_generate_sees(tiny_llama, adapter):
    """Each scored row is the log-softmax of the logits generate picked from: the same argmax, and the
    top-2 logits' gap is the gap of their log-probabilities."""
    with build_engine(profile(tiny_llama, adapter)) as m, m.session(cache=False) as s:
        ids = chat(m, "What is 2+2?")
        g = s.generate(ids, max_tokens=24, top2=True)
        scored = s.score(ids, g.tokens)
        assert scored is not None and scored.kind == "full" and scored.cached_tokens == 0
        lp = scored.logprobs
        assert lp.dtype == np.float32 and lp.shape[0] == len(g.tokens) == 24
        assert list(lp.argmax(axis=1)) == g.tokens
        assert np.allclose(np.exp(lp.astype(np.float64)).sum(axis=1), 1, atol=1e-5)
        gaps = np.array([lp[i, int(best[0])] - lp[i, int(second[0])] for i, (best, second) in enumerate(g.top2)])
        assert np.allclose(gaps, [best[1] - second[1] for best, second in g.top2], atol=1e-4)
        assert np.array_equal(scored.token_logprobs, lp[np.arange(24), g.tokens])
        top = s.score(ids, g.tokens, top_k=3)
        assert top.kind == "top3" and list(top.ids[:, 0]) == g.tokens and top.logprobs.shape == (24, 3)
        assert np.allclose(top.logprobs, np.sort(lp, axis=1)[:, ::-1][:, :3], atol=1e-6)


@pytest.mark.parametrize("plan", ["aligned", "monolithic"])
def test_cache_on_scores_as_cache_off(tiny_llama, plan):
    """The session's cache serves the prompt's prefix as generate's does; on an exact engine the rows are
    the same: bit for bit under the aligned plan (the same passes), to rounding under the monolithic one."""
    with build_engine(profile(tiny_llama, prefill=plan, chunk=16)) as m:
        first, ids = chat(m, "What is 2+2?"), chat(m, "Book the cheapest flight from Lisbon to Porto.")
        with m.session(cache=False) as off, m.session(cache=True) as on:
            for s in (off, on):
                s.pin(first[:40])
            on.generate(first, max_tokens=4)  # fills the cache with the shared system turn
            cont = off.generate(ids, max_tokens=24).tokens
            a, b = off.score(ids, cont), on.score(ids, cont)
        assert a.cached_tokens == 0 and b.cached_tokens >= 40
        d = distance(a, b)
        assert d.same_top1 == 1.0
        if plan == "aligned":
            assert np.array_equal(a.logprobs, b.logprobs) and d.kld.max == 0.0
        else:
            assert np.abs(a.logprobs - b.logprobs).max() < 1e-4 and np.abs(positions(a, b).kld).max() < 1e-6


def test_lumped_topk_is_a_lower_bound_on_real_distributions(tiny_llama):
    """float32 against bfloat16 weights on the tiny llama: the lumped top-k KL never exceeds the full one,
    equals it once k covers the vocabulary, and grows toward it with k. The tiny random model spreads its
    mass thinly (top-50 of 512 ids holds about 70% of the KL here), so the stated bound is loose:
    top-50 >= 55% of the full mean."""
    with build_engine(profile(tiny_llama)) as fp32, build_engine(profile(tiny_llama, dtype="bfloat16")) as bf16:
        ids = chat(fp32, "What is 2+2?")
        with fp32.session() as s32, bf16.session() as s16:
            cont = s32.generate(ids, max_tokens=32).tokens
            a, b = s32.score(ids, cont), s16.score(ids, cont)
            again = fp32.session().score(ids, cont)
    full = positions(a, b).kld
    assert full.mean() > 1e-4  # bfloat16 weights moved the model
    means = []
    for k in (1, 5, 20, 50):
        for pair in ((a.top(k), b.top(k)), (a.top(k), b), (a, b.top(k))):
            lumped = positions(*pair)
            assert lumped.k == k and np.all(lumped.kld <= full + 1e-6)
        means.append(positions(a.top(k), b.top(k)).kld.mean())
    assert means == sorted(means) and means[-1] >= 0.55 * full.mean()
    vocab = a.logprobs.shape[1]
    assert np.allclose(positions(a.top(vocab), b.top(vocab)).kld, full, atol=1e-6)
    c = compare(a, b, again)  # torch on the CPU repeats itself: the floor is 0
    assert c.floor is not None and c.floor.kld.max == 0.0 and c.floor.same_top1 == 1.0
    assert c.within_floor(Bound(max_kld=2 * full.mean(), min_same_top1=0.9)).met
    assert not c.within_floor(Bound(max_kld=full.mean() / 2)).met
    assert "A/A floor: kld mean 0" in c.reason()


def test_lumped_top20_holds_most_of_the_kl_on_the_default_model():
    """A trained model's mass is concentrated: on SmolLM2-135M (float32 against bfloat16 weights, a fixed
    answer read teacher-forced), top-20 lumped KL is at least 80% of the full KL (about 92% measured)."""
    model, _ = prepare_default_model()  # under $GATEKEEPER_HOME, where make put it
    with build_engine(profile(model)) as fp32, build_engine(profile(model, dtype="bfloat16")) as bf16:
        ids = fp32.tokenize(fp32.render([{"role": "user", "content": "Why is the sky blue? Two sentences."}]))
        cont = fp32.tokenize("The sky looks blue because air molecules scatter short blue wavelengths of sunlight "
                             "much more than red ones. That scattered blue light reaches our eyes from every direction.")
        with fp32.session() as s32, bf16.session() as s16:
            a, b = s32.score(ids, cont), s16.score(ids, cont)
    full = positions(a, b).kld
    lumped = positions(a.top(20), b.top(20)).kld
    assert np.all(lumped <= full + 1e-6) and lumped.mean() >= 0.8 * full.mean()


# --- against llama.cpp's own llama-perplexity --kl-divergence -----------------------------------


@pytest.fixture(scope="module")
def llama_perplexity(tmp_path_factory) -> Path:
    """llama-perplexity of the llama.cpp build the llamacpp adapter loads: the built one, else compiled here
    from the vendored source against the built libraries (one file, seconds, no CPU-specific flags); `make test`
builds what this needs (`make llama-server`), so anything missing is a failure, never a skip."""
    try:
        from gatekeeper.setup.llama_libs import import_llama_cpp, lib_dir, root, version_dir

        import_llama_cpp()
    except Exception as e:  # the llamacpp extra or its libraries are not here
        pytest.fail(f"llama.cpp is not available ({e}): run 'make llama-server'")
    built = root() / "bin" / "llama-perplexity"
    if built.is_file() and os.access(built, os.X_OK):
        return built
    src, lib = version_dir() / "src", lib_dir()
    source = src / "tools" / "perplexity"
    if not (source / "perplexity.cpp").is_file() or not (lib / "libllama-common.so").is_file() or not shutil.which("c++"):
        pytest.fail("no llama-perplexity, and no llama.cpp source, libllama-common or c++ to compile it: run 'make llama-server'")
    exe = tmp_path_factory.mktemp("llama-perplexity") / "llama-perplexity"
    cmd = ["c++", "-std=c++17", "-O2", *(f"-I{src / d}" for d in ("include", "common", "ggml/include", "vendor")),
           str(source / "perplexity.cpp"), str(source / "main.cpp"), "-o", str(exe), f"-L{lib}",
           "-lllama-common", "-lllama", "-lggml", "-lggml-base", "-lpthread", f"-Wl,-rpath,{lib}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"could not compile llama-perplexity: {r.stderr[-400:]}")
    return exe


def printed(pattern: str, out: str) -> tuple[float, ...]:
    m = re.search(pattern, out)
    assert m, f"llama-perplexity printed no {pattern!r}"
    return tuple(float(g) for g in m.groups())


def test_statistics_match_llama_perplexity(llama_perplexity, tmp_path):
    """The default GGUF with an f16 K cache (A) against a q8_0 one (B): llama-perplexity --kl-divergence on a
    text, and the llamacpp adapter's scores of the same windows through distance(). llama.cpp keeps A's
    log-probabilities as 16-bit steps and skips A's tokens below e^-16, so the figures agree closely, not
    to the last digit."""
    from gatekeeper.setup.models import find_gguf

    gguf = find_gguf()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS + CORPUS[:4]))  # two windows of 128 tokens
    n_ctx = 128
    run = [str(llama_perplexity), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx), "-t", "1", "-fa", "off",
           "--kl-divergence-base", str(tmp_path / "base.kld")]
    subprocess.run(run, capture_output=True, check=True, timeout=300)
    r = subprocess.run([*run, "--kl-divergence", "-ctk", "q8_0"], capture_output=True, text=True, check=True, timeout=300)
    out = r.stdout + r.stderr
    raw = (tmp_path / "base.kld").read_bytes()  # "_logits_", n_ctx, n_vocab, n_chunk, the tokens, A's log-probs
    assert raw[:8] == b"_logits_"
    ctx, _, n_chunk = struct.unpack("<Iii", raw[8:20])
    windows = np.frombuffer(raw[20: 20 + 4 * ctx * n_chunk], dtype=np.int32).reshape(n_chunk, ctx)
    assert ctx == n_ctx and n_chunk == 2  # at least 100 positions: llama-perplexity prints its summary

    def side(**options) -> EngineProfile:
        return EngineProfile(adapter="llamacpp", model="default", device="cpu", prefill="monolithic",
                             options={"n_ctx": 2 * n_ctx, "n_threads": 1, **options})

    first = n_ctx // 2  # llama-perplexity scores the second half of each window: rows first .. n_ctx-2
    sa, sb = [], []
    with build_engine(side()) as ea, build_engine(side(type_k="q8_0")) as eb, ea.session() as a, eb.session() as b:
        lib = ea.lib
        vocab = lib.llama_model_get_vocab(ea.llm.model)
        for w in windows:
            tokens = [int(t) for t in w]
            if lib.llama_vocab_get_add_bos(vocab):
                tokens[0] = lib.llama_vocab_bos(vocab)  # as llama-perplexity starts each window
            sa.append(a.score(tokens[: first + 1], tokens[first + 1:]))
            sb.append(b.score(tokens[: first + 1], tokens[first + 1:]))
    d = distance(sa, sb)
    n = d.positions
    assert n == n_chunk * (n_ctx - 1 - first)

    mean, se = printed(r"Mean\s+KLD:\s+([\d.]+)\s+±\s+([\d.]+)", out)
    assert d.kld.mean > 1e-4  # q8_0 keys moved the model
    assert d.kld.mean == pytest.approx(mean, rel=0.03, abs=2e-5) and d.kld.se == pytest.approx(se, rel=0.1, abs=2e-5)
    for label, ours in (("Maximum", d.kld.max), (r"99\.0%", d.kld.p99), (r"90\.0%", d.kld.p90), ("Median", d.kld.median)):
        (theirs,) = printed(label + r"\s+KLD:\s+([\d.]+)", out)
        assert ours == pytest.approx(theirs, rel=0.05, abs=5e-5), label
    same, same_se = printed(r"Same top p:\s+([\d.]+)\s+±\s+([\d.]+)\s+%", out)
    assert abs(100 * d.same_top1 - same) <= 100 / n + 0.01  # at most one argmax on a near tie may differ
    assert 100 * d.same_top1_se == pytest.approx(same_se, abs=0.1)
    rms, rms_se = printed(r"RMS Δp\s+:\s+([\d.]+)\s+±\s+([\d.]+)\s+%", out)
    assert 100 * d.delta_p_rms == pytest.approx(rms, abs=0.02) and 100 * d.delta_p_rms_se == pytest.approx(rms_se, abs=0.02)
    dp, dp_se = printed(r"Mean\s+Δp:\s+([-\d.]+)\s+±\s+([\d.]+)\s+%", out)
    assert 100 * d.delta_p.mean == pytest.approx(dp, abs=0.01) and 100 * d.delta_p.se == pytest.approx(dp_se, abs=0.01)
    ratio, ratio_se = printed(r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s+([-\d.]+)\s+±\s+([\d.]+)", out)
    assert d.ln_ppl_ratio == pytest.approx(ratio, abs=1e-3) and d.ln_ppl_ratio_se == pytest.approx(ratio_se, abs=1e-3)


def test_vllm_prompt_logprobs_become_top_k_rows_with_the_own_token_wherever_it_ranks():
    """vLLM's ``prompt_logprobs`` rows (``{id: {logprob, rank}}``: its top 20, and the position's own token at its
    rank) read as top-20 rows, best first with the lowest id first on a tie, the own token's log-probability kept."""
    from gatekeeper.engines.served.dialects import PROMPT_TOP_K
    from gatekeeper.engines.served.http import _top_k

    def row(own: int, own_rank: int):
        r = {str(100 + j): {"logprob": -0.1 * j - (0.05 if j == 3 else 0), "rank": j + 1} for j in range(PROMPT_TOP_K)}
        r["104"]["logprob"] = r["105"]["logprob"] = -0.45  # a tie: 104 before 105
        if own_rank > PROMPT_TOP_K:
            r[str(own)] = {"logprob": -9.5, "rank": own_rank}
        return r

    scored = _top_k([row(100, 1), row(7, 4000)], [100, 7], cached_tokens=0)
    assert scored.kind == "top20" and scored.ids.shape == (2, 20) and scored.cached_tokens == 0
    assert scored.ids[0][:6].tolist() == [100, 101, 102, 103, 104, 105] and 7 not in scored.ids[1].tolist()
    assert scored.token_logprobs.tolist() == pytest.approx([0.0, -9.5])
    assert (np.diff(scored.logprobs, axis=1) <= 0).all()  # best first
    with pytest.raises(ValueError, match="2 positions for 3 tokens"):
        _top_k([row(100, 1), row(7, 4000)], [100, 7, 8], cached_tokens=None)
