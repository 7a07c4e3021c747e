"""A battery large enough to decide, with answers no model wrote: facts about the world's countries from the
data the registry package countryinfo ships (MIT), written as a gatekeeper suite whose cases come from a
promptfoo CSV (vars and ``__expected`` columns).

Each country gives up to three cases (its capital, its continent, what its people are called), so the cases of
one country are not independent: policies that run it set ``cluster: var:country`` (docs/verdicts.md).

    pip install countryinfo   # in the project's venv: make test installs it (the dev extra)
    python bench/world_battery.py --out WORKSPACE [--kinds capital,continent,demonym] [--countries N]
    gatekeeper --workspace WORKSPACE battery size --flag kv_q8
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

# The data's region is a continent but for "Americas": any answer naming North or South America is right.
QUESTIONS = {
    "capital": ("What is the capital of {}?", lambda c: c.capital()),
    "continent": ("Which continent is {} in?", lambda c: "America" if c.region() == "Americas" else c.region()),
    "demonym": ("What is a person from {} called?", lambda c: c.demonym()),
}
SYSTEM = "You answer questions about the world's countries. Answer with the name only, in English."
SUITE = """\
# Written by bench/world_battery.py from countryinfo {version} (MIT): {n} cases, {k} countries.
# The answers are the data's, not a model's; the cases of one country form a cluster (cluster: var:country).
suite: world
stage: world
prompt:
- role: system
  static: true
  text: {system}
- role: user
  static: false
  text: '{{question}}'
decoding:
  max_tokens: 12
  stop: []
promptfoo: world/world.yaml
"""


def rows(kinds: list[str], countries: int | None, seed: int) -> tuple[list[dict[str, str]], str]:
    from importlib.metadata import version

    from countryinfo import all_countries  # a data package, only for writing the battery

    chosen = sorted((c for c in all_countries() if c.capital()), key=lambda c: c.name())
    if countries:
        chosen = sorted(random.Random(seed).sample(chosen, min(countries, len(chosen))), key=lambda c: c.name())
    out = []
    for c in chosen:
        for kind in kinds:
            question, answer = QUESTIONS[kind]
            expected = answer(c)
            if isinstance(expected, str) and expected.strip():  # a few entries hold none, or a list
                out.append({"country": c.name(), "kind": kind, "question": question.format(c.name()),
                            "__expected": f"icontains:{expected.strip()}"})
    return out, version("countryinfo")


def write(ws: Path, kinds: list[str], countries: int | None = None, seed: int = 0) -> int:
    cases, version = rows(kinds, countries, seed)
    (ws / "assertions").mkdir(parents=True, exist_ok=True)
    (ws / "world").mkdir(parents=True, exist_ok=True)
    with open(ws / "world" / "world.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["country", "kind", "question", "__expected"])
        w.writeheader()
        w.writerows(cases)
    (ws / "world" / "world.yaml").write_text("tests: file://world.csv\n")
    n_countries = len({c["country"] for c in cases})
    (ws / "assertions" / "world.yaml").write_text(
        SUITE.format(version=version, n=len(cases), k=n_countries, system=json.dumps(SYSTEM)))
    return len(cases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the workspace to write assertions/world.yaml and world/ into")
    ap.add_argument("--kinds", default="capital,continent,demonym", help=f"comma-separated, of {', '.join(QUESTIONS)}")
    ap.add_argument("--countries", type=int, help="a seeded sample of this many countries (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if unknown := set(kinds) - set(QUESTIONS):
        ap.error(f"--kinds: unknown {', '.join(sorted(unknown))}; use {', '.join(QUESTIONS)}")
    n = write(a.out, kinds, a.countries, a.seed)
    print(f"wrote {n} cases to {a.out / 'assertions' / 'world.yaml'} (cases in {a.out / 'world' / 'world.csv'})")


if __name__ == "__main__":
    main()
