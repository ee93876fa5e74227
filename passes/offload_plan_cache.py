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
stride; not its stack traces, so a job restarted from a script whose lines moved finds the
plan, its re-made nodes taking the new graph's traces), the calibration, the Offload options,
the torch version and the code of every module the planning runs; what is stored is
offload_activation_edits' record of the kept run, which offload_optimizer re-applies and checks
(its predicted peak and step must come out as stored).

With `Offload(accumulate_on="auto")` (without ZeRO) the sum placement's trial compiles are kept
too (`load_sum_peaks`, `store_sum_peaks`): each variant's predicted device peak for every count
of buckets moved and how it was found, keyed like an activation plan (`activation_key`) by the
graph before the pass, the calibration, the trials' Offload options (their budget is None: the
peaks do not depend on the budget, so a restart with another budget reuses them and only the
cheap choice among them, `host_accumulation._decide`, is made again), the buckets that may move,
the code and torch's version.
Under ZeRO, where `accumulate_on="auto"` is one choice for the whole step (api `_step_sums_for`),
what each rank's trial compiles found (its peaks, or why host sums are refused) is kept per rank
(`load_step_trials`, `store_step_trials`), keyed by the captured graph, the calibration, the
config, the rank's place in its groups and the code of the whole package (the trials run the
whole pipeline of built-in passes); every rank still takes the max over the ranks, a collective,
so a rank whose entry is missing computes its own and all still agree.
All kinds share one format number, one directory and one atomic write (`_read`, `_write`).

Every key is a new file, and activation plans of big models are large, so a long-lived machine
(many models, many code versions) would grow the directory without bound: after each write the
directory is trimmed to `MAX_BYTES` (`evict`), least recently used first (a hit refreshes a
file's modification time, `_touch`), never the file just written. Several processes may write
and trim the same directory at once: a file another one removed first is simply gone, and a
file that cannot be removed is logged and skipped; nothing is read to be evicted, so an
unreadable entry is evicted like any other, and so is a temporary file a crashed writer left
(one over an hour old; a younger one is another process's write in progress).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from types import ModuleType

import torch

from graphoffload import calibration
from graphoffload.passes import offload_planner
from graphoffload.calibration import Calibration, cache_dir, write_atomically
from graphoffload.passes.offload_planner import Event, Prediction, StepCosts

log = logging.getLogger("graphoffload")

FORMAT = 2   # bump when Prediction or the planner's algorithm changes what a key maps to
MAX_BYTES = 256 * 2**20   # the plans directory's size cap: beyond it, least recently used entries go
_KINDS = ("plan-", "activations-", "sums-", "stepsums-")   # what an entry's file name starts with
_ABANDONED_S = 3600   # a writer's ".tmp-" file this old was left by a crashed process: evictable too


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


def plans_dir() -> str:
    """Where the plans live: `plans/` under graphoffload's cache directory."""
    return os.path.join(cache_dir(), "plans")


def plan_path(key: str, kind: str = "plan") -> str:
    return os.path.join(plans_dir(), f"{kind}-{key}.json")


def _touch(path: str) -> None:
    """Mark `path` as just used, so eviction takes it last (best effort: a read-only cache
    still serves its plans)."""
    try:
        os.utime(path)
    except OSError:
        pass


def evict(directory: str, keep: str, max_bytes: int = MAX_BYTES) -> list[str]:
    """Remove the least recently used entries of `directory` (by modification time, oldest
    first) until their sizes sum to at most `max_bytes`; `keep` (the file just written) is never
    removed, even if it alone is over the cap. Returns the paths removed by this call."""
    entries = []
    now = time.time()
    try:
        with os.scandir(directory) as found:
            for entry in found:
                temporary = entry.name.startswith(".tmp-")
                if not (entry.name.startswith(_KINDS) or temporary) or not entry.name.endswith(".json"):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:   # removed by another process since the listing
                    continue
                if temporary and now - st.st_mtime < _ABANDONED_S:
                    continue   # another process's write in progress
                entries.append((st.st_mtime_ns, entry.path, st.st_size))
    except OSError as exc:
        log.warning("could not list the plan cache %s to trim it (%s)", directory, exc)
        return []
    total = sum(size for *_, size in entries)
    if total <= max_bytes:
        return []
    removed = []
    for _, path, size in sorted(entries):
        if total <= max_bytes:
            break
        if os.path.abspath(path) == os.path.abspath(keep):
            continue
        try:
            os.remove(path)
        except FileNotFoundError:   # another process evicted it first: its bytes are gone all the same
            total -= size
            continue
        except OSError as exc:
            log.warning("could not evict the cached plan %s (%s)", path, exc)
            continue
        total -= size
        removed.append(path)
        log.debug("evicted the cached plan %s (%d bytes, least recently used)", path, size)
    if removed:
        log.info("plan cache %s over its cap of %d bytes: evicted %d least recently used entries, %d bytes left",
                 directory, max_bytes, len(removed), total)
    return removed


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
    _touch(path)
    return data


def _write(key: str, kind: str, data: dict, max_bytes: int = MAX_BYTES) -> None:
    """Write an entry atomically (a failure to write only costs the next run its planning), then
    trim the directory to `max_bytes` (`evict`)."""
    path = plan_path(key, kind)
    try:
        write_atomically(path, json.dumps({"format": FORMAT, "key": key, **data}))
    except (OSError, TypeError, ValueError) as exc:
        log.warning("could not cache the %s (%s)", kind, exc)
        return
    evict(os.path.dirname(path), path, max_bytes)


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


def store_plan(key: str, prediction: Prediction, candidates: dict[str, float], max_bytes: int = MAX_BYTES) -> None:
    """Write the plan of `key` (then trim the directory to `max_bytes`)."""
    _write(key, "plan", {"prediction": dataclasses.asdict(prediction),
                         "candidates": {name: min(t, 1e300) for name, t in candidates.items()}}, max_bytes)


def activation_key(structure: str, cal: Calibration, options: str, modules: tuple[ModuleType, ...]) -> str:
    """A hash of what the activation plan (and the bucket plan made on it), or the running sums'
    predicted peaks (`store_sum_peaks`, with their own `options`), depend on:
    `structure` (offload_activation_edits.structure of the graph before the pass), the
    calibration, `options` (the Offload config and the device), torch's version and the code of
    `modules` (the planning's)."""
    return _graph_key(source_hash(*modules), structure, cal, options)


def _graph_key(code: str, structure: str, cal: Calibration, options: str) -> str:
    """The hash of a key over a graph's structure: the format, `code` (a hash of the code that
    made what is stored), torch's version, the calibration, `options` and the graph."""
    what = {"format": FORMAT, "code": code, "torch": torch.__version__, "calibration": cal.to_json(),
            "options": options, "graph": hashlib.sha256(structure.encode()).hexdigest()}
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


def store_activations(key: str, decisions: dict, max_bytes: int = MAX_BYTES) -> None:
    """Write the decisions of `key` (then trim the directory to `max_bytes`)."""
    _write(key, "activations", {"decisions": decisions}, max_bytes)


def load_sum_peaks(key: str, counts: int) -> tuple[tuple[int, ...], str] | None:
    """The stored predicted peaks of `key` (one per count of buckets moved, `counts` of them) and
    how they were found ("model" or "trials"), or None: none there, or unreadable (logged)."""
    data = _read(key, "sums")
    if data is None:
        return None
    peaks, method = data.get("peaks"), data.get("method")
    if not (isinstance(peaks, list) and len(peaks) == counts and all(type(p) is int for p in peaks)
            and method in ("model", "trials")):
        log.warning("ignoring an unreadable cached sum placement %s (not %d peaks and a method): trying again",
                    plan_path(key, "sums"), counts)
        return None
    return tuple(peaks), method


def store_sum_peaks(key: str, peaks: tuple[int, ...], method: str, max_bytes: int = MAX_BYTES) -> None:
    """Write the predicted peaks of `key` (then trim the directory to `max_bytes`)."""
    _write(key, "sums", {"peaks": list(peaks), "method": method}, max_bytes)


def package_source() -> str:
    """The code of every module of graphoffload's core and its passes (their package
    directories, walked in a fixed order): what a whole pipeline of built-in passes runs."""
    digest = hashlib.sha256()
    for root in dict.fromkeys(os.path.dirname(os.path.abspath(m.__file__)) for m in (calibration, offload_planner)):
        for folder, subfolders, files in sorted(os.walk(root)):
            subfolders.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    digest.update(os.path.relpath(os.path.join(folder, name), root).encode())
                    with open(os.path.join(folder, name), "rb") as f:
                        digest.update(f.read())
    return digest.hexdigest()


def step_trials_key(structure: str, cal: Calibration, options: str) -> str:
    """A hash of what one rank's trial compiles of a ZeRO step's sum choice depend on: the
    captured graph (`structure`), the calibration, `options` (the config, the variant, the rank's
    place in its groups), torch's version and the package's code (`package_source`)."""
    return _graph_key(package_source(), structure, cal, options)


def load_step_trials(key: str) -> dict | None:
    """What this rank's trials of `key` found (`{"peaks": [device, host] or None, "refused": str
    or None}`), or None: none there, or unreadable (logged)."""
    data = _read(key, "stepsums")
    if data is None:
        return None
    peaks, refused = data.get("peaks"), data.get("refused")
    if not ((peaks is None or (isinstance(peaks, list) and len(peaks) == 2 and all(type(p) is int for p in peaks)))
            and (refused is None or isinstance(refused, str))):
        log.warning("ignoring an unreadable cached sum choice %s: trying again", plan_path(key, "stepsums"))
        return None
    return {"peaks": peaks, "refused": refused}


def store_step_trials(key: str, peaks: list[int] | None, refused: str | None, max_bytes: int = MAX_BYTES) -> None:
    """Write what this rank's trials of `key` found (then trim the directory to `max_bytes`)."""
    _write(key, "stepsums", {"peaks": peaks, "refused": refused}, max_bytes)
