"""The torch adapter on the real default model: prefix reuse over a long static prefix is exact."""

from __future__ import annotations

import pytest

from gatekeeper.engines.registry import build_engine
from gatekeeper.setup.models import is_prepared, prepare_default_model
from gatekeeper.workspace import EngineProfile


def static_prefix() -> str:
    """A router's system prompt: instructions plus tool schemas, well over 1,000 tokens."""
    lines = [
        (
            "You are the router of a travel assistant. Read the user's request, pick exactly one tool, "
            "and answer with the tool name and its arguments as JSON. If no tool fits, say so plainly."
        ),
        "Tools:",
    ]
    kinds = ["flights", "hotels", "trains", "cars", "weather", "events", "museums", "restaurants"]
    actions = ["search", "book"]
    for kind in kinds:
        for action in actions:
            lines.append(
                f"- {action}_{kind}: {action.capitalize()} {kind} for the traveller. Arguments: "
                f'{{"city": string, "date": "YYYY-MM-DD", "travellers": integer, "budget_eur": number, '
                f'"notes": string}}. Use it when the user wants to {action} {kind}; never guess missing dates.'
            )
    lines.append("Answer in one line. Do not explain your choice unless the user asks for it.")
    return "\n".join(lines)


QUESTIONS = [
    "Find me a hotel in Porto for two people on 2024-06-01.",
    "Cancel my train to Lisbon tomorrow.",
    "What is the weather in Madrid on Friday?",
    "Book a table for four at a restaurant in Seville tonight.",
]


@pytest.fixture(scope="module")
def default_model():
    if not is_prepared():
        prepare_default_model()
    return "default"


@pytest.mark.slow
def test_prefix_cache_is_exact_on_the_default_model(default_model):
    profile = EngineProfile(adapter="torch", model=default_model, dtype="float32", device="cpu", prefill="monolithic")
    model = build_engine(profile)
    off, on = model.session(cache=False), model.session(cache=True)
    system = static_prefix()
    prompts = [model.tokenize(model.render([{"role": "system", "content": system}, {"role": "user", "content": q}]))
               for q in QUESTIONS]
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    assert shared >= 1000

    off.pin(prompts[0][:shared])  # a stage boundary in both sessions; with the cache off nothing is kept
    on.pin(prompts[0][:shared])  # the stage's static prefix, computed once
    assert on.pin_sources == {tuple(prompts[0][:shared]): "computed"} and off.pin_sources == {}
    for ids in prompts:
        g_off = off.generate(ids, max_tokens=10)
        g_on = on.generate(ids, max_tokens=10)
        assert g_on.tokens == g_off.tokens and g_on.text == g_off.text
        assert g_on.cached_tokens >= 0.9 * shared
        assert g_off.cached_tokens == 0
    assert on.stats.cached_tokens >= 0.9 * shared * len(prompts)
    assert off.stats.cached_tokens == 0 and len(off.prefix_cache) == 0
    off.close()
    on.close()
    model.close()
