"""Tiny random models built on the spot, so tests run the real loading code and download nothing.

``build_tiny_llama(dir)`` trains a small byte-level BPE tokenizer on a fixed text, builds a
2-layer llama with a fixed seed, and saves both in Hugging Face format (safetensors) with the
``rope_theta`` key mlx-lm reads. Import the ``tiny_llama`` fixture into a test module to use it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gatekeeper.setup.tiny_hybrid import CHAT_TEMPLATE, SPECIAL  # the same chat format for every tiny model

# A fixed training text: the tokenizer (and so every test's token ids) is the same on every run.
CORPUS = [
    "You are a careful assistant. Answer the question using the notes below, and say when the notes do not cover it.",
    "The router reads the request, picks a tool, and passes the arguments on. Tools: search, calendar, calculator, mail.",
    "Flights from Lisbon to Porto leave every hour between six in the morning and ten at night.",
    "The cheapest fare this week is 39 euros; the fastest train takes two hours and forty minutes.",
    "What is 2+2? The answer is 4. What is 7*6? The answer is 42. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Write a short summary of the meeting notes: the team agreed to ship on Friday, after the review.",
    "Session: user=ana, locale=pt-PT, plan=pro. Session: user=ben, locale=en-GB, plan=free.",
    "Return JSON with the keys name, date and total. {\"name\": \"Ana\", \"date\": \"2024-05-01\", \"total\": 12.5}",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "Please book the cheapest option, then send a confirmation mail to the traveller and the office.",
]


def build_tokenizer(path: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
    return fast


def build_tiny_llama(
    path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, init_std: float = 0.25
) -> Path:
    """A random llama in ``path``; ``init_std`` well above the usual 0.02 makes logits peaked
    enough that greedy outputs vary from token to token instead of repeating one id."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gatekeeper.setup.models import _add_legacy_rope_theta

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=eos,
        pad_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    _add_legacy_rope_theta(path / "config.json")
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A directory holding a tiny random llama and its tokenizer (HF format)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory) -> Path:
    """A directory holding a tiny random hybrid model (Gated DeltaNet + attention, Qwen3.5 layout)."""
    from gatekeeper.setup.tiny_hybrid import build

    return build(tmp_path_factory.mktemp("tiny-hybrid"))
