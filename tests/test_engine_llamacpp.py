"""The llamacpp adapter on the default model's GGUF, in-process: llama.cpp's own prefix reuse and
pinned states give the same tokens as cold prefills (PASS through the CLI), llama.cpp's counters
give the figures, and a planted fault in the restore is caught (FAIL)."""

from __future__ import annotations

import pytest
from conftest import SHORT, ledger, read_reference, suite
from served import evaluate

from gatekeeper.errors import GatekeeperError
from gatekeeper.identity import file_digest
from gatekeeper.setup.llama_libs import import_llama_cpp
from gatekeeper.setup.models import find_gguf
from gatekeeper.workspace import EngineProfile

llama_cpp = import_llama_cpp()  # the llamacpp extra and make llama-server's libraries (make test does both)
pytestmark = pytest.mark.slow

from gatekeeper.engines.llamacpp import LlamaCppEngine, LlamaCppSession, resolve_gguf  # noqa: E402


class ShortRestoreSession(LlamaCppSession):
    """A cache that restores one position short and fills it with the token before it: the context
    has the right length, so nothing downstream notices, but its last reused position is wrong."""

    def _restore(self, prompt):
        super()._restore(prompt)
        n = self.llm.n_tokens
        if n > 1:
            self.llm.n_tokens = n - 1
            self.llm.eval([prompt[n - 2]])
            self.llm.input_ids[n - 1] = prompt[n - 1]  # claim the right token


class ShortRestore(LlamaCppEngine):
    session_class = ShortRestoreSession


# One thread: on a small shared machine, threads that wait on each other at every op are far slower.
ONE_THREAD = "options: {n_threads: 1}\n"
MONO = EngineProfile(adapter="llamacpp", prefill="monolithic", options={"n_threads": 1})


def llama_ws(workspace):
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(suite(SHORT))
    for name, body in {
        "gguf": f"adapter: llamacpp\nmodel: default\n{ONE_THREAD}",
        "gguf_mono": f"adapter: llamacpp\nmodel: default\nprefill: monolithic\n{ONE_THREAD}",
        "gguf_short": f"adapter: test_engine_llamacpp:ShortRestore\nmodel: default\nprefill: monolithic\n{ONE_THREAD}",
    }.items():
        (workspace / "engines" / f"{name}.yaml").write_text(body)
    return workspace


@pytest.mark.parametrize("profile", ["gguf", "gguf_mono"])
def test_pass_on_the_default_gguf(workspace, run_cli, profile):
    ws = llama_ws(workspace)
    read_reference(ws)
    code, out = evaluate(run_cli, ws, profile)
    assert code == 0, out
    assert out["verdict"] == "PASS" and out["equal"] == {"baseline": 4, "off_on": 4}
    assert out["tokens"]["cached_on"] >= out["tokens"]["stable_prefix_bound"] // 2
    lg = ledger(ws)
    assert lg.verify().ok
    ident = lg.evaluation(out["evaluation_id"])["identity"]["off"]["engine"]
    assert ident["engine"] == "llamacpp" and ident["model_digest"] == file_digest(find_gguf())
    assert ident["libraries"]["llama-cpp-python"] == llama_cpp.__version__
    # the reference arm: an emptied context's prefill reads each answer's first token; only clear flips count
    r = out["reference"]
    assert r["dtype"].startswith("llama.cpp (an emptied context") and not any(r["departs"].values()), r
    assert r["arms"]["off"]["positions"] == r["arms"]["on"]["positions"] >= 4


def test_planted_restore_fault_fails(workspace, run_cli):
    ws = llama_ws(workspace)
    code, out = evaluate(run_cli, ws, "gguf_short")
    assert code == 1, out
    assert out["verdict"] == "FAIL" and out["differing_cases"]
    assert ledger(ws).verify().ok


def chat(e, system: str, user: str) -> list[int]:
    return e.tokenize(e.render([{"role": "system", "content": system}, {"role": "user", "content": user}]))


def test_figures_pins_and_saved_states(tmp_path):
    system = "You answer in one short line. " * 30
    model = LlamaCppEngine(MONO)
    off = model.session(cache=False)
    prompts = [chat(model, system, q) for q in ("Name a fruit.", "Name a city.")]
    cold = [off.generate(p, max_tokens=8, top2=True) for p in prompts]
    assert all(g.cached_tokens == 0 and g.prompt_tokens == len(p) for g, p in zip(cold, prompts))
    assert all(g.prefill_s > 0 and len(g.top2) == len(g.tokens) for g in cold)
    static = len(chat(model, system, ""))  - 4  # the rendered system turn, before the user's
    off.pin(prompts[0][:static])  # with the cache off a boundary computes and keeps nothing
    assert off.pin_sources == {} and off.held() == (0, 0)
    assert off.generate(prompts[1], max_tokens=8).cached_tokens == 0
    off.close()

    on = model.session(cache=True, results=tmp_path)
    on.pin(prompts[0][:static])
    assert list(on.pin_sources.values()) == ["computed"]
    assert on.held()[0] == 1 and on.held()[1] > 0
    warm = [on.generate(p, max_tokens=8, top2=True) for p in prompts]
    assert [g.tokens for g in warm] == [g.tokens for g in cold] and [g.text for g in warm] == [g.text for g in cold]
    assert warm[0].cached_tokens == static  # from the pinned state
    assert warm[1].cached_tokens >= static  # from the context llama.cpp kept
    on.close()

    # A fresh session (on a freshly loaded model) finds the pinned state in the result layer.
    model.close()
    model = LlamaCppEngine(MONO)
    again = model.session(cache=True, results=tmp_path)
    again.pin(prompts[0][:static])
    assert list(again.pin_sources.values()) == ["loaded"]
    g = again.generate(prompts[1], max_tokens=8)
    assert g.tokens == cold[1].tokens and g.cached_tokens == static
    again.close()
    model.close()


def test_sessions_of_one_model_share_nothing_but_the_model():
    """The single llama.cpp context changes hands: a session never reuses another's tokens."""
    system = "You answer in one short line. " * 30
    with LlamaCppEngine(MONO) as model:
        a, b, off = model.session(cache=True), model.session(cache=True), model.session(cache=False)
        p = chat(model, system, "Name a fruit.")
        first = a.generate(p, max_tokens=6)
        assert first.cached_tokens == 0
        assert a.generate(p, max_tokens=6).cached_tokens == len(p) - 1  # its own context, kept
        ref = off.generate(p, max_tokens=6)  # takes the context: a's tokens are gone
        assert ref.cached_tokens == 0 and ref.tokens == first.tokens
        assert b.generate(p, max_tokens=6).cached_tokens == 0  # another session: starts empty
        assert a.generate(p, max_tokens=6).cached_tokens == 0  # the context changed hands since
        for s in (a, b, off):
            s.close()


def test_sampled_draws_are_keyed_and_pair_through_the_cache():
    """In-process llama.cpp samples through gatekeeper's sampler: the same key gives the same answer cold and from
    the cache, another key another answer, and each step records what the draw weighed with its transform."""
    from gatekeeper.engines.sampler import Draw, key
    from gatekeeper.workspace import Decoding

    system = "You answer in one short line. " * 30
    d = Decoding(max_tokens=8, temperature=1.2, top_p=0.98, repetition_penalty=1.1)
    with LlamaCppEngine(MONO) as model:
        p = chat(model, system, "Name a fruit.")
        off, on = model.session(cache=False), model.session(cache=True)
        first = [off.generate(p, max_tokens=8, sampling=Draw(d, key(0, "c", s, 0))) for s in range(4)]
        on.generate(p, max_tokens=8)  # the prompt in the context: what follows is a hit
        hit = on.generate(p, max_tokens=8, sampling=Draw(d, key(0, "c", 0, 0)))
        assert hit.cached_tokens > 0 and hit.tokens == first[0].tokens
        assert len({tuple(g.tokens) for g in first}) > 1
        assert all(len(g.draws) == len(g.tokens) and all(len(w) == 4 and 0 <= w[3] < 1 for w in g.draws) for g in first)
        off.close()
        on.close()


def test_model_paths(tmp_path):
    assert resolve_gguf("default") == find_gguf()
    (tmp_path / "m.gguf").symlink_to(find_gguf())
    assert resolve_gguf("m.gguf", tmp_path) == tmp_path / "m.gguf"
    assert resolve_gguf(str(tmp_path)) == tmp_path / "m.gguf"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(GatekeeperError, match="not a .gguf file"):
        resolve_gguf(str(tmp_path / "config.json"))
    with pytest.raises(GatekeeperError, match="field 'dtype'"):
        LlamaCppEngine(EngineProfile(name="x", adapter="llamacpp", dtype="float32"))
