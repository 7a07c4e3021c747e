"""A tiny random hybrid model (Qwen3.5 layout: Gated DeltaNet layers plus full attention), built locally.

For replays and tests of snapshot reuse without downloading anything: a byte-level BPE tokenizer
trained on a fixed text and a randomly initialised ``Qwen3_5ForCausalLM`` with a fixed seed, saved
in Hugging Face format so the real loading code runs on it. Its outputs mean nothing; its state
behaves like a real hybrid model's (recurrent layers that cannot be rolled back). transformers runs
it on CPU without custom kernels (the reference PyTorch paths).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "You are a careful assistant. Answer the question using the notes below, and say when the notes do not cover it.",
    "The router reads the request, picks a tool, and passes the arguments on. Tools: search, calendar, calculator, mail.",
    "Flights from Lisbon to Porto leave every hour between six in the morning and ten at night.",
    "What is 2+2? The answer is 4. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Return JSON with the keys name, date and total. {\"name\": \"Ana\", \"date\": \"2024-05-01\", \"total\": 12.5}",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
]
# Three Gated DeltaNet layers then one full-attention layer, the ratio Qwen3-Next and Qwen3.5 use.
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _tokenizer(path: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def build(path: Path, *, seed: int = 0, hidden: int = 64, init_std: float = 0.25, vocab_size: int = 512) -> Path:
    """Write the model and tokenizer to ``path``; ``init_std`` well above 0.02 makes greedy outputs
    vary from token to token, so a wrong state shows in the tokens."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, vocab_size)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        # Rotary on a quarter of each head (8 dims, 4 pairs); llama.cpp needs the multimodal
        # sections to fit them (its default [11, 11, 10] is for 256-dim heads). Text positions are
        # the same on every axis, so the sections do not change the model's outputs.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=16384, initializer_range=init_std, tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=eos, pad_token_id=eos,
    )
    torch.manual_seed(seed)
    # transformers wraps ``to`` with functools.wraps, whose typeshed stub does not bind ``self``
    model = Qwen3_5ForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]
    # Random init draws decay rates up to 16 per token, so the recurrent state forgets within a few
    # tokens; slow decays (as trained models learn) make it carry the prefix, as a real one does.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-7.0, -3.0)
    from .models import quiet_loading

    with quiet_loading():
        model.save_pretrained(path)
    return path


def ensure(root: Path | None = None) -> Path:
    """The tiny hybrid model under ``$GATEKEEPER_HOME/models/tiny-hybrid``, built on first use."""
    from .models import home

    path = (root or home() / "models") / "tiny-hybrid"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        build(path)
    return path
