"""The gate shows both plans on the default model in bfloat16 (CPU): a cache hit under the
monolithic plan flips greedy near-ties, and the gate FAILs naming them; under the aligned plan the
same suite PASSes, because the cold run is cut where the hit lands.

The cases were picked by experiment: over 37 support-desk requests sharing an 861-token system
prefix, 7 flipped under monolithic (the issue measured 2 of 12). Which requests flip depends on the
CPU's bf16 kernels; on another machine the FAIL half may need other cases.
"""

from __future__ import annotations

import pytest
import yaml

from gatekeeper.setup.models import is_prepared, prepare_default_model
from gatekeeper.setup.scaffold import init_workspace

# (case id, query, flips under monolithic here): distinct first words, so every hit lands exactly
# on the system prefix whatever the order.
CASES = [
    ("parcel", "my parcel has not moved for a week, tracking 1Z999AA10123456784", True),
    ("hoodie", "do you have the green hoodie in size L?", True),
    ("cancel", "please cancel order A-640022", False),
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
        "cases": [{"id": cid, "vars": {"query": q}, "assert": [{"type": "min-length", "value": 1}]} for cid, q, _ in CASES],
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
    for plan in ("monolithic", "aligned"):
        (ws / "engines" / f"bf16_{plan}.yaml").write_text(
            f"adapter: torch\nmodel: default\ndtype: bfloat16\ndevice: cpu\nprefill: {plan}\nchunk: 256\n"
        )
    return ws


@pytest.mark.slow
def test_monolithic_fails_on_near_ties_and_aligned_passes(run_cli, support_ws):
    from conftest import evaluate, ledger

    code, mono = evaluate(run_cli, support_ws, "bf16_monolithic")
    flips = sorted(f"support/{cid}" for cid, _, flips in CASES if flips)
    assert (code, mono["verdict"]) == (1, "FAIL"), mono["reasons"]
    assert sorted(mono["differing_cases"]) == flips
    for cid in flips:
        (reason,) = [r for r in mono["reasons"] if r.startswith(f"differs: {cid} ")]
        assert "margin" in reason and "near-tie" in reason, reason

    code, aligned = evaluate(run_cli, support_ws, "bf16_aligned")
    assert (code, aligned["verdict"]) == (0, "PASS"), aligned["reasons"]
    assert aligned["exercised_share"] == 1.0  # every hit served the whole system prefix

    with ledger(support_ws) as lg:
        plans = {name: lg.evaluation(out["evaluation_id"])["identity"]["on"]["engine"]
                 for name, out in (("monolithic", mono), ("aligned", aligned))}
    assert plans["monolithic"]["prefill"] == "monolithic" and "chunk" not in plans["monolithic"]
    assert (plans["aligned"]["prefill"], plans["aligned"]["chunk"]) == ("aligned", 256)
    assert plans["aligned"]["dtype"] == "bfloat16"
