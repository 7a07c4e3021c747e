"""transformers' cache-free read of a sequence: one forward pass over all of it with no cache object, eager attention,
float64 where the model is small. The torch adapter's reference arm reads with it; so does the second, independent
reference beside an engine whose own cold read runs its own code (a server, mlx, llama.cpp), from the weights a
profile's ``reference_model`` names (a model folder, or a .gguf file, which transformers dequantizes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import GatekeeperError
from ..setup.models import quiet_loading
from .base import Referenced

FLOAT64_UP_TO = 50_000_000  # parameters: the read runs in float64 up to this size, float32 above (a copy that stays affordable)


def load(path: Path, device: Any = "cpu", adapt: Callable[[Any], Any] | None = None) -> Any:
    """The weights at ``path`` for reading: eager attention, float64 up to ``FLOAT64_UP_TO`` parameters, float32 above;
    ``adapt`` (a LoRA merge) applied before the cast."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model: Any
    info: dict[str, Any]
    try:
        with quiet_loading():
            model, info = AutoModelForCausalLM.from_pretrained(  # type: ignore[misc]
                str(path.parent if gguf else path), **gguf, **{dtype_arg(): torch.float32}, attn_implementation="eager",
                local_files_only=True, output_loading_info=True)
    except (OSError, ValueError) as e:
        raise GatekeeperError(f"{path}: transformers cannot read these weights for a cache-free reference ({e}); "
                              "point at a model folder or a .gguf file of an architecture transformers knows") from None
    if missing := sorted(info.get("missing_keys") or []):  # initialised at random: a reference of nothing
        raise GatekeeperError(f"{path}: transformers found no weights for {len(missing)} of the model's tensors "
                              f"({missing[0]}, ...); these weights are not in the layout transformers reads")
    if adapt is not None:
        model = adapt(model)
    if sum(p.numel() for p in model.parameters()) <= FLOAT64_UP_TO:
        model = model.double()
    return model.to(device).eval()


def read(model: Any, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]], batch: int = 1,
         where: str = "") -> Referenced:
    """``sequence`` read by ``model`` (``batch`` copies side by side, the last one kept) at the positions that predict
    its last ``steps`` tokens: ``Engine.reference``'s contract."""
    return Referenced.of(logits(model, sequence, steps, batch), asked, str(model.dtype).removeprefix("torch."),
                         f"{where} in {model.dtype}")


def stepped(model: Any, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]], cache: Any,
            cache_arg: str, where: str = "") -> Referenced:
    """``sequence`` read by ``model`` as a decode reads it: its prompt in one pass into ``cache`` (a fresh one), then
    each of the last ``steps`` tokens but the last fed alone, a row kept per step (``Engine.stepped``'s contract)."""
    import torch

    ids, cut = list(sequence), len(sequence) - steps
    rows = []
    with torch.inference_mode():
        for chunk in [ids[:cut], *([t] for t in ids[cut:-1])]:
            x = torch.tensor([chunk], dtype=torch.long, device=model.device)
            rows.append(model(input_ids=x, use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits[0, -1])
    return Referenced.of(torch.stack(rows).double().cpu().numpy(), asked, str(model.dtype).removeprefix("torch."),
                         f"{where} stepped in {model.dtype}")


def logits(model: Any, sequence: Sequence[int], steps: int, batch: int = 1) -> Any:
    """The logits (float64, numpy) at the positions that predict the last ``steps`` tokens of ``sequence``."""
    import torch

    ids = torch.tensor([list(sequence)] * batch, dtype=torch.long, device=model.device)
    with torch.inference_mode():  # no cache object: every position attends the whole sequence as written
        out = model(input_ids=ids, use_cache=False, logits_to_keep=steps + 1).logits[-1, :steps]
    return out.double().cpu().numpy()


def dtype_arg() -> str:
    """from_pretrained's dtype argument: ``torch_dtype`` before transformers 4.56 (which ignore ``dtype``)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
