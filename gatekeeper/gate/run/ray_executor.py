"""An evaluation's cases on Ray actors: an engine profile's ``executor: ray`` (docs/scaling.md).

Each actor loads the evaluation's models once, for the whole evaluation, and for every run (a configuration
and repeat) opens a fresh session, pins the stage prefixes as a run in this process does, and runs its shard
of the cases one after another; each result comes back to the driver as soon as its case finishes. Only the
driver writes the ledger, so Ctrl-C, a lost actor or an error ends in an aborted evaluation exactly as a
run in this process does.

The only module that imports ray; the evaluator imports it only when a profile says ``executor: ray``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

from ...errors import GatekeeperError

try:
    import ray
except ImportError:  # an optional extra
    raise GatekeeperError("executor: ray runs the cases on Ray actors, and Ray is not installed: "
                          "pip install 'gatekeeper[ray]', or set executor: local") from None

from ...battery import partition
from ...battery import suites as battery
from ...engines.base import Engine, Session
from ...evidence import CaseResult
from ...workspace import EngineProfile
from . import runs
from .plans import Plan

if TYPE_CHECKING:
    from ray.actor import ActorClass

WAIT_S = 0.5  # the driver never blocks longer than this in Ray, so Ctrl-C and SIGTERM are seen at once
GPU_DEVICES = ("cuda", "gpu")  # identity devices that take one accelerator per actor


@ray.remote
class Worker:
    """One actor: the plan's models, loaded once; a fresh session per run."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.models = runs.open_engines(plan)
        self.graders = runs.open_graders(plan, self.models.values())  # here too, once: each actor grades its shard
        self.session: Session | None = None
        self.mode: partition.Mode | None = None

    def report(self) -> dict[str, Any]:
        """Where this actor runs, each configuration's identity here, and the battery as this node reads it."""
        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "identity": {config: model.identity() for config, model in self.models.items()},
                "battery_digest": battery.battery_digest(self.plan.ws, self.plan.items)}

    def begin(self, config: str) -> None:
        """A fresh session for one run, with every stage prefix pinned (the same boundaries as in this process)."""
        self.end()
        c = self.plan.configs[config]
        self.session, self.mode = self.models[config].session(cache=c.cache), c.render
        runs.pin_stage_prefixes(self.session, self.plan, c.render)

    def case(self, index: int) -> CaseResult:
        assert self.session is not None and self.mode is not None  # begin() came first
        return runs.run_case(self.session, self.plan.ws, self.plan.items[index], self.mode, graders=self.graders)

    def end(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def shards(cases: int, actors: int) -> list[range]:
    """Contiguous slices of the battery, as even as can be: a stage's cases stay on one actor (its prefix
    cache serves them in turn) except where a slice ends inside the stage."""
    size, extra = divmod(cases, actors)
    out, start = [], 0
    for i in range(actors):
        out.append(range(start, start + size + (i < extra)))
        start = out[-1].stop
    return out


class Actors:
    """The Ray actors of one evaluation: started, loaded and checked against the driver's own models before
    anything is written; ``run`` runs every configuration and repeat on them, then shuts them down."""

    def __init__(self, p: Plan, models: dict[str, Engine], profile: EngineProfile):
        self.where, self.count = profile.where, profile.ray.actors
        for config, c in p.configs.items():
            if c.profile.adapter == "http":
                raise GatekeeperError(f"{self.where}: field 'executor': the flag-{config} side runs adapter http, a server; "
                                      "Ray actors run in-process engines only: remove 'executor: ray'")
        here = {config: model.identity() for config, model in models.items()}
        gpus = int(any(i.get("device") in GPU_DEVICES for i in here.values()))
        self.actors: list[Any] = []
        self.names = [f"Ray actor {i} of {self.count}" for i in range(self.count)]  # with node and pid once loaded
        self.owns_cluster = _connect(profile)
        _errors_to_stderr()
        try:
            self.cpus = self._room(gpus)
            path = os.pathsep.join(entry for entry in sys.path if entry)  # plugins import in an actor as they do here
            options = {"num_cpus": self.cpus, "num_gpus": gpus, "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
            plan = ray.put(p)
            worker = cast("ActorClass[Worker]", Worker)  # what @ray.remote made of the class
            self.actors = [worker.options(**options).remote(plan) for _ in range(self.count)]
            reports = dict(self._stream({a.report.remote(): i for i, a in enumerate(self.actors)}, "while loading"))
            self.names = [f"Ray actor {i} of {self.count} (node {reports[i]['node']}, pid {reports[i]['pid']})"
                          for i in range(self.count)]
            _check(self.where, [reports[i] for i in range(self.count)], self.names, here, p.battery_digest)
        except BaseException:
            self.close()
            raise
        self.shards = shards(len(p.items), self.count)
        self.config = {"executor": {"name": "ray", "address": profile.ray.address, "actors": self.count,
                                    "cpus_per_actor": self.cpus, "gpus_per_actor": gpus,
                                    "nodes": sorted({r["node"] for r in reports.values()})}}

    def _room(self, gpus: int) -> int:
        """CPUs per actor: an even share of a cluster this process started, one on a joined cluster; exit 2
        when the cluster cannot hold every actor (Ray would wait for room forever)."""
        total = ray.cluster_resources()
        cpus = max(1, int(total.get("CPU", 0)) // self.count) if self.owns_cluster else 1
        for name, each in (("CPU", cpus), ("GPU", gpus)):
            if each and total.get(name, 0) < each * self.count:
                raise GatekeeperError(f"{self.where}: field 'ray.actors': {self.count} actors need {each * self.count:g} "
                                      f"{name}s ({each} each) and the Ray cluster has {total.get(name, 0):g}; lower "
                                      "ray.actors, or join a larger cluster (ray.address)")
        return cpus

    def run(self, p: Any, ledger, evaluation_id: int, progress: Callable[[str], None]) -> dict[str, Any]:
        """Every configuration and repeat as the evaluator runs them, on the actors. The driver records each
        case as it comes back (in the order they finish); the actors are shut down however the run ends."""
        results: dict[str, list[dict[str, dict]]] = {config: [] for config, _ in p.schedule}
        seconds, model_s = dict.fromkeys(results, 0.0), 0.0
        try:
            for config, repeat in p.schedule:
                what = f"in run {config}#{repeat}"
                list(self._stream({a.begin.remote(config): i for i, a in enumerate(self.actors)}, what))
                t0 = time.perf_counter()
                tasks = {a.case.remote(k): (i, k) for i, (a, shard) in enumerate(zip(self.actors, self.shards)) for k in shard}
                done: dict[int, dict] = {}
                for (_, k), result in self._stream(tasks, what):
                    item = p.items[k]
                    progress(f"{config}#{repeat} {item.case_id}")
                    model_s += sum(t["prefill_s"] + t["decode_s"] for t in result["turns"])
                    ledger.add_case_result(evaluation_id, item.case_id, config, repeat, result)
                    done[k] = result
                seconds[config] += time.perf_counter() - t0
                results[config].append({p.items[k].case_id: done[k] for k in sorted(done)})  # battery order
        finally:
            self.close()
        return {"results": results, "seconds": seconds, "model_s": model_s}

    def _stream(self, tasks: dict[Any, Any], what: str) -> Iterator[tuple[Any, Any]]:
        """Each task's (tag, value) as it finishes. A tag is an actor's index, or (index, case). A lost actor
        or an error in one ends the run: nothing from part of the battery goes on to a verdict."""
        while tasks:
            ready, _ = ray.wait(list(tasks), num_returns=1, timeout=WAIT_S)
            for ref in ready:
                tag = tasks.pop(ref)
                yield tag, self._get(ref, tag if isinstance(tag, int) else tag[0], what)

    def _get(self, ref: Any, index: int, what: str) -> Any:
        name = self.names[index]
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # the actor's own code raised: say so as this process would
            if isinstance(e.cause, GatekeeperError):
                raise GatekeeperError(f"{name}: {e.cause}") from None
            raise
        except ray.exceptions.RayError as e:  # the actor, its node or an object is gone
            if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:  # its models did not load there
                last = [line for line in str(e).splitlines() if line.strip()][-1].strip()  # the error itself
                raise GatekeeperError(f"{name} could not load the models: {last}; {self.where} must load on every "
                                      "node (the same model directory and libraries), or set executor: local") from None
            raise GatekeeperError(f"{name} was lost {what} ({_first_line(e)}); the evaluation is aborted, never a verdict "
                                  "from part of the battery; rerun it, and see that node's memory and logs") from None

    def close(self) -> None:
        """Stop the actors, and the local cluster when this evaluation started it."""
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.owns_cluster and ray.is_initialized():
            ray.shutdown()
            self.owns_cluster = False


def _connect(profile: EngineProfile) -> bool:
    """Join the profile's cluster, or start a local one; True when this call started or joined it (closing
    then disconnects). A process already connected to Ray (a notebook, a test) uses that connection."""
    if ray.is_initialized():
        return False
    address = profile.ray.address
    # ray.init puts its own SIGTERM handler in (exit at once); the CLI's turns SIGTERM into an abort record
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; each is a cluster that is not there
        what = "start a local Ray cluster" if address is None else f"join the Ray cluster at {address}"
        raise GatekeeperError(f"{profile.where}: field 'ray.address': cannot {what} ({_first_line(e)}); start the "
                              "cluster (ray start --head) or fix the address") from None
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    return True


def _errors_to_stderr() -> None:
    """Ray's driver prints the cluster's error reports (an actor's process died) on stdout, from a thread of its
    own; stdout is the CLI's one --json document, so they go to stderr, with the rest of Ray's output."""
    from ray._private import worker

    print_ = getattr(worker, "print_to_stdstream", None)
    if print_ is None or getattr(print_, "to_stderr", False):
        return

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        print_({**data, "is_err": True}, ignore_prefix)

    to_stderr.to_stderr = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr


def _check(where: str, reports: list[dict[str, Any]], names: list[str], here: dict[str, dict], digest: str) -> None:
    """Exit 2 unless every actor loaded what the driver loaded and reads the battery the driver read."""
    problems = []
    for name, report in zip(names, reports):
        for config, identity in here.items():
            there = report["identity"][config]
            fields = sorted(k for k in identity.keys() | there.keys() if identity.get(k) != there.get(k))
            if fields:
                problems.append(f"{name} runs another flag-{config} model, differing in {', '.join(fields)} "
                                f"({fields[0]}: {identity.get(fields[0])!r} here, {there.get(fields[0])!r} there)")
                break
        if report["battery_digest"] != digest:
            problems.append(f"{name} reads another battery (its prompt files differ from this workspace's)")
    if problems:
        raise GatekeeperError(f"{where}: field 'executor': every Ray actor must run what this process runs; "
                              + "; ".join(problems) + ". Give every node the same model directory, libraries and "
                              "workspace, or set executor: local")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
