"""Text <-> tokens through a Hugging Face tokenizer, shared by the torch and mlx adapters.

Both adapters use this one code path, so the same model directory gives the same token ids and
the same text whichever runtime does the arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import GatekeeperError


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class ChatTokenizer:
    def __init__(self, tokenizer: Any, model_dir: Path):
        self.hf = tokenizer
        self.model_dir = model_dir
        self.eos_ids = frozenset(_eos_ids(tokenizer, model_dir))

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise GatekeeperError(f"the tokenizer in {self.model_dir} has no chat template; add chat_template.jinja to it")
        # transformers 5 returns a BatchEncoding when tokenizing here, so render to text only.
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.hf.decode(list(tokens), skip_special_tokens=False)


def _eos_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """The tokenizer's EOS plus every EOS id the generation config names."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    return ids
