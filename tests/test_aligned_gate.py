"""The gate shows both prefill plans, and names the near-ties a cache hit flips.

On the default model in bfloat16 (CPU), a hit under the monolithic plan prefills its suffix in a pass
of another shape than the cold run's; under the aligned plan the cold run is cut where the hit lands,
so nothing changes shape. What the monolithic shapes do to the logits is the CPU's bf16 kernels'
business: on an AMD EPYC (AVX-512 BF16) 2 of these 3 requests flipped near-ties, a FAIL; on an Intel
Xeon with AVX-512-FP16/AMX the outputs stayed equal with a drift of 0.25, a PASS graded
``equal_outputs``; on the tiny llama torch's AVX2 kernels move nothing at all. So the monolithic
plan is held to the verdict and grade its own records call for (which catches a hit reported as
``bit_exact`` wherever the kernels move anything), and the aligned plan to a ``bit_exact`` PASS,
which holds on every CPU: cache on or off, it computes the same passes.

The FAIL that names a near-tie is built on purpose instead (``near_tie.NoisyHit``): planted noise on
every restored state, under the aligned plan in float32 on the tiny llama, flips a step whose flag-off
top-2 margin is a near-tie. The noise is seeded and float32 rounds alike to far below the margins
involved, so the flip is the same on every CPU.
"""

from __future__ import annotations

import pytest
import yaml
from conftest import evaluate, ledger
from near_tie import noisy_hit_profile

from gatekeeper.gate.kinds import NEAR_TIE
from gatekeeper.setup.models import is_prepared, prepare_default_model
from gatekeeper.setup.scaffold import init_workspace

# (case id, query): distinct first words, so every hit lands exactly on the system prefix whatever the
# order. Picked by experiment on one CPU, where monolithic flipped near-ties in parcel and hoodie.
CASES = [
    ("parcel", "my parcel has not moved for a week, tracking 1Z999AA10123456784"),
    ("hoodie", "do you have the green hoodie in size L?"),
    ("cancel", "please cancel order A-640022"),
]

TOOLS = [
    ("lookup_order", "Find an order by its number and report its status, items and delivery date.", '{"order_id": string}'),
    ("track_parcel", "Follow a parcel through the carrier and give its last scan and expected arrival.", '{"tracking_code": string, "carrier": string}'),
    ("start_return", "Open a return for one or more items of a delivered order and email a label.", '{"order_id": string, "items": [string], "reason": string}'),
    ("issue_refund", "Refund an order or part of it to the original payment method.", '{"order_id": string, "amount_eur": number, "reason": string}'),
    ("change_address", "Change the delivery address of an order that has not shipped yet.", '{"order_id": string, "address": string}'),
    ("cancel_order", "Cancel an order that has not shipped yet; shipped orders need a return instead.", '{"order_id": string}'),
    ("check_stock", "Say whether a product is in stock, in which sizes and colours, and when more arrives.", '{"product": string, "size": string, "colour": string}'),
    ("apply_coupon", "Check a coupon code and apply it to an open basket if it is valid.", '{"code": string, "basket_id": string}'),
    ("update_account", "Change the customer's name, email, phone number or password.", '{"field": string, "value": string}'),
    ("open_ticket", "Hand the conversation to a human agent with a short summary of the problem.", '{"summary": string, "priority": "low" | "normal" | "high"}'),
    ("store_hours", "Give the opening hours and address of a physical store.", '{"city": string}'),
    ("gift_card", "Check the balance of a gift card or buy a new one.", '{"card_number": string, "action": "balance" | "buy", "amount_eur": number}'),
]

def router_system() -> str:
    """A support-desk router: instructions plus tool schemas, about 900 tokens once rendered."""
    lines = [
        "You are the router of an online shop's support desk. Read the customer's message, choose exactly "
        "one tool from the list below, and answer with the tool name followed by its arguments as JSON on "
        "one line. If the message is small talk, answer with the word none. If no tool fits, answer with "
        "open_ticket and a one-sentence summary. Never invent order numbers, tracking codes or amounts: "
        "when one is missing, answer with ask and the name of the missing argument.",
        "",
        "Tools:",
    ]
    for name, what, args in TOOLS:
        lines.append(f"- {name}: {what} Arguments: {args}.")
    lines += [
        "",
        "Rules:",
        "1. Orders are numbered like A-123456; tracking codes are 18 characters long.",
        "2. Refunds above 200 euros always go to open_ticket with priority high.",
        "3. A customer who is angry or mentions a lawyer goes to open_ticket with priority high.",
        "4. Returns are possible within 30 days of delivery; after that, use open_ticket.",
        "5. Address changes are possible only before the order ships; otherwise suggest a return.",
        "6. Do not answer questions about other shops, politics or medicine; answer with none.",
        "7. Keep the JSON valid: double quotes, no trailing commas, numbers without units.",
        "",
        "Examples:",
        'Customer: where is my order A-204518? -> lookup_order {"order_id": "A-204518"}',
        'Customer: I want my money back for A-118822, 35 euros -> issue_refund {"order_id": "A-118822", "amount_eur": 35, "reason": "customer request"}',
        'Customer: do you have the blue raincoat in M? -> check_stock {"product": "raincoat", "size": "M", "colour": "blue"}',
        "Customer: hello there -> none",
        'Customer: cancel my order please -> ask order_id',
    ]
    return "\n".join(lines)


def suite() -> dict:
    return {
        "suite": "support",
        "stage": "router",
        "prompt": [
            {"role": "system", "static": True, "file": "prompts/support_router.txt"},
            {"role": "user", "static": False, "text": "{query}"},
        ],
        "decoding": {"max_tokens": 4},
        "cases": [{"id": cid, "vars": {"query": q}, "assert": [{"type": "min-length", "value": 1}]} for cid, q in CASES],
    }


@pytest.fixture(scope="module")
def support_ws(tmp_path_factory):
    if not is_prepared():
        prepare_default_model()
    ws = tmp_path_factory.mktemp("aligned-gate") / "ws"
    init_workspace(ws)
    for old in (ws / "assertions").glob("*.yaml"):
        old.unlink()
    (ws / "prompts" / "support_router.txt").write_text(router_system())
    (ws / "assertions" / "support.yaml").write_text(yaml.safe_dump(suite(), sort_keys=False))
    # the subject is the prefill plans' drift: no distance, no probes, no reference arm (test_reference.py)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "probes: off\ndistance: false\nreference: false\n")
    for plan in ("monolithic", "aligned"):
        (ws / "engines" / f"bf16_{plan}.yaml").write_text(
            f"adapter: torch\nmodel: default\ndtype: bfloat16\ndevice: cpu\nprefill: {plan}\nchunk: 256\n"
        )
    return ws


def case_runs(ws, evaluation_id):
    """The ledger's record and its {(config, repeat): {case id: result}}: the raw evidence."""
    with ledger(ws) as lg:
        record = lg.evaluation(evaluation_id)
    out: dict = {}
    for r in record["case_results"]:
        out.setdefault((r["config"], r["repeat"]), {})[r["case_id"]] = r["result"]
    return record, out


def margin(step):
    return step[0][1] - step[1][1]


def tokens(result):
    return [t["tokens"] for t in result["turns"]]


def top2(result):
    return [t["top2"] for t in result["turns"]]


@pytest.mark.slow
def test_monolithic_is_graded_by_its_records_and_aligned_is_bit_exact(run_cli, support_ws, record_property):
    code, mono = evaluate(run_cli, support_ws, "bf16_monolithic")
    s = mono["strength"]
    assert mono["exercised_share"] == 1.0  # every hit served the whole system prefix
    _, r = case_runs(support_ws, mono["evaluation_id"])
    off, on = r[("off", 0)], r[("on", 0)]
    parted = sorted(cid for cid in off if tokens(off[cid]) != tokens(on[cid]))
    moved = any(top2(off[cid]) != top2(on[cid]) for cid in off)
    record_property("monolithic_bf16", f"{mono['verdict']} {s['grade']} max drift {s['max_drift']}, parted: {parted}")
    if parted:  # a hit flipped a greedy choice (seen on an AMD EPYC with AVX-512 BF16)
        assert (code, mono["verdict"]) == (1, "FAIL") and sorted(mono["differing_cases"]) == parted, mono["reasons"]
        assert s["grade"] is None
        for cid in parted:
            (reason,) = [x for x in mono["reasons"] if x.startswith(f"differs: {cid} ")]
            assert "margin" in reason, reason
    elif moved:  # equal outputs, moved logits (seen on an Intel Xeon with AMX): never graded bit_exact
        assert (code, mono["verdict"]) == (0, "PASS"), mono["reasons"]
        assert s["grade"] == "equal_outputs" and s["max_drift"] > 0 and s["where"] is not None, s
        assert not any(x.startswith("bit_exact:") for x in mono["reasons"])
    else:  # kernels that round the hit's shapes like the cold run's (not seen so far)
        assert (code, mono["verdict"]) == (0, "PASS") and s["grade"] == "bit_exact", (s, mono["reasons"])

    code, aligned = evaluate(run_cli, support_ws, "bf16_aligned")
    assert (code, aligned["verdict"]) == (0, "PASS"), aligned["reasons"]
    assert aligned["exercised_share"] == 1.0
    s = aligned["strength"]
    assert s["grade"] == "bit_exact" and s["max_drift"] == 0.0 and s["where"] is None and s["steps"] > 0, s
    assert f"bit_exact: top-2 logits identical at all {s['steps']} generated steps of both configurations" in aligned["reasons"]
    _, r = case_runs(support_ws, aligned["evaluation_id"])
    for cid in r[("off", 0)]:  # the claim, on the raw evidence: every step's top-2 ids and logits identical
        assert top2(r[("off", 0)][cid]) == top2(r[("on", 0)][cid]), cid

    with ledger(support_ws) as lg:
        plans = {name: lg.evaluation(out["evaluation_id"])["identity"]["on"]["engine"]
                 for name, out in (("monolithic", mono), ("aligned", aligned))}
    assert plans["monolithic"]["prefill"] == "monolithic" and "chunk" not in plans["monolithic"]
    assert (plans["aligned"]["prefill"], plans["aligned"]["chunk"]) == ("aligned", 256)
    assert plans["aligned"]["dtype"] == plans["monolithic"]["dtype"] == "bfloat16"


def test_a_hit_that_flips_a_near_tie_fails_naming_it(run_cli, tiny_ws, tiny_llama):
    # Seeded noise of 1% on every restored state: on the tiny suite it flips tiny/loop's first turn at
    # a step whose flag-off margin is 0.076 (the runner-up then wins by 0.044), and leaves every other
    # step at least 0.05 from flipping: slack far above float32's rounding on any CPU.
    (tiny_ws / "engines" / "near_tie.yaml").write_text(noisy_hit_profile(tiny_llama, noise=1e-2, seed=2))
    code, out = evaluate(run_cli, tiny_ws, "near_tie")
    assert (code, out["verdict"]) == (1, "FAIL"), out["reasons"]
    assert out["tokens"]["cached_on"] > 0 and out["strength"]["grade"] is None

    record, r = case_runs(tiny_ws, out["evaluation_id"])
    off, on = r[("off", 0)], r[("on", 0)]
    # The baseline agreed with itself: the difference is the hit's.
    assert [(tokens(x), top2(x)) for x in r[("off", 1)].values()] == [(tokens(x), top2(x)) for x in off.values()]
    flipped = {}  # case -> (turn, position, flag-off top-2, flag-on top-2), recomputed from the records
    for cid in off:
        for n, (ta, tb) in enumerate(zip(off[cid]["turns"], on[cid]["turns"]), 1):
            pos = next((i for i, (x, y) in enumerate(zip(ta["tokens"], tb["tokens"])) if x != y), None)
            if pos is not None:
                flipped[cid] = (n, pos, ta["top2"][pos], tb["top2"][pos])
                break
    assert sorted(out["differing_cases"]) == sorted(flipped)
    # The gate names each flip with both tokens and margins, and calls a near-tie (both sides near a tie)
    # a near-tie, and only one side near a tie, the other ten times as far, a one-sided collapse.
    for cid, (n, pos, a, b) in flipped.items():
        ma, mb = margin(a), margin(b)
        near = max(ma, mb) <= NEAR_TIE
        collapse = next((s for s, lo, hi in (("a", ma, mb), ("b", mb, ma)) if lo <= NEAR_TIE < hi and hi >= 10 * lo), None)
        (reason,) = [r for r in out["reasons"] if r.startswith(f"differs: {cid} ")]
        assert reason.startswith(f"differs: {cid} turn {n} first divergent token at position {pos} ({a[0][0]} vs {b[0][0]}, "
                                 f"margin {ma:.4g} vs {mb:.4g}"), reason
        assert reason.endswith(", near-tie)") == near and ("one-sided collapse" in reason) == (collapse is not None), reason
        (c,) = [c for c in record["comparisons"] if c["case_id"] == cid and not c["equal"]]
        d = c["detail"]
        assert (d["pair"], d["turn"], d["first_divergent_position"], d["near_tie"], d["collapse"]) == (
            "off#0~on#0", n, pos, near, collapse)
    # What was built: the hit flipped a flag-off near-tie to its runner-up.
    assert any(margin(a) <= NEAR_TIE and b[0][0] == a[1][0] for _, _, a, b in flipped.values()), flipped
