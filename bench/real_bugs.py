"""Real, fixed, public cache bugs reproduced through gatekeeper's own commands (``bench/real_bugs/*.yaml``, one
per bug; what each taught is in ``bench/real_bugs/README.md``).

For each entry and each of its two releases (the last affected, the first fixed): the release's environment
(``gatekeeper runtime prepare``, made once), a tiny model made locally from the entry's config by the fixed
release's own library (random weights, the default model's tokenizer files), the default workspace with an engine
profile that runs under that release (``python:``), and the flag a user would gate, evaluated by
``gatekeeper evaluate --json``. The affected release must never PASS (a FAIL, or an aborted evaluation naming the
crash); the fixed one must PASS. One row per bug: each release's verdict and first reason, the first divergent
position, the seconds; then the worker engine's overhead against in-process on the default model
(``bench/worker.py``), side by side.

    python bench/real_bugs.py [--only ID ...] [--prefill aligned|monolithic] [--without PROBE ...]
                              [--flag FLAG] [--option KEY=VALUE ...] [--overhead] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from gatekeeper.identity import child_env

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = Path(__file__).resolve().parent / "real_bugs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def entries(only: list[str] | None = None) -> list[dict]:
    found = [yaml.safe_load(p.read_text()) for p in sorted(ENTRIES.glob("*.yaml"))]
    return [e for e in found if not only or e["id"] in only]


def environment(entry: dict, side: str) -> str:
    """The name of the environment of the entry's ``side`` (affected, fixed), made once. llama-cpp-python's is the
    one ``make llama-server LLAMA_VERSION=X`` makes beside that release's llama.cpp (its bindings, no build)."""
    from gatekeeper.setup.runtimes import environment as made
    from gatekeeper.setup.runtimes import prepare

    release = entry[side]
    name = f"{entry['runtime']}-{release['release']}"
    if entry["runtime"] == "llama-cpp-python":
        from gatekeeper.setup.llama_build import bindings, build_server

        build_server(release["release"])  # compiled and proven once (minutes), with its bindings' environment
        bindings(release["release"])
    elif made(name) is None:
        prepare(name, list(release["packages"]))
    return name


def model(entry: dict) -> Path:
    """The entry's tiny model, made once under ``$GATEKEEPER_HOME/real_bugs/ID/`` by the fixed release's python."""
    from gatekeeper.setup.models import home
    from gatekeeper.setup.runtimes import environment as made

    out = home() / "real_bugs" / entry["id"] / "model"
    if (out / "config.json").is_file():
        return out
    # a GGUF is made by this environment's transformers and llama.cpp's converter; the rest by the fixed release
    python = sys.executable if entry["model"]["library"] == "gguf" else made(environment(entry, "fixed"))
    assert python is not None
    done = subprocess.run([python, __file__, "--build-model", entry["id"], str(out)], capture_output=True, text=True,
                          env=child_env(PYTHONPATH=str(ROOT)))
    if done.returncode != 0:
        raise SystemExit(f"{entry['id']}: building its model failed: {done.stderr[-1500:]}")
    return out


def build_model(entry: dict, out: Path) -> None:
    """Run under the fixed release's python: the entry's config with random weights (seeded), saved as that release
    saves it, and the default model's tokenizer files beside it."""
    from gatekeeper.setup.models import resolve_model

    build(entry["model"], resolve_model("default", None), out)
    if entry.get("draft"):  # a second model with the same vocabulary: the draft of assisted decoding
        build(entry["draft"], resolve_model("default", None), out / "draft")


def build(spec: dict, default: Path, out: Path) -> None:
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    config = {**spec["config"], "vocab_size": vocab}
    if spec["library"] == "mlx":
        import importlib

        import mlx.core as mx
        from mlx.utils import tree_flatten

        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        mx.random.seed(spec.get("seed", 0))
        net = module.Model(module.ModelArgs.from_dict(config))
        mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(net.parameters())))
        (out / "config.json").write_text(json.dumps(config, indent=2))
    else:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        ids = {k: v for k, v in json.loads((default / "config.json").read_text()).items() if k.endswith("token_id")}
        cfg = AutoConfig.for_model(**{**ids, **config})
        torch.manual_seed(spec.get("seed", 0))
        net = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
        with torch.no_grad():  # weights made louder than the config's initialiser, so greedy answers vary
            for name, param in net.named_parameters():
                std = next((v for k, v in (spec.get("normal") or {}).items() if name.endswith(k)), None)
                if std is not None:
                    param.normal_(0, std)
        net.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (default / name).is_file():
            shutil.copy(default / name, out / name)
    if spec["library"] == "gguf":  # converted by the installed llama.cpp's own script
        from gatekeeper.setup.llama_build import source_dir

        src = source_dir()
        done = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(out), "--outtype", "f32",
                               "--outfile", str(out / "model.gguf")], capture_output=True, text=True,
                              env=child_env(PYTHONPATH=str(src / "gguf-py")))
        if done.returncode != 0:
            raise SystemExit(f"converting to GGUF failed: {done.stderr[-1500:]}")
    # a class every release knows (transformers 5 names its own), and the chat template inside, where 4.x reads it
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if (out / "chat_template.jinja").is_file():
        config.setdefault("chat_template", (out / "chat_template.jinja").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def variant(entry: dict, prefill: str | None = None, without: list[str] | None = None, extra: str = "",
            flag: str | None = None, options: dict | None = None) -> dict:
    """The entry with its profile's prefill plan or options replaced, some probes left out of its flag's policy (to
    show what the gate saw before a probe existed), ``extra`` policy lines, or another flag evaluated."""
    profile = {**entry["profile"], **({"prefill": prefill} if prefill else {})}
    if options:
        profile["options"] = {**profile.get("options", {}), **options}
    entry = {**entry, "profile": profile, "flag": flag or entry["flag"]}
    lines = (entry.get("policies") or {}).get(entry["flag"], "")
    if without:
        from gatekeeper.workspace import PROBES

        lines = "".join(x for x in lines.splitlines(keepends=True) if not x.startswith("probes:"))
        lines += f"probes: {{kinds: [{', '.join(k for k in PROBES if k not in without)}]}}\n"
    entry["policies"] = {**(entry.get("policies") or {}), entry["flag"]: lines + extra}
    return entry


def workspace(tmp: Path, entry: dict, path: Path, python: str) -> Path:
    """The default workspace with the entry's engine profile (``bug``) under ``python`` and its policy lines."""
    ws = tmp / "ws"
    for folder in ("assertions", "engines", "policies", "prompts"):
        shutil.copytree(ROOT / folder, ws / folder)
    shutil.rmtree(ws / "policies" / "examples", ignore_errors=True)
    places = {"{gguf}": str(path / "model.gguf"), "{model}": str(path)}
    if entry["profile"]["adapter"] == "http":  # a server this release runs, started by gatekeeper (``serve``)
        from gatekeeper.setup.llama_libs import lib_dir
        from gatekeeper.setup.runtimes import environment as made

        places["{python}"] = made(python) or python
        if entry["runtime"] == "llama-cpp-python":
            places["{lib}"] = str(lib_dir(python.rsplit("-", 1)[1]))
        profile = entry["profile"]
    else:
        profile = {**entry["profile"], "model": str(path), "python": python}
    text = json.dumps(profile)
    for key, value in places.items():
        text = text.replace(key, value)
    profile = json.loads(text)
    (ws / "engines" / "bug.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    for suite in (ws / "assertions").glob("*.yaml") if entry.get("decoding") else ():  # the pipeline's decoding
        fields = yaml.safe_load(suite.read_text())
        fields["decoding"] = {**(fields.get("decoding") or {}), **entry["decoding"]}
        suite.write_text(yaml.safe_dump(fields, sort_keys=False, allow_unicode=True))
    for flag, extra in (entry.get("policies") or {}).items():  # fields set in (or making) the flag's policy
        policy = ws / "policies" / f"{flag}.yaml"
        fields = yaml.safe_load(policy.read_text()) if policy.is_file() else {}
        for key, value in (yaml.safe_load(extra.replace("{draft}", str(path / "draft"))) or {}).items():
            both = isinstance(value, dict) and isinstance(fields.get(key), dict)
            fields[key] = {**fields[key], **value} if both else value
        policy.write_text(yaml.safe_dump(fields, sort_keys=False))
    return ws


DIVERGES = re.compile(r"first divergent token at position (\d+)")


def run(entry: dict, side: str, limit: int | None = None) -> dict:
    """One release of one entry: ``gatekeeper evaluate --flag FLAG --engine bug --json`` on its workspace (``limit``:
    cases per suite, in place of the entry's own ``args``)."""
    python = environment(entry, side)
    path = model(entry)
    with tempfile.TemporaryDirectory(prefix=f"gatekeeper-bug-{entry['id']}-") as tmp:
        ws = workspace(Path(tmp), entry, path, python)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag",
                               entry["flag"], "--engine", "bug",
                               *(["--limit", str(limit)] if limit else entry.get("args", [])), "--json"],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    try:
        out = json.loads(done.stdout)
    except ValueError:
        out = {"error": (done.stdout + done.stderr)[-600:]}
    reasons = out.get("reasons") or [out.get("error", "")]
    found = next((m for r in reasons if (m := DIVERGES.search(r))), None)
    verdict = out.get("verdict") or ("aborted" if done.returncode == 2 else f"exit {done.returncode}")
    return {"release": entry[side]["release"], "verdict": verdict, "exit": done.returncode, "reason": reasons[0],
            "reasons": reasons,
            "differing_cases": len(out.get("differing_cases") or []),
            "first_divergent_position": int(found.group(1)) if found else None, "seconds": round(seconds, 1)}


def guarded(entry: dict, side: str, key: Path, rule: dict, cap: int = 60, proxy: bool = False) -> dict:
    """The guard after an honest flip (issue #61): the entry's flag evaluated on the suites of its ``guard.battery``,
    which do not reach the defect, and flipped on where that PASSes; then live calls of the ``guard.live`` stages' cases
    (which do reach it), in turn, through ``gatekeeper.Runtime(guard=FLAG)`` (``proxy``: through ``gatekeeper proxy
    --guard FLAG`` in front of the pipeline served flag on, shadowing to it served flag off, ``bench/runtime_server.py``)
    under ``rule`` (the policy's ``guard:``) until the guard rolls the flag back or ``cap`` calls. Returns the
    evaluation's verdict, the calls, comparisons and partings, and whether the flag was rolled back."""
    from gatekeeper.battery.suites import all_suites
    from gatekeeper.ledger import Ledger, checkpoint
    from gatekeeper.runtime import Runtime
    from gatekeeper.workspace import Workspace

    python, path, flag = environment(entry, side), model(entry), entry["flag"]
    with tempfile.TemporaryDirectory(prefix=f"gatekeeper-guard-{entry['id']}-") as tmp:
        ws = workspace(Path(tmp), entry, path, python)
        policy = ws / "policies" / f"{flag}.yaml"
        policy.write_text(policy.read_text() + f"guard: {json.dumps(rule)}\n")
        kind, b64 = key.with_name(key.name + ".pub").read_text().split()[:2]
        (ws / "policies" / "allowed_signers").write_text(f"guard {kind} {b64}\n")
        suites = [a for s in entry["guard"]["battery"] for a in ("--suite", s)]
        done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", flag,
                               "--engine", "bug", *suites, "--limit", "2", "--json"], capture_output=True, text=True,
                              env=child_env())
        verdict = json.loads(done.stdout)["verdict"] if done.stdout.strip().startswith("{") else f"exit {done.returncode}"
        row = {"release": entry[side]["release"], "evaluation": verdict, "calls": 0, "compared": 0, "mismatches": 0,
               "rolled_back": False}
        if verdict != "PASS":  # the battery reached the defect after all: no honest flip to guard
            return row
        with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
            ledger.add_flip(flag, "on", "ana", "the battery passed and was approved",
                            evaluation_id=json.loads(done.stdout)["evaluation_id"])
            checkpoint.after_flip(Workspace(ws), ledger, None)
        live = [(s.stage, c.vars) for s in all_suites(Workspace(ws)).values() if s.suite in entry["guard"]["live"]
                for c in s.cases]
        if proxy:
            return {**row, **behind_proxy(ws, flag, key, live, cap)}
        with Runtime(ws, engine="bug", response_cache=False, guard=flag, sign=key) as rt:
            assert rt.guard is not None
            watch = rt.guard.guarded
            while row["calls"] < cap and watch.rollback is None:
                stage, values = live[row["calls"] % len(live)]
                rt.complete(stage, values)
                row["calls"] += 1
                while watch.in_flight:  # each call's replay compared before the next: calls count comparisons
                    time.sleep(0.01)
            row.update(compared=watch.totals["compared"], mismatches=watch.totals["mismatches"],
                       rolled_back=watch.rollback is not None)
    return row


def behind_proxy(ws: Path, flag: str, key: Path, live: list, cap: int) -> dict:
    """``live`` calls (stage, values) in turn through ``gatekeeper proxy --guard FLAG`` in front of the workspace's
    pipeline served with the flag on, shadowing to it served with the flag off, until a rollback or ``cap`` calls."""
    import http.client
    import socket

    from gatekeeper.battery import partition
    from gatekeeper.battery.suites import all_suites
    from gatekeeper.ledger import Ledger
    from gatekeeper.workspace import Workspace

    procs: list[subprocess.Popen] = []

    def started(args: list[str], ready: str) -> str:
        """``args`` run by this python until it prints a line starting with ``ready``: that line."""
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(PYTHONPATH=str(ROOT)))
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(ready):
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # drained, never blocking the child
                return line
        raise SystemExit(f"{' '.join(args[:3])} stopped before it was ready")

    def call(where: str, body: dict | None = None) -> str:
        """A chat completion (``body``) through the proxy, else its /metrics text."""
        conn = http.client.HTTPConnection(*where.split(":"), timeout=600)
        if body is None:
            conn.request("GET", "/metrics")
        else:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                           "X-Gatekeeper-Stage": body["gatekeeper"]["stage"]})
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    stages = {s.stage: s for s in all_suites(Workspace(ws)).values()}
    serve = [str(ROOT / "bench" / "runtime_server.py"), str(ws), "--engine", "bug", "--flag"]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{free.getsockname()[1]}"
    flag_on, quiet = f'gatekeeper_guard_flag_on{{flag="{flag}"}} 1', f'gatekeeper_guard_in_flight{{flag="{flag}"}} 0'
    row = {"calls": 0}
    try:
        on, off = (f"http://127.0.0.1:{started([*serve, f'{flag}={state}'], 'ready').split()[1]}" for state in ("on", "off"))
        started(["-m", "gatekeeper.cli", "--workspace", str(ws), "proxy", "--upstream", on, "--listen", listen,
                 "--guard", flag, "--shadow", off, "--sign", str(key)], "gatekeeper proxy: listening")
        while row["calls"] < cap and flag_on in call(listen):
            stage, values = live[row["calls"] % len(live)]
            pieces = partition.pieces(Workspace(ws), stages[stage], values)
            call(listen, {"messages": partition.messages(partition.order(pieces, "partitioned")), "temperature": 0,
                          "gatekeeper": {"stage": stage, "values": values}})
            row["calls"] += 1
            while quiet not in call(listen):  # each call's shadow compared before the next: calls count comparisons
                time.sleep(0.05)
        metrics = call(listen)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
    counted = {name: int(float(m.group(1))) for name in ("compared", "mismatches")
               if (m := re.search(rf'gatekeeper_guard_{name}_total{{flag="{flag}"}} (\S+)', metrics))}
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
        state = ledger.flag_states()[flag]
    return {**row, **counted, "rolled_back": state["state"] == "off" and state["operator"] == "guard"}


def judged(entry: dict, rows: dict) -> bool:
    """The entry holds: the affected release is no PASS, the fixed one PASSes."""
    return rows["affected"]["verdict"] != "PASS" and rows["fixed"]["verdict"] == "PASS"


def overhead() -> str:
    """bench/worker.py's figure: the default model in process and in a worker, side by side."""
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "worker.py"), "--limit", "1", "--reps", "1"],
                          capture_output=True, text=True)
    return done.stdout.strip() or done.stderr[-600:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="entry ids (default: all)")
    ap.add_argument("--overhead", action="store_true", help="also measure the worker engine's overhead (about 2 min)")
    ap.add_argument("--prefill", choices=("aligned", "monolithic"), help="run every entry's profile with this plan")
    ap.add_argument("--without", nargs="*", metavar="PROBE", help="leave these probes out (what the gate saw before them)")
    ap.add_argument("--flag", help="evaluate this flag instead of the entry's")
    ap.add_argument("--option", nargs="*", default=[], metavar="KEY=VALUE", help="set profile options (YAML values)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build-model", nargs=2, metavar=("ID", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.build_model:
        build_model(entries([a.build_model[0]])[0], Path(a.build_model[1]))
        return
    results = []
    for entry in entries(a.only):
        options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in a.option)}
        entry = variant(entry, a.prefill, a.without, flag=a.flag, options=options)
        rows = {side: run(entry, side) for side in ("affected", "fixed")}
        results.append({"id": entry["id"], "holds": judged(entry, rows), **rows})
        if not a.json:
            print(f"{entry['id']}: {entry['title']}")
            for side, r in rows.items():
                print(f"  {side:8} {r['release']:10} {r['verdict']:13} cases differing {r['differing_cases']:2}  first "
                      f"divergent position {r['first_divergent_position']!s:5} {r['seconds']:6.1f} s  {r['reason'][:140]}")
            print(f"  {'holds' if results[-1]['holds'] else 'DOES NOT HOLD'}: affected never PASS, fixed PASS")
    if a.json:
        print(json.dumps(results, indent=2))
    if a.overhead:
        print(overhead())
    if not all(r["holds"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
