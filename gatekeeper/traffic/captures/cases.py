"""Cases from real traffic: a capture (the proxy's or the runtime's) turned into candidate suites, one per stage.

Each captured call is a rendered prompt. The prefix every call of a stage shares (what ``analyze``
finds) becomes the suite's static segment, written verbatim to a file beside the suite; the rest of
each call becomes a case's dynamic text. The segments have role ``prompt``: the text is sent as it was
captured, with no chat template over it. Calls whose rest is a near-duplicate of one already taken are
dropped. A byte-equivalence gate needs no assertions (the outputs are the comparison); for the other
gates the cases need assertions given (``--assertions FILE``). Nothing leaves the machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...cache.trie import common_prefix
from ...errors import GatekeeperError
from ...workspace import Assertion, Suite, read_yaml
from . import capture

REST = "rest"  # the var holding each case's dynamic text
NEAR_DUPLICATE = 0.9  # word-shingle overlap at which a call's rest counts as one already taken


@dataclass
class Stage:
    name: str
    prefix: str  # the text every call shares
    cases: list[dict[str, Any]]  # {id, vars: {rest}, source}

    def suite(self, prefix_file: str | None, max_tokens: int, assertions: list[Assertion]) -> dict[str, Any]:
        """The stage as a suite: the prefix in ``prefix_file`` beside it, or inline (static prompt text is verbatim)."""
        cases = [{"id": c["id"], "vars": c["vars"], **({"assert": [a.model_dump(mode="json", by_alias=True, exclude_none=True)
                                                                  for a in assertions]} if assertions else {})}
                 for c in self.cases]
        return {"suite": f"captured-{self.name}", "stage": self.name,
                "prompt": [*([{"role": "prompt", "static": True, **({"file": prefix_file} if prefix_file else {"text": self.prefix})}]
                             if self.prefix else []),
                           {"role": "prompt", "static": False, "text": "{" + REST + "}"}],
                "decoding": {"max_tokens": max_tokens, "stop": []}, "cases": cases}


def stages(path: Path) -> list[Stage]:
    """The capture's calls as candidate cases per stage (exit 2 on a file that holds no prompt text)."""
    requests = capture.read(path, content=False)
    if not requests:
        raise GatekeeperError(f"{path}: no captured calls; capture traffic first (gatekeeper proxy --capture FILE)")
    blind = [r for r in requests if r.text is None]
    if blind:
        r = blind[0]
        why = ("a metadata-only line (written by 'proxy --no-text'): it holds digests, not the prompt"
               if r.tokens is None else "token ids without their text")
        raise GatekeeperError(f"{path}:{r.line}: {why}, so no case can be made from it; capture again without "
                              "--no-text (the proxy writes each prompt's rendered text)")
    by_stage: dict[str, list[capture.Request]] = {}
    for r in requests:
        by_stage.setdefault(r.stage, []).append(r)
    out = []
    for name, calls in by_stage.items():
        texts = [c.text for c in calls if c.text is not None]  # every call's: the blind ones are refused above
        shared = min(common_prefix(texts[0], t) for t in texts) if len(texts) > 1 else 0
        # A call that is nothing but the shared prefix leaves no dynamic text: cut the prefix before its end.
        shared = min([shared, *(len(t) - 1 for t in texts)])
        taken: list[set[str]] = []
        cases = []
        for c, text in zip(calls, texts):
            rest = text[shared:]
            words = _shingles(rest)
            if any(_overlap(words, t) >= NEAR_DUPLICATE for t in taken):
                continue
            taken.append(words)
            cases.append({"id": f"line-{c.line}", "vars": {REST: rest}, "source": f"{path.name}:{c.line}"})
        out.append(Stage(name, texts[0][:shared], cases))
    return out


def write(found: list[Stage], out: Path, *, max_tokens: int, assertions: list[Assertion], gate: str) -> list[Path]:
    """``out/captured-STAGE.yaml`` (and its ``.prefix.txt``) per stage; validated before anything is written."""
    if gate != "byte_equivalence" and not assertions:
        raise GatekeeperError(f"captured calls carry no assertions, and a {gate} gate compares assertion outcomes; "
                              "give them with --assertions FILE (a YAML list applied to every case), or mine for a "
                              "byte_equivalence flag, which compares the outputs themselves")
    docs = {}
    for st in found:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", st.name)
        doc = st.suite(f"captured-{name}.prefix.txt", max_tokens, assertions)
        Suite.model_validate(doc)
        docs[name] = (doc, st.prefix)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (doc, prefix) in docs.items():
        if prefix:
            (out / f"captured-{name}.prefix.txt").write_text(prefix)
        path = out / f"captured-{name}.yaml"
        path.write_text("# Candidate cases from captured traffic (gatekeeper battery from-capture): the shared prefix is\n"
                        "# static, each call's rest a case; role prompt = sent as captured, no chat template.\n"
                        + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120))
        written.append(path)
    return written


def read_assertions(path: Path) -> list[Assertion]:
    data = read_yaml(path)
    if not isinstance(data, list):
        raise GatekeeperError(f"{path}: a YAML list of assertions, e.g. - {{type: max-length, value: 2000}}")
    try:
        return [Assertion.model_validate(a) for a in data]
    except ValueError as e:
        raise GatekeeperError(f"{path}: {e}") from None


def _shingles(text: str, n: int = 3) -> set[str]:
    words = text.lower().split()
    return {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def _overlap(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0
