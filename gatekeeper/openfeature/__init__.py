"""Flag states where OpenFeature looks for them, read-only: evaluations from a verified ledger and the failure
rule both sides share (``resolve``), the OpenFeature Remote Evaluation Protocol over HTTP (``ofrep``, served by
``gatekeeper flags serve``), and an in-process provider for the OpenFeature Python SDK (``provider``).

An unverifiable or unreadable ledger is an error on every evaluation, never the last known "on".
``GatekeeperProvider`` is loaded on first use: the SDK (``pip install gatekeeper[openfeature]``) is optional,
and the CLI, which serves OFREP, never imports it.

Imports: errors, identity, listen, workspace, engines, gate, ledger.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatekeeperProvider"]


def __getattr__(name: str) -> Any:
    if name == "GatekeeperProvider":
        from .provider import GatekeeperProvider

        return GatekeeperProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
