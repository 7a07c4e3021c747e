"""A served engine's twin: an in-process engine on the same weights, where calibration can plant faults.

A server's prefix cache is out of reach, so ``calibrate --twin ENGINE`` plants the faults in the twin
and records the calibration against the served evaluation. The twin must load the weights the
deployment serves: the served weights are found from what the server reported when it was evaluated
(llama.cpp's ``model_path``, vLLM's model ``root``, a model id that names a local path) and digested
here; a model directory made by ``models prepare`` counts as the GGUF it was converted from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import GatekeeperError
from ...identity import directory_digest, file_digest
from ...summaries import TwinRecord


def served_weights(engine_identity: dict[str, Any]) -> list[Path]:
    """The local weights each server of an http engine identity reported serving (one per server)."""
    found = []
    for server in (engine_identity.get("servers") or {}).values():
        named = [server.get("props", {}).get("model_path"),
                 *(m.get(k) for m in server.get("models", []) for k in ("root", "id"))]
        local = next((Path(n) for n in named if isinstance(n, str) and n and Path(n).exists()), None)
        if local is None:
            raise GatekeeperError(f"the served deployment at {server.get('url')} names no weights on this machine "
                                  f"({', '.join(str(n) for n in named if n) or 'no model path'}); a twin can be checked "
                                  "only against weights it can read: run the server on this machine's model files")
        found.append(local)
    return found


def digests(path: Path) -> set[str]:
    """What ``path``'s weights are: their digest and, for a converted model directory, its source GGUF's."""
    out = {directory_digest(path)}
    marker = path / "gatekeeper.json"
    if path.is_dir() and marker.is_file():
        source = json.loads(marker.read_text()).get("source_digest")
        if source:
            out.add(source)
    return out


def check(engine_identity: dict[str, Any], twin_weights: Path, twin_name: str) -> TwinRecord:
    """The match between the served weights and the twin's, or GatekeeperError naming both digests."""
    twin = digests(twin_weights)
    served = []
    for path in served_weights(engine_identity):
        d = file_digest(path) if path.is_file() else directory_digest(path)
        if d not in twin and not (digests(path) & twin):
            raise GatekeeperError(f"--twin {twin_name}: its weights ({twin_weights}, sha256 {sorted(twin)[0][:16]}…) are not "
                                  f"the served deployment's ({path}, sha256 {d[:16]}…); point the twin's 'model' at the "
                                  "weights the server loads")
        served.append({"path": str(path), "digest": d})
    return {"engine": twin_name, "weights": str(twin_weights), "digests": sorted(twin), "served": served}
