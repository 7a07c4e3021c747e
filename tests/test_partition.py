"""Static-first partition: order, merging, and where the static prefix ends."""

from gatekeeper.battery.partition import Piece, messages, order, render


class ChatML:
    """A neighbour double: ChatML rendering, one token per character."""

    def render(self, msgs):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"

    def tokenize(self, text):
        return [ord(c) for c in text]


PIECES = [
    Piece("system", False, "Session: 7"),
    Piece("system", True, "RULES"),
    Piece("system", True, "TOOLS"),
    Piece("user", False, "question"),
]


def test_static_first_keeps_relative_order():
    assert [p.text for p in order(PIECES, "partitioned")] == ["RULES", "TOOLS", "Session: 7", "question"]
    assert order(PIECES, "as_written") == PIECES


def test_consecutive_roles_merge():
    msgs = messages(order(PIECES, "partitioned"))
    assert msgs == [
        {"role": "system", "content": "RULES\n\nTOOLS\n\nSession: 7"},
        {"role": "user", "content": "question"},
    ]


def test_static_prefix_ends_at_first_dynamic_byte():
    engine = ChatML()
    r = render(engine, PIECES, "partitioned")
    assert r.text.startswith(r.static_text) and r.static_text.endswith("RULES\n\nTOOLS\n\n")
    assert r.static_tokens == len(r.static_text)
    # as written, the dynamic session line comes first: the stable prefix is only the role header
    w = render(engine, PIECES, "as_written")
    assert w.static_text == "<|im_start|>system\n" and w.static_tokens < r.static_tokens
    assert len(w.tokens) == len(r.tokens)


def test_static_prefix_is_identical_across_cases():
    engine = ChatML()
    a = render(engine, [Piece("system", False, "Session: 1"), *PIECES[1:3], Piece("user", False, "x")], "partitioned")
    b = render(engine, [Piece("system", False, "Session: 22"), *PIECES[1:3], Piece("user", False, "yyy")], "partitioned")
    assert a.static_text == b.static_text
    assert a.tokens[: a.static_tokens] == b.tokens[: b.static_tokens]
    # each case's prefix stops exactly where its own dynamic text starts
    assert a.tokens[a.static_tokens:][:10] == engine.tokenize("Session: 1")
    assert b.tokens[b.static_tokens:][:11] == engine.tokenize("Session: 22")


def test_later_turn_extends_the_transcript():
    engine = ChatML()
    first = render(engine, PIECES, "partitioned")
    history = [*first.messages, {"role": "assistant", "content": "answer"}]
    second = render(engine, [*PIECES[:3], Piece("user", False, "follow-up")], "partitioned", history=history)
    assert second.text.startswith(first.text)
    assert second.static_tokens == first.static_tokens
    assert second.messages[-1] == {"role": "user", "content": "follow-up"}
