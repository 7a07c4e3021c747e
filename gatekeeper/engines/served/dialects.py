"""How each OpenAI-compatible server is spoken to: rendering and tokenizing, the completion request,
where token ids and top-2 logprobs come back, and the granularity of its prefix cache.

- ``llamacpp`` (llama-server, ik_llama.cpp): ``/apply-template``, ``/tokenize``, ``/detokenize``;
  token-id prompts; ``logprobs.content`` with ids; the cache switched per request (``cache_prompt``)
  or by two deployments.
- ``vllm``: ``/tokenize`` (text, or messages with the generation prompt) and ``/detokenize``;
  token-id prompts; ``choices[0].token_ids`` with ``return_token_ids`` and legacy logprobs (keys
  ``token_id:N`` with ``--return-tokens-as-token-ids``, else token text); prefix caching is a
  deployment switch and caches whole KV blocks, whose size ``/metrics`` reports.
- ``mlx`` (mlx_lm.server) and ``openai`` (any other, e.g. llama-cpp-python's server): no
  tokenize endpoint, so the profile's ``tokenizer`` folder renders and tokenizes locally and
  prompts go as text; mlx returns ``logprobs.content`` with ids, others what they return.

SGLang is not here: its package needs CUDA to install and serve, so a dialect for it could not be
tested against the real server on a CPU machine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, ClassVar, Mapping, Protocol, Sequence

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # importing typing_extensions costs every CLI start 20 ms: only where typing lacks these
    from typing_extensions import TypedDict

from ...errors import GatekeeperError
from ...summaries import SamplerChain
from ...workspace import Decoding, EngineProfile
from ..sampler import Draw

PROMPT_TOP_K = 20  # vLLM's default --max-logprobs: the most prompt log-probabilities a position returns
_BLOCK = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)


# --- the wire: what a server is sent and what it answers ------------------------------------------------------
# A server's answer is another program's JSON: every field is optional (total=False), and the code that reads one
# catches what is missing or malformed. Where it is kept whole without being read (a listed model's ``meta``, a
# ``/props`` field), it is an opaque ``ServerJSON`` object.

ServerJSON = dict[str, Any]  # a JSON object from an outside server, kept as it came: never a shape gatekeeper reads


class CompletionRequest(TypedDict, total=False):
    """The fields of a ``/v1/completions`` request a dialect sets (the engine adds the profile's own and its cache
    switch)."""

    prompt: list[int] | str
    max_tokens: int
    stop: list[str]
    logprobs: int | bool  # how many top log-probabilities per step (mlx, OpenAI: whether to give them)
    top_logprobs: int
    return_token_ids: bool  # vLLM
    prompt_logprobs: int  # vLLM
    cache_prompt: bool  # llama.cpp
    temperature: float
    top_k: int | None
    top_p: float
    min_p: float
    repeat_penalty: float  # llama.cpp's name
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    repeat_last_n: int  # llama.cpp
    repetition_context_size: int  # mlx_lm.server
    samplers: list[str]  # llama.cpp's chain
    seed: int


class Candidate(TypedDict, total=False):
    """One of a step's top candidates (``logprobs.content[i].top_logprobs``): its id where the server gives one."""

    id: int
    token: str
    logprob: float


class StepLogprobs(Candidate, total=False):
    """One generated step (``logprobs.content[i]``: llama.cpp, mlx_lm.server): the token and its top candidates."""

    top_logprobs: list[Candidate]


class Logprobs(TypedDict, total=False):
    """A choice's ``logprobs``: per step with ids (``content``), or the legacy per-step ``{token: logprob}`` lists."""

    content: list[StepLogprobs]
    top_logprobs: list[dict[str, float]]


class PromptLogprob(TypedDict):
    """One candidate at a prompt position (vLLM's ``prompt_logprobs``, keyed by token id)."""

    logprob: float
    rank: int


class Choice(TypedDict, total=False):
    """A completion's choice as the dialects read it."""

    text: str
    logprobs: Logprobs  # every dialect asks for them (a server that does not give them may send null)
    token_ids: list[int]  # vLLM with return_token_ids
    # vLLM's prompt_logprobs, one per prompt position: null at the first, which no reader reads (they read the
    # positions after a non-empty prompt, or the last)
    prompt_logprobs: list[dict[str, PromptLogprob]]


class Completion(TypedDict, total=False):
    """A ``/v1/completions`` answer: its choices (what a call cost, ``usage``/``timings``, ``telemetry`` reads)."""

    choices: list[Choice]


class ListedModel(TypedDict, total=False):
    """A model as ``/v1/models`` lists it, with the fields that name it (``created`` varies per request)."""

    id: str
    owned_by: str | None  # vllm on vLLM; absent on mlx_lm.server
    meta: ServerJSON  # llama.cpp's model metadata
    root: str
    max_model_len: int  # vLLM


class Props(TypedDict, total=False):
    """The fields of llama.cpp's ``GET /props`` that describe a deployment and do not change while it runs."""

    model_path: str
    build_info: str
    chat_template: str
    total_slots: int
    modalities: ServerJSON
    model_alias: str
    n_ctx: int | None  # from default_generation_settings


class Described(TypedDict):
    """What a server says it serves (``HTTPEngine._describe``): its URL, model list and llama.cpp's ``/props`` (empty
    elsewhere); the identity records it."""

    url: str
    models: list[ListedModel]
    props: Props


class Server(Protocol):
    """What a dialect needs of the engine that speaks it (``http.HTTPEngine``): the dependency runs one way."""
    profile: EngineProfile
    dialect_name: str | None
    workspace_root: Path | None
    model_ids: dict[str, str | None]

    def text_op(self, path: str, body: Mapping[str, object], field: str) -> Any: ...

    def call_text(self, url: str, path: str) -> str: ...


class Dialect:
    name: ClassVar[str]
    token_prompts: ClassVar[bool] = True  # prompts go as token ids (else as text, tokenized by the server)
    local_tokenizer: ClassVar[bool] = False  # renders and tokenizes with the profile's ``tokenizer``
    # why the server gives no teacher-forced distributions (None: ``score_request`` asks it for them)
    unscored: ClassVar[str | None] = "the server's API returns no log-probabilities for a prompt's positions"
    # what its distributions leave out, where it gives them (gate/arms/forced.py puts it in the record)
    score_caveat: ClassVar[str | None] = None
    # why the server gives no cache-free read for the reference arm (None: ``score_request`` or ``forced_request``
    # reads one), and what that read is, as the reference arm's record names it
    unreferenced: ClassVar[str | None] = ("the server's API gives no cache-free read of a prompt's positions "
                                          "(no prompt log-probabilities, no way to turn its cache off per request)")
    reference_read: ClassVar[str] = "server"
    # the server's own sampler as its documentation states it (chain order, what each penalty counts, its seed); None:
    # gatekeeper decodes greedy only on this server
    sampler: ClassVar[SamplerChain | None] = None

    def __init__(self, engine: Server):
        self.engine = engine
        self.tokenizer = _local_tokenizer(engine) if self.local_tokenizer else None

    # --- text <-> tokens ----------------------------------------------------------------------
    # (these three for ``local_tokenizer`` dialects: the others override them)
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.render(messages)

    def tokenize(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.detokenize(tokens)

    # --- a completion -------------------------------------------------------------------------
    def request(self, prompt: list[int]) -> CompletionRequest:
        """The prompt and the fields that ask for top-2 logprobs and token ids."""
        return {"prompt": prompt if self.token_prompts else self.detokenize(prompt), "logprobs": 2}

    def step_token(self, step: StepLogprobs) -> int:
        """The generated token of one ``logprobs.content`` step."""
        return int(step["id"])

    def score_request(self, tokens: list[int]) -> CompletionRequest | None:
        """The completion request that returns the top log-probabilities at every position of ``tokens``."""
        return None

    def sampling(self, draw: Draw, length: int) -> CompletionRequest:
        """The request fields that run ``draw``'s decoding with its seed (only where ``sampler`` is set), and ask for
        each step's token id and top log-probabilities; ``length``: the prompt's tokens and the most the answer may add
        (what a penalty window must hold)."""
        raise NotImplementedError(self.name)

    def unsampled(self, decoding: Decoding) -> str | None:
        """Why this server cannot run ``decoding`` as gatekeeper declares it; None: it can."""
        return None

    def forced_request(self, prefix: list[int], cache: bool = False) -> CompletionRequest | None:
        """The completion request that returns the top log-probabilities of the one token after ``prefix``, with the
        server's prompt cache off, or on with ``cache`` (one forced position per request, where ``score_request`` has
        none)."""
        return None

    def forceable(self, prefix: list[int]) -> bool:
        """Whether ``forced_request(prefix)`` reaches the server as these very tokens."""
        return True

    def granularity(self, url: str) -> int:
        """Tokens per unit the server's prefix cache reuses (1: any prefix)."""
        return 1


class LlamaCpp(Dialect):
    name = "llamacpp"
    unscored = None
    # it gives probabilities only for the tokens it generates (n_probs), never for a prompt's positions (it refuses echo)
    score_caveat = ("llama-server gives no prompt log-probabilities, so the distance is read at the first, middle and "
                    "last position of each answer, one request each (its top 20, the rest lumped); the flag-on side "
                    "reads with its prompt cache on")
    unreferenced = None
    reference_read = "llama-server (cache_prompt off, one forced position per request)"

    def render(self, messages):
        return self.engine.text_op("/apply-template", {"messages": [dict(m) for m in messages]}, "prompt")

    def tokenize(self, text):
        tokens = self.engine.text_op("/tokenize", {"content": text, "add_special": False, "parse_special": True}, "tokens")
        return [int(t["id"] if isinstance(t, dict) else t) for t in tokens]

    def detokenize(self, tokens):
        return self.engine.text_op("/detokenize", {"tokens": [int(t) for t in tokens]}, "content")

    def forced_request(self, prefix, cache=False):
        return {"prompt": prefix, "max_tokens": 1, "logprobs": PROMPT_TOP_K, "cache_prompt": cache}

    # llama.cpp's common_params_sampling: its chain is the request's ``samplers``, sent as the order below; the
    # penalties count the last ``repeat_last_n`` tokens of prompt and answer (sent as long as both together)
    sampler = {"sampler": "llama-server", "chain": ["penalties", "top_k", "top_p", "min_p", "temperature"],
               "window": {"repetition_penalty": "prompt+answer", "presence_penalty": "prompt+answer",
                          "frequency_penalty": "prompt+answer"}, "draw": "the server's generator, seeded per request"}

    def sampling(self, draw, length):
        d = draw.decoding
        return {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                "repeat_penalty": d.repetition_penalty, "presence_penalty": d.presence_penalty,
                "frequency_penalty": d.frequency_penalty, "repeat_last_n": length,
                "samplers": self.sampler["chain"] if self.sampler else [], "logprobs": PROMPT_TOP_K, **_seed(draw)}


class VLLM(Dialect):
    name = "vllm"
    unscored = None
    # vLLM's Request sets skip_reading_prefix_cache for any request with prompt_logprobs (v0.32.0)
    score_caveat = ("vLLM reads no cached prefix for a request that asks for prompt log-probabilities, so the "
                    "flag-on side is read without its prefix cache: this distance sees what else the flag changes")
    unreferenced = None
    reference_read = "vLLM (prompt log-probabilities, never read from its prefix cache)"

    def render(self, messages):
        tokens = self.engine.text_op("/tokenize", {"messages": [dict(m) for m in messages], "add_generation_prompt": True,
                                                   **self._model()}, "tokens")
        return self.detokenize(tokens)

    def tokenize(self, text):
        return [int(t) for t in self.engine.text_op("/tokenize", {"prompt": text, "add_special_tokens": False,
                                                                  **self._model()}, "tokens")]

    def detokenize(self, tokens):
        return self.engine.text_op("/detokenize", {"tokens": [int(t) for t in tokens], **self._model()}, "prompt")

    def _model(self) -> dict[str, str]:
        model = self.engine.model_ids["off"]
        return {"model": model} if model else {}

    def request(self, prompt):
        return {"prompt": prompt, "logprobs": 2, "return_token_ids": True}

    # vLLM's Sampler (v1, vllm/v1/sample/sampler.py): penalties (repetition over prompt and output, presence and
    # frequency over the output), temperature, min-p, then top-k and top-p; a request's seed gives it its own generator
    sampler = {"sampler": "vllm", "chain": ["penalties", "temperature", "min_p", "top_k", "top_p"],
               "window": {"repetition_penalty": "prompt+answer", "presence_penalty": "answer",
                          "frequency_penalty": "answer"}, "draw": "a generator per request, seeded by it"}

    def sampling(self, draw, length):
        d = draw.decoding
        return {"temperature": d.temperature, "top_k": d.top_k or -1, "top_p": d.top_p, "min_p": d.min_p,
                "repetition_penalty": d.repetition_penalty, "presence_penalty": d.presence_penalty,
                "frequency_penalty": d.frequency_penalty, "logprobs": PROMPT_TOP_K, **_seed(draw)}

    def score_request(self, tokens):
        return {"prompt": tokens, "prompt_logprobs": PROMPT_TOP_K, "max_tokens": 1}

    def granularity(self, url):
        try:
            metrics = self.engine.call_text(url, "/metrics")
        except GatekeeperError:
            return 1
        found = _BLOCK.search(metrics)
        return int(found.group(1)) if found else 1


class MLX(Dialect):
    name = "mlx"
    unscored = None
    # it gives log-probabilities only for the tokens it generates (top_logprobs), never for a prompt's positions
    score_caveat = ("mlx_lm.server gives no prompt log-probabilities, so the distance is read at the first, middle and "
                    "last position of each answer, one request each (its top 10, the rest lumped), where the tokens "
                    "before it come back from their text through the tokenizer (the others are left out)")
    unreferenced = None
    reference_read = "mlx_lm.server (its flag-off deployment, one forced position per request, text round-tripped)"
    token_prompts = False
    local_tokenizer = True
    TOP = 10  # mlx_lm.server gives at most 11 top log-probabilities per step

    def forceable(self, prefix):
        # a text prompt: the forced tokens reach the server only if their text tokenizes back to them
        return self.tokenize(self.detokenize(prefix)) == list(prefix)

    def forced_request(self, prefix, cache=False):
        text = self.detokenize(prefix)
        if not self.forceable(prefix):
            raise GatekeeperError(f"{self.engine.profile.where}: a reference read's {len(prefix)} tokens do not come back "
                                  "from their text through the tokenizer, so mlx_lm.server would read other tokens; set "
                                  "'reference: false' in the policy for this server")
        return {"prompt": text, "max_tokens": 1, "logprobs": True, "top_logprobs": self.TOP}

    def request(self, prompt):
        return {"prompt": self.detokenize(prompt), "logprobs": True, "top_logprobs": 2}

    # mlx_lm.sample_utils (0.32): the logits processors (a repetition penalty over the last N tokens the generation
    # loop processed), then top-p, min-p and top-k on the log-probabilities, then the temperature; the request's seed
    # reseeds mlx's generator before the draw
    sampler = {"sampler": "mlx_lm.server", "chain": ["penalties", "top_p", "min_p", "top_k", "temperature"],
               "window": {"repetition_penalty": "prompt+answer"}, "draw": "mlx's generator, reseeded per request"}

    def sampling(self, draw, length):
        d = draw.decoding
        # no top lists: with them it labels each step with the first listed, not the token drawn; the token ids alone
        return {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p,
                "repetition_penalty": d.repetition_penalty, "repetition_context_size": length, "logprobs": True,
                "top_logprobs": 0, **_seed(draw)}

    def unsampled(self, decoding):
        if decoding.presence_penalty or decoding.frequency_penalty:
            return ("counts presence and frequency penalties over the prompt too (the last N tokens it processed), not "
                    "over the answer as declared")
        return None

    def step_token(self, step):
        # mlx_lm.server labels each step with the first of its top-N, in no set order; greedy took the best
        top = step.get("top_logprobs") or []
        return int(max(top, key=lambda t: t["logprob"])["id"]) if top else int(step["id"])


class OpenAI(Dialect):
    name = "openai"
    token_prompts = False
    local_tokenizer = True

    # llama-cpp-python's server (0.3; the OpenAI-compatible server this project runs): Llama._init_sampler builds
    # llama.cpp's chain, penalties over the server's last_n_tokens_size tokens, top-k, top-p, min-p, the temperature,
    # and a draw seeded by the request's seed
    sampler = {"sampler": "llama-cpp-python", "chain": ["penalties", "top_k", "top_p", "min_p", "temperature"],
               "window": {}, "draw": "llama.cpp's dist sampler, seeded per request"}

    def sampling(self, draw, length):
        d = draw.decoding
        # every field sent: the server's own defaults (top_k 40, min_p 0.05, repeat_penalty 1.1) would filter otherwise
        return {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, **_seed(draw)}

    def unsampled(self, decoding):
        if decoding.repetition_penalty != 1.0 or decoding.presence_penalty or decoding.frequency_penalty:
            return ("counts penalties over its last_n_tokens_size tokens (a server setting, 64 by default), not over "
                    "the prompt and answer as declared")
        return None


DIALECTS: dict[str, type[Dialect]] = {d.name: d for d in (LlamaCpp, VLLM, MLX, OpenAI)}


def detect(described: Described) -> tuple[str, str]:
    """The dialect a server speaks, from what ``/v1/models`` and ``/props`` said, and why."""
    props = described.get("props") or {}
    owners = {m.get("owned_by") for m in described.get("models") or []}
    if props:
        return "llamacpp", "GET /props answered (llama.cpp's server)"
    if "vllm" in owners:
        return "vllm", "/v1/models says owned_by vllm"
    if described.get("models") and owners == {None}:
        return "mlx", "/v1/models lists models without owned_by (mlx_lm.server)"
    return "openai", f"no llama.cpp /props, owned_by {sorted(map(str, owners))}"


def _local_tokenizer(engine: Server):
    from ...setup.models import resolve_model
    from ..hf_tokenizer import ChatTokenizer, load_tokenizer

    spec = engine.profile.tokenizer
    if not spec:
        raise GatekeeperError(f"{engine.profile.where}: field 'tokenizer' is required for dialect {engine.dialect_name}: "
                              "this server has no tokenize endpoint; set it to the served model's folder (its "
                              "tokenizer and chat template), or 'default' for the prepared default model")
    folder = resolve_model(spec, engine.workspace_root) if spec == "default" else Path(spec).expanduser()
    if not folder.is_absolute() and engine.workspace_root is not None:
        folder = engine.workspace_root / folder
    try:
        return ChatTokenizer(load_tokenizer(folder), folder)
    except (OSError, ValueError) as e:
        raise GatekeeperError(f"{engine.profile.where}: field 'tokenizer': cannot load a tokenizer from {folder} ({e}); "
                              "point it at a Hugging Face-format folder with tokenizer.json") from None


def _seed(draw: Draw) -> dict[str, int]:
    """The request's seed field; none for an unseeded draw (the server draws as it likes)."""
    return {"seed": draw.seed} if draw.seeded else {}
