"""An in-process OpenFeature provider: a Python pipeline reads gatekeeper's flags through the OpenFeature SDK.

    from openfeature import api
    from gatekeeper.openfeature import GatekeeperProvider

    api.set_provider_and_wait(GatekeeperProvider(workspace="path/to/workspace"))  # verifies the ledger once
    api.get_client().get_boolean_value("prefix_cache", False)

It answers what ``gatekeeper flags serve`` answers (the same ``Resolver``): values, variants, reasons and
metadata from the verified ledger; an unknown flag is FLAG_NOT_FOUND, a ledger that does not verify or cannot
be read is GENERAL (the SDK then returns the caller's default with that error code), and a flag asked for as
another type than boolean is TYPE_MISMATCH. The one module that imports the SDK (``gatekeeper[openfeature]``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from openfeature.evaluation_context import EvaluationContext
from openfeature.exception import FlagNotFoundError, GeneralError, TypeMismatchError
from openfeature.flag_evaluation import FlagResolutionDetails, Reason
from openfeature.provider import AbstractProvider, Metadata

from .resolve import FlagNotFound, Resolution, Resolver, Unservable


class GatekeeperProvider(AbstractProvider):
    def __init__(self, workspace: str | os.PathLike | None = None, *, ledger: str | None = None,
                 engine: str = "auto"):
        super().__init__()
        self.resolver = Resolver(workspace, ledger=ledger, engine=engine)

    def get_metadata(self) -> Metadata:
        return Metadata(name="gatekeeper")

    def initialize(self, evaluation_context: EvaluationContext) -> None:
        self.resolver.snapshot()  # verify and compute the pipeline hash once, before the first evaluation

    def shutdown(self) -> None:
        self.resolver.close()

    def _resolve(self, key: str) -> Resolution:
        try:
            return self.resolver.resolve(key)
        except FlagNotFound as e:
            raise FlagNotFoundError(str(e)) from None
        except Unservable as e:
            raise GeneralError(str(e)) from None

    def _not_boolean(self, key: str, asked: str) -> Any:
        self._resolve(key)  # an unknown flag or a bad ledger says so first
        raise TypeMismatchError(f"flag {key!r} is a boolean (on/off), not {asked}; use get_boolean_value")

    def resolve_boolean_details(self, flag_key: str, default_value: bool,
                                evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[bool]:
        r = self._resolve(flag_key).for_key(evaluation_context.targeting_key if evaluation_context else None)
        return FlagResolutionDetails(value=r.value, reason=Reason(r.reason), variant=r.variant,
                                     flag_metadata=dict(r.metadata))

    def resolve_string_details(self, flag_key: str, default_value: str,
                               evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[str]:
        return self._not_boolean(flag_key, "a string")

    def resolve_integer_details(self, flag_key: str, default_value: int,
                                evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[int]:
        return self._not_boolean(flag_key, "an integer")

    def resolve_float_details(self, flag_key: str, default_value: float,
                              evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[float]:
        return self._not_boolean(flag_key, "a float")

    def resolve_object_details(
        self, flag_key: str, default_value: Sequence[Any] | Mapping[str, Any],
        evaluation_context: EvaluationContext | None = None,
    ) -> FlagResolutionDetails[Sequence[Any] | Mapping[str, Any]]:
        return self._not_boolean(flag_key, "an object")
