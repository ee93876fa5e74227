"""Offload plans cached on disk, so a restarted job with the same model skips planning.

The planner's choice is a pure function of what it is given: the step's costs (each node's
predicted time, device bytes live at each node, each bucket's sizes and positions), the
calibration, the memory budget and the number of search sweeps. The key is a hash of all of
them, so a plan is reused exactly when planning again would give the same plan; anything that
changes the graph, the model's shapes, the calibration, the budget or the planner's own code is
a new key (and a miss).
Plans sit beside the calibration (`$XDG_CACHE_HOME/graphoffload/plans/`), one JSON file each,
written atomically; an unreadable or stale file is ignored and planned afresh. What it saves is
the planning time (`benchmarks/compile_time.py` prints it: 3.4 s of a 48 s compile at 24 layers,
10 s of 85 s at 48 layers on the development machine); capture and the other passes still run.

With `Offload(activations="auto")` the activation planner's search dominates a compile, so its
outcome is kept too (`activation_key`, `load_activations`, `store_activations`): keyed by the
graph before the pass (every node's op, target, arguments and meta, values by shape, dtype and
stride), the calibration, the Offload options, the torch version and the code of every module
the planning runs; what is stored is offload_activation_edits' record of the kept run, which
offload_optimizer re-applies and checks (its predicted peak and step must come out as stored).
Both kinds share one format number, one directory and one atomic write (`_read`, `_write`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from types import ModuleType

import torch

from graphoffload.passes import offload_planner
from graphoffload.calibration import Calibration, cache_dir, write_atomically
from graphoffload.passes.offload_planner import Event, Prediction, StepCosts

log = logging.getLogger("graphoffload")

FORMAT = 1   # bump when Prediction or the planner's algorithm changes what a key maps to


def source_hash(*modules: ModuleType) -> str:
    """The code of `modules`: a changed planner must not be served an old plan."""
    digest = hashlib.sha256()
    for module in modules:
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _planner_source() -> str:
    return source_hash(offload_planner)


def plan_key(costs: StepCosts, cal: Calibration, budget: int | None, max_sweeps: int) -> str:
    """A hash of everything the plan depends on (floats by their exact repr), the planner's
    code included."""
    what = {"format": FORMAT, "planner": _planner_source(), "costs": dataclasses.asdict(costs),
            "calibration": cal.to_json(), "budget": budget, "max_sweeps": max_sweeps}
    text = json.dumps(what, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_path(key: str, kind: str = "plan") -> str:
    return os.path.join(cache_dir(), "plans", f"{kind}-{key}.json")


def _read(key: str, kind: str) -> dict | None:
    """The stored entry of `key`, or None: none there, another format, or unreadable (logged)."""
    path = plan_path(key, kind)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        log.warning("ignoring an unreadable cached %s %s (%s): planning again", kind, path, exc)
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        log.warning("ignoring a stale cached %s %s (another format or key): planning again", kind, path)
        return None
    return data


def _write(key: str, kind: str, data: dict) -> None:
    """Write an entry atomically (a failure to write only costs the next run its planning)."""
    try:
        write_atomically(plan_path(key, kind), json.dumps({"format": FORMAT, "key": key, **data}))
    except (OSError, TypeError, ValueError) as exc:
        log.warning("could not cache the %s (%s)", kind, exc)


def load_plan(key: str) -> tuple[Prediction, dict[str, float]] | None:
    """The cached plan of `key`, or None (none there, or unreadable)."""
    data = _read(key, "plan")
    if data is None:
        return None
    try:
        p = data["prediction"]
        prediction = Prediction(
            assignment=tuple(p["assignment"]), step_seconds=p["step_seconds"],
            prefetch_node={int(b): n for b, n in p["prefetch_node"].items()},
            events=[Event(**e) for e in p["events"]], peak_bytes=p["peak_bytes"],
            node_start=list(p["node_start"]), device_bytes=list(p["device_bytes"]))
        return prediction, {name: (math.inf if t >= 1e300 else float(t)) for name, t in data["candidates"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring an unreadable cached offload plan %s (%s): planning again", plan_path(key), exc)
        return None


def store_plan(key: str, prediction: Prediction, candidates: dict[str, float]) -> None:
    """Write the plan of `key`."""
    _write(key, "plan", {"prediction": dataclasses.asdict(prediction),
                         "candidates": {name: min(t, 1e300) for name, t in candidates.items()}})


def activation_key(structure: str, cal: Calibration, options: str, modules: tuple[ModuleType, ...]) -> str:
    """A hash of what the activation plan (and the bucket plan made on it) depends on:
    `structure` (offload_activation_edits.structure of the graph before the pass), the
    calibration, `options` (the Offload config and the device), torch's version and the code of
    `modules` (the planning's)."""
    what = {"format": FORMAT, "code": source_hash(*modules), "torch": torch.__version__,
            "calibration": cal.to_json(), "options": options, "graph": hashlib.sha256(structure.encode()).hexdigest()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()


def load_activations(key: str) -> dict | None:
    """The stored decisions of `key` (offload_optimizer's record of its kept run), or None."""
    data = _read(key, "activations")
    if data is None:
        return None
    decisions = data.get("decisions")
    if not isinstance(decisions, dict):
        log.warning("ignoring an unreadable cached activation plan %s (no decisions): planning again",
                    plan_path(key, "activations"))
        return None
    return decisions


def store_activations(key: str, decisions: dict) -> None:
    _write(key, "activations", {"decisions": decisions})
