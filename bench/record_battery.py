"""Record the default battery's outputs on the default model, and time one pass.

The shipped battery (assertions/) was mined from a larger pool of candidates (bench/candidates/, see
docs/calibration.md); `--candidates` records the pool instead, into tests/data/candidate_outputs.json,
against which the tests also check that no shipped assertion is vacuous.

Every case is rendered exactly as the gate renders it (partition.render, partitioned, later
turns extending the transcript) and decoded greedily in float32 on the CPU. The final outputs
go to tests/data/battery_outputs.json, which the no-vacuous-assertion test reads; this prints
per-suite pass rates, static-prefix token counts (as written vs partitioned) and the pass time.

    .venv/bin/python bench/record_battery.py             # run the model, rewrite the data file
    .venv/bin/python bench/record_battery.py --check     # no model: score the recorded outputs
    .venv/bin/python bench/record_battery.py --suite planner   # re-record one suite, keep the rest
    .venv/bin/python bench/record_battery.py --candidates      # the candidate pool
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.battery import checks, partition  # noqa: E402
from gatekeeper.battery import suites as battery  # noqa: E402
from gatekeeper.identity import digest  # noqa: E402
from gatekeeper.workspace import Workspace  # noqa: E402

DATA = ROOT / "tests" / "data" / "battery_outputs.json"
CANDIDATES = ROOT / "bench" / "candidates"
CANDIDATE_DATA = ROOT / "tests" / "data" / "candidate_outputs.json"
MODE: partition.Mode = "partitioned"  # what the gate renders until the static_first flag exists


class Chat:
    """The two calls partition.render needs, through the model's own chat template."""

    def __init__(self, tokenizer):
        self.hf = tokenizer

    def render(self, messages) -> str:
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])


def model_dir() -> Path:
    from gatekeeper.setup.models import is_prepared, prepare_default_model, resolve_model

    return resolve_model("default") if is_prepared() else prepare_default_model()[0]


def load_chat() -> Chat:
    from transformers import AutoTokenizer

    return Chat(AutoTokenizer.from_pretrained(str(model_dir()), local_files_only=True))


def candidates_workspace(tmp: Path) -> Workspace:
    """The repository's workspace with the candidate pool as its suites (links, nothing copied)."""
    for folder in ("engines", "policies", "prompts"):
        (tmp / folder).symlink_to(ROOT / folder)
    (tmp / "assertions").symlink_to(CANDIDATES)
    return Workspace(tmp)


def first_values(case) -> dict[str, str]:
    return {**case.vars, **(case.turns[0] if case.turns else {})}


def case_digest(ws: Workspace, item) -> str:
    """What a case's recorded output depends on: every turn's filled segments and the decoding."""
    values = dict(item.case.vars)
    turns = []
    for turn_vars in item.case.turns or [{}]:
        values.update(turn_vars)
        turns.append([[p.role, p.static, p.text] for p in partition.pieces(ws, item.suite, values)])
    return digest({"turns": turns, "decoding": item.suite.decoding.model_dump(mode="json")})


def static_prefixes(ws: Workspace, chat: Chat, items) -> dict[str, dict[str, int]]:
    """Per suite: tokens before the first dynamic byte, as written and partitioned."""
    out = {}
    for suite in {i.suite.suite: i.suite for i in items}.values():
        pieces = partition.pieces(ws, suite, first_values(suite.cases[0]))
        out[suite.suite] = {m: partition.render(chat, pieces, m).static_tokens for m in ("as_written", "partitioned")}
    return out


def run_case(ws: Workspace, chat: Chat, model, item, tally: dict[str, int]) -> list[str]:
    """Every turn of one case, greedy; returns each turn's text (the last one is what is asserted)."""
    import torch

    suite, case = item.suite, item.case
    values = dict(case.vars)
    history: list[dict[str, str]] = []
    texts = []
    for turn_vars in case.turns or [{}]:
        values.update(turn_vars)
        rendered = partition.render(chat, partition.pieces(ws, suite, values), MODE, history)
        ids = torch.tensor([rendered.tokens])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=suite.decoding.max_tokens,
                                 do_sample=False, eos_token_id=chat.hf.eos_token_id, pad_token_id=chat.hf.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        tally["prompt"] += ids.shape[1]
        tally["generated"] += len(new)
        tally["calls"] += 1
        text = chat.hf.decode(new, skip_special_tokens=True)
        for s in suite.decoding.stop:  # a stop string ends the text where it first appears
            text = text.split(s, 1)[0]
        texts.append(text)
        history = [*rendered.messages, {"role": "assistant", "content": text}]
    return texts


def score(items, outputs: dict[str, str]) -> None:
    """Per-suite pass rates, and any assertion that nothing in reach makes fail (vacuous)."""
    by_suite = defaultdict(list)
    for item in items:
        by_suite[item.suite.suite].append(item)
    total = [0, 0]
    for name, its in by_suite.items():
        passed = n = 0
        vacuous = []
        for item in its:
            if item.case_id not in outputs:
                print(f"  {item.case_id}: no recorded output")
                continue
            others = [""] + [outputs[o.case_id] for o in its if o is not item and o.case_id in outputs]
            for k, a in enumerate(item.case.assert_, 1):
                n += 1
                passed += checks.check(a, outputs[item.case_id])
                if all(checks.check(a, o) for o in others):
                    vacuous.append(f"{item.case_id}#{k} ({a.type} {a.value!r})")
        total[0] += passed
        total[1] += n
        print(f"{name:12s} cases {len(its):3d}  assertions {n:4d}  pass {passed:4d}  ({passed / max(n, 1):.0%})")
        for v in vacuous:
            print(f"  vacuous: {v}")
    print(f"{'all':12s} cases {len(items):3d}  assertions {total[1]:4d}  pass {total[0]:4d}  ({total[0] / max(total[1], 1):.0%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="score the recorded outputs; do not run the model")
    ap.add_argument("--suite", action="append", help="record only this suite (repeatable); others are kept")
    ap.add_argument("--show", action="store_true", help="print every output")
    ap.add_argument("--candidates", action="store_true", help="record the candidate pool (bench/candidates)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record(args, candidates_workspace(Path(tmp)) if args.candidates else Workspace(ROOT),
               CANDIDATE_DATA if args.candidates else DATA)


def record(args, ws: Workspace, out: Path) -> None:
    items = battery.read(ws)
    chat = load_chat()
    prefixes = static_prefixes(ws, chat, items)
    for name, p in prefixes.items():
        print(f"{name:12s} static prefix tokens: as written {p['as_written']:5d}, partitioned {p['partitioned']:5d}")

    data = json.loads(out.read_text()) if out.is_file() else {}
    for key in ("outputs", "turns", "prompts"):
        data.setdefault(key, {})
    if not args.check:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir()), local_files_only=True, dtype=torch.float32).eval()
        chosen = [i for i in items if not args.suite or i.suite.suite in args.suite]
        seconds: dict[str, float] = defaultdict(float)
        tally = {"prompt": 0, "generated": 0, "calls": 0}
        t_all, cpu_all = time.perf_counter(), time.process_time()
        for item in chosen:
            t0 = time.perf_counter()
            texts = run_case(ws, chat, model, item, tally)
            seconds[item.suite.suite] += time.perf_counter() - t0
            data["outputs"][item.case_id] = texts[-1]
            data["prompts"][item.case_id] = case_digest(ws, item)
            if len(texts) > 1:
                data["turns"][item.case_id] = texts
            else:
                data["turns"].pop(item.case_id, None)
        wall, cpu = time.perf_counter() - t_all, time.process_time() - cpu_all
        known = {i.case_id for i in items}
        data = {
            "model": "SmolLM2-135M-Instruct, float32, CPU, greedy",
            "render": MODE,
            "outputs": {k: v for k, v in sorted(data["outputs"].items()) if k in known},
            "turns": {k: v for k, v in sorted(data["turns"].items()) if k in known},
            "prompts": {k: v for k, v in sorted(data["prompts"].items()) if k in known},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        for name, s in seconds.items():
            print(f"{name:12s} {s:7.1f} s")
        threads = torch.get_num_threads()
        print(f"one pass ({len(chosen)} cases, {tally['calls']} model calls, {tally['prompt']} prompt tokens, "
              f"{tally['generated']} generated): {wall:.1f} s wall, {cpu:.1f} s CPU on {threads} threads; "
              f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print("the gate runs three passes (flag off twice, on once; the on pass re-prefills only what the cache misses)")

    if args.show:
        for item in items:
            print(f"--- {item.case_id}: {data['outputs'].get(item.case_id)!r}")
    stale = [i.case_id for i in items if data["prompts"].get(i.case_id) != case_digest(ws, i)]
    if stale:
        print(f"stale or missing recordings ({len(stale)}): {', '.join(stale)}; run without --check")
    score(items, data["outputs"])


if __name__ == "__main__":
    main()
