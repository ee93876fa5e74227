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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os

from graphoffload.passes import offload_planner
from graphoffload.calibration import Calibration, cache_dir, write_atomically
from graphoffload.passes.offload_planner import Event, Prediction, StepCosts

log = logging.getLogger("graphoffload")

FORMAT = 1   # bump when Prediction or the planner's algorithm changes what a key maps to


def _planner_source() -> str:
    """The planner's own code: a changed planner must not be served an old plan."""
    with open(offload_planner.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def plan_key(costs: StepCosts, cal: Calibration, budget: int | None, max_sweeps: int) -> str:
    """A hash of everything the plan depends on (floats by their exact repr), the planner's
    code included."""
    what = {"format": FORMAT, "planner": _planner_source(), "costs": dataclasses.asdict(costs),
            "calibration": cal.to_json(), "budget": budget, "max_sweeps": max_sweeps}
    text = json.dumps(what, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_path(key: str) -> str:
    return os.path.join(cache_dir(), "plans", f"plan-{key}.json")


def load_plan(key: str) -> tuple[Prediction, dict[str, float]] | None:
    """The cached plan of `key`, or None (none there, or unreadable)."""
    path = plan_path(key)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        p = data["prediction"]
        prediction = Prediction(
            assignment=tuple(p["assignment"]), step_seconds=p["step_seconds"],
            prefetch_node={int(b): n for b, n in p["prefetch_node"].items()},
            events=[Event(**e) for e in p["events"]], peak_bytes=p["peak_bytes"],
            node_start=list(p["node_start"]), device_bytes=list(p["device_bytes"]))
        return prediction, {name: (math.inf if t >= 1e300 else float(t)) for name, t in data["candidates"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring an unreadable cached offload plan %s (%s): planning again", path, exc)
        return None


def store_plan(key: str, prediction: Prediction, candidates: dict[str, float]) -> None:
    """Write the plan of `key` (a failure to write only costs the next run its planning)."""
    data = {"format": FORMAT, "key": key, "prediction": dataclasses.asdict(prediction),
            "candidates": {name: min(t, 1e300) for name, t in candidates.items()}}
    try:
        write_atomically(plan_path(key), json.dumps(data))
    except OSError as exc:
        log.warning("could not cache the offload plan (%s)", exc)
