"""What an OpenAI-compatible server says a call cost, read from the answer as it came back.

Servers report in different places, and some not at all; a figure a server does not report is
``None``, never 0, so a blind server cannot pass for one that served nothing from its cache.

- llama.cpp's llama-server: ``timings`` (``cache_n`` reused, ``prompt_n`` computed, ``prompt_ms``,
  ``predicted_ms``); ik_llama.cpp's ``timings`` has no ``cache_n``, so the cached count comes
  from ``usage``.
- vLLM, mlx_lm.server, OpenAI: ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``
  (vLLM only with ``--enable-prompt-tokens-details``); vLLM's per-request ``metrics`` (with
  ``--enable-per-request-metrics``) carry ``time_to_first_token_ms`` (scheduled to first token: the
  prefill) and ``generation_time_ms`` (first to last token: the decode).
- SGLang's ``/generate``: ``meta_info`` (``prompt_tokens``, ``cached_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ...summaries import CallTelemetry


@dataclass(frozen=True)
class Telemetry:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    def to_dict(self) -> CallTelemetry:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s}


def _number(value: Any, kind: type = int) -> Any:
    """``value`` as ``kind`` when it is a real number (bools and strings are not), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def _seconds(block: Mapping[str, Any], *keys: str, scale: float = 1.0) -> float | None:
    for key in keys:
        value = _number(block.get(key), float)
        if value is not None:
            return value * scale
    return None


def _block(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``parent[key]`` when it is a mapping, else an empty one."""
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def read(answer: Any) -> Telemetry:
    """The telemetry in one completion answer (a JSON object; a streamed call's last chunk with
    ``usage``/``timings`` works too). Anything unrecognised reads as not reported."""
    if not isinstance(answer, Mapping):
        return Telemetry()
    usage = _block(answer, "usage")
    details = _block(usage, "prompt_tokens_details")
    timings = _block(answer, "timings")
    meta = _block(answer, "meta_info")
    metrics = _block(answer, "metrics")

    prompt = _number(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = _number(meta.get("prompt_tokens"))
    if prompt is None and _number(timings.get("prompt_n")) is not None:
        prompt = _number(timings["prompt_n"]) + (_number(timings.get("cache_n")) or 0)

    cached = _number(timings.get("cache_n"))
    if cached is None:
        cached = _number(details.get("cached_tokens"))
    if cached is None:
        cached = _number(meta.get("cached_tokens"))

    prefill = _seconds(timings, "prompt_ms", scale=1e-3)
    decode = _seconds(timings, "predicted_ms", scale=1e-3)
    if prefill is None:
        prefill = _seconds(metrics, "time_to_first_token_ms", scale=1e-3)
    if decode is None:
        decode = _seconds(metrics, "generation_time_ms", scale=1e-3)
    return Telemetry(prompt, cached, prefill, decode)
