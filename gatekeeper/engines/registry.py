"""Profile -> engine: built-ins by name, plugins by ``package.module:Class``, ``auto`` by platform.

Nothing heavy is imported here: an adapter's module (torch, mlx, transformers) loads only when
that adapter is built.
"""

from __future__ import annotations

import importlib
import inspect
import platform
import sys
from pathlib import Path
from typing import Any

from ..errors import GatekeeperError
from ..summaries import SamplerChain
from ..workspace import EngineProfile
from .base import Engine

BUILTINS = {
    "torch": "gatekeeper.engines.torch:TorchEngine",
    "mlx": "gatekeeper.engines.mlx:MLXEngine",
    "llamacpp": "gatekeeper.engines.llamacpp:LlamaCppEngine",
    "http": "gatekeeper.engines.served.http:HTTPEngine",
}


def is_apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    return (system or sys.platform) == "darwin" and (machine or platform.machine()) == "arm64"


def resolve_adapter(adapter: str, *, system: str | None = None, machine: str | None = None) -> str:
    """``auto`` becomes ``mlx`` on Apple Silicon and ``torch`` elsewhere; anything else is kept."""
    if adapter == "auto":
        return "mlx" if is_apple_silicon(system, machine) else "torch"
    return adapter


def resolve_profile(profile: EngineProfile) -> EngineProfile:
    """The profile with its adapter resolved, so identity records what actually runs."""
    adapter = resolve_adapter(profile.adapter)
    return profile if adapter == profile.adapter else profile.model_copy(update={"adapter": adapter})


def engine_class(adapter: str) -> type[Engine]:
    target = BUILTINS.get(adapter, adapter)
    if ":" not in target:
        raise GatekeeperError(
            f"unknown engine adapter {adapter!r}; use one of: auto, {', '.join(BUILTINS)}, "
            "or an import path package.module:Class"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise GatekeeperError(f"engine adapter {adapter!r}: cannot import {module_name} ({e}); install it or fix the path") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise GatekeeperError(f"engine adapter {adapter!r}: {module_name} has no {class_name}; fix the class name")
    if not (inspect.isclass(cls) and issubclass(cls, Engine)):
        raise GatekeeperError(f"engine adapter {adapter!r}: {target} is not a subclass of gatekeeper.engines.base.Engine")
    return cls


def check_profile(profile: EngineProfile) -> type[Engine]:
    """The adapter class a profile names, once it has accepted the profile (nothing is loaded)."""
    cls = engine_class(resolve_profile(profile).adapter)
    cls.check(profile)
    return cls


def build_engine(profile: EngineProfile, *, workspace_root: Path | None = None) -> Engine:
    """The model a profile describes, loaded once; open a session per configuration on it."""
    profile = resolve_profile(profile)
    if profile.python is not None:  # the adapter runs in its own environment: the worker checks it there
        from .worker import WorkerEngine

        return WorkerEngine(profile, workspace_root=workspace_root)
    cls = check_profile(profile)
    # Built-ins resolve relative model paths against the workspace; a plugin gets the root if it asks.
    if "workspace_root" in inspect.signature(cls).parameters:
        return cls(profile, workspace_root=workspace_root)
    return cls(profile)


def identity(profile: EngineProfile, *, workspace_root: Path | None = None) -> dict[str, Any]:
    """The identity a model loaded from ``profile`` reports, without loading its weights where the
    adapter can tell it from its files (``Engine.identity_of``); otherwise the model is loaded and asked.
    A subclass that redefines ``identity`` or where it finds its files (``_locate``) below the class that
    computes ``identity_of`` is loaded: the inherited computation would not know what it changed."""
    profile = resolve_profile(profile)
    if profile.python is not None:  # its versions are the other environment's: asked there
        with build_engine(profile, workspace_root=workspace_root) as model:
            return model.identity()
    cls = check_profile(profile)
    if all(issubclass(_owner(cls, "identity_of"), _owner(cls, name)) for name in ("identity", "_locate") if hasattr(cls, name)):
        known = cls.identity_of(profile, workspace_root=workspace_root)
        if known is not None:
            return known
    with build_engine(profile, workspace_root=workspace_root) as model:
        return model.identity()


def sampler_chain(profile: EngineProfile) -> SamplerChain | None:
    """The sampler the profile's adapter runs a sampled suite through (``Engine.sampler_chain``), with no load."""
    profile = resolve_profile(profile)
    return engine_class(profile.adapter).sampler_chain(profile)


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))
