"""A tiny model with a near-tie planted in one case's first step, on purpose, not by a CPU's rounding.

``plant_near_tie`` copies a tiny llama and gives two unused tokens (their rows are tied to embeddings
no prompt uses) the output row of the case's greedy first token plus and minus a random direction,
each ``margin`` below it at that step. Any perturbation of the state then lifts one of the two by as
much as it moves along that direction: past ``margin``, the greedy choice flips, whichever way it went.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def plant_near_tie(src: Path, dst: Path, prompt: list[int], unused: set[int], *, margin: float = 1e-6,
                   size: float = 0.05, seed: int = 0) -> tuple[int, list[int]]:
    """(the first token after ``prompt``, its two planted rivals) in a copy of ``src`` written to ``dst``."""
    import torch
    from transformers import LlamaForCausalLM

    shutil.copytree(src, dst)
    model = LlamaForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        h = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        w = model.lm_head.weight  # tied to the input embeddings
        first = int(torch.argmax(w @ h))
        rivals = sorted(unused - {first})[-2:]
        r = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(seed)) * size * w[first].norm() / w.shape[1] ** 0.5
        u = r - (r @ h) / (h @ h) * h  # a direction the first step's logits do not see
        below = margin / (h @ h) * h
        w[rivals[0]] = w[first] + u - below
        w[rivals[1]] = w[first] - u - below
    model.save_pretrained(dst)
    return first, rivals
