"""The step's schedule as a picture: a Chrome/Perfetto trace and a PNG with device memory.

`chrome_trace` puts the offload planner's predicted timeline (one track per stream: compute,
host-to-device, device-to-host, CPU worker) beside the measured spans of the last run, as two
processes of one trace that chrome://tracing or ui.perfetto.dev opens. `plot` draws the
predicted schedule above the device memory over the step, which shows what fills the memory
and when it frees up; a step without a planned schedule (every update on the CPU path, no
calibration, no offload at all) is drawn from what its last run measured, its memory against
the nodes' order.

Both show what the plan changes. Activation checkpointing's recomputed nodes are grouped into
spans (one per contiguous run of a region's nodes in the final graph, named as explain() names
the region): a `recompute` track of the trace and a lane of the picture, and shaded in its
memory panel. The memory panel draws the liveness analysis (`graphoffload.memory`) of the
compiled step beside that of the same step without its plan: without recompute (every
activation kept, `without_recompute`) and without offload (the graph the offload planner
planned, optimizer state on the device), so a reader sees what each saves.

Predicted node times are the planner's (`Prediction.node_start`), which leave out the
compute stream's waits for device-path updates (an update waits for its prefetched state to
land, then runs): `node_times` puts them back from the Prediction's update events, so the
memory curve and the recompute spans sit where the planner predicts them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import graphoffload.ops  # noqa: F401  (declares the transfer ops the device-path waits are)
from graphoffload.diagnostics import user_line_of_stack_trace
from graphoffload.graph import TrainGraph
from graphoffload.memory import analyze_memory, without_recompute
from graphoffload.passes.offload_planner import Prediction

TRACKS = ("compute", "h2d", "d2h", "cpu")
RECOMPUTE = "recompute"   # the trace's and the picture's lane of recomputed spans


@dataclass(frozen=True)
class RecomputeSpan:
    """A contiguous run of one checkpointed region's recomputed nodes in the final graph."""

    region: str                  # meta["recompute"]: the checkpointed module, or function and call site
    nodes: tuple[str, ...]       # the recomputed nodes, in execution order
    where: str | None            # the user's source line of the first one
    start: float                 # position of the first node (seconds, or node index without a schedule)
    end: float                   # position of the node after the last


@dataclass(frozen=True)
class MemoryCurve:
    """Predicted device bytes over the step for one variant of it, at positions on the step's axis."""

    label: str
    positions: tuple[float, ...]
    live: tuple[int, ...]

    @property
    def peak(self) -> int:
        return max(self.live, default=0)


@dataclass(frozen=True)
class StepPicture:
    """What `plot` draws of the compiled step, and `timeline` of its recompute: `timed` when
    positions are predicted seconds (a planned schedule), else node indices of the final graph."""

    timed: bool
    end: float
    curves: tuple[MemoryCurve, ...]
    recompute: tuple[RecomputeSpan, ...]


def _planned_stage(stages: Mapping[str, TrainGraph]) -> TrainGraph | None:
    """The graph the offload planner planned: the stage before `offload_optimizer`'s."""
    names = list(stages)
    if "offload_optimizer" not in names or names.index("offload_optimizer") == 0:
        return None
    return stages[names[names.index("offload_optimizer") - 1]]


def _is_device_path_wait(node: fx.Node) -> bool:
    """A device-path bucket's wait for its prefetched state (the ticket of a prefetch_to_device)."""
    if node.target is not torch.ops.graphoffload.wait_device.default:
        return False
    ticket = node.args[0]
    source = ticket.args[0] if isinstance(ticket, fx.Node) and ticket.args else None
    return isinstance(source, fx.Node) and source.target is torch.ops.graphoffload.prefetch_to_device.default


def node_times(final: TrainGraph, planned: TrainGraph, schedule: Prediction) -> dict[str, float]:
    """Predicted start of every node of the final graph. A node the planner saw starts at its
    `node_start`, pushed back by the device-path updates before it: each runs on the compute
    stream from its event's start (after its prefetch landed) to its end, where the compute
    stream resumes. A node the offload pass added (transfers, a device-path update) costs no
    compute time and takes the time of the node before it, a device-path update its event's."""
    planned_nodes = [n.name for n in planned.graph.nodes if n.op != "output"]
    starts = schedule.node_start
    index = {name: i for i, name in enumerate(planned_nodes)}
    updates = iter(sorted((e for e in schedule.events if e.track == "compute" and e.bucket is not None),
                          key=lambda e: e.start))
    times: dict[str, float] = {}
    offset, last, now = 0.0, -1, 0.0
    for node in final.graph.nodes:
        if node.op == "output":
            continue
        i = index.get(node.name)
        if i is not None and i < len(starts):
            last, now = i, starts[i] + offset
        elif _is_device_path_wait(node):
            update = next(updates, None)
            if update is not None and last + 1 < len(starts):
                # the node after the ready point starts when the update ends
                now, offset = update.start, update.end - starts[last + 1]
        times[node.name] = now
    return times


def recompute_spans(final: TrainGraph, positions: Mapping[str, float], end: float) -> list[RecomputeSpan]:
    """Maximal runs of consecutive nodes of one recomputed region, in execution order."""
    nodes = [n for n in final.graph.nodes if n.op != "output"]
    spans: list[RecomputeSpan] = []
    run: list[fx.Node] = []
    for node in [*nodes, None]:
        region = node.meta.get("recompute") if node is not None else None
        if run and region != run[0].meta["recompute"]:
            spans.append(RecomputeSpan(run[0].meta["recompute"], tuple(n.name for n in run),
                                       user_line_of_stack_trace(run[0].meta.get("stack_trace")),
                                       positions[run[0].name], positions[node.name] if node is not None else end))
            run = []
        if region is not None:
            run.append(node)
    return spans


def _curve(label: str, graph: TrainGraph, positions: Mapping[str, float]) -> MemoryCurve:
    """The liveness analysis of `graph` at the positions of the final graph's nodes of the same
    name; a node the final graph lacks sits where the node before it does."""
    profile = analyze_memory(graph)
    xs, x = [], 0.0
    for name in profile.nodes:
        x = positions.get(name, x)
        xs.append(x)
    return MemoryCurve(label, tuple(xs), profile.live)


def _positions(stages: Mapping[str, TrainGraph], schedule: Prediction | None) -> tuple[dict[str, float], float, bool]:
    """Where each node of the final graph sits, where the step ends, and whether that is
    predicted time (a planned schedule) rather than the final graph's node order."""
    final, planned = stages["final"], _planned_stage(stages)
    if schedule is not None and planned is not None:
        positions = node_times(final, planned, schedule)
        return positions, max([schedule.step_seconds, *(e.end for e in schedule.events), *positions.values()]), True
    nodes = [n for n in final.graph.nodes if n.op != "output"]
    return {n.name: float(i) for i, n in enumerate(nodes)}, float(max(len(nodes) - 1, 1)), False


def timed_recompute_spans(stages: Mapping[str, TrainGraph], schedule: Prediction | None) -> list[RecomputeSpan]:
    """The recompute spans at predicted times; none without a planned schedule (no node times)."""
    positions, end, timed = _positions(stages, schedule)
    return recompute_spans(stages["final"], positions, end) if timed else []


def step_picture(stages: Mapping[str, TrainGraph], schedule: Prediction | None) -> StepPicture:
    """The memory curves and recompute spans of a compiled step (its stages, `final` last), on
    predicted time when the offload planner planned a schedule, else on the final graph's nodes."""
    final, planned = stages["final"], _planned_stage(stages)
    positions, end, timed = _positions(stages, schedule)
    curves = [_curve("compiled step", final, positions)]
    if any("recompute" in n.meta for n in final.graph.nodes):
        curves.append(_curve("without recompute (every activation kept)", without_recompute(final), positions))
    if planned is not None and any(s.host for s in final.signature.inputs):
        curves.append(_curve("without offload (optimizer state on the device)", planned, positions))
    return StepPicture(timed, end, tuple(curves), tuple(recompute_spans(final, positions, end)))


def chrome_trace(schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]],
                 recompute: Sequence[RecomputeSpan] = ()) -> dict[str, Any]:
    """The trace; `recompute` (spans on predicted time) goes on the predicted process's
    `recompute` track, each span with its region, source line and nodes as args."""
    events: list[dict[str, Any]] = []
    for pid, label in ((1, "predicted"), (2, "measured")):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        for tid, track in enumerate(TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
    if schedule is not None:
        for e in schedule.events:
            events.append({"ph": "X", "pid": 1, "tid": TRACKS.index(e.track), "name": e.name,
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                           "args": {"bucket": e.bucket, "path": schedule.assignment[e.bucket] if e.bucket is not None else ""}})
    if recompute:
        tid = len(TRACKS)
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": RECOMPUTE}})
        for span in recompute:
            events.append({"ph": "X", "pid": 1, "tid": tid, "name": f"recompute {span.region}",
                           "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6,
                           "args": {"region": span.region, "where": span.where or "", "nodes": list(span.nodes)}})
    for track, name, start, end in measured:
        events.append({"ph": "X", "pid": 2, "tid": TRACKS.index(track), "name": name,
                       "ts": start * 1e6, "dur": (end - start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_s": schedule.step_seconds if schedule else None}}


def write_chrome_trace(path: str, schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]],
                       recompute: Sequence[RecomputeSpan] = ()) -> str:
    with open(path, "w") as f:
        json.dump(chrome_trace(schedule, measured, recompute), f)
    return path


_CURVE_COLOURS = ("#756bb1", "#e6550d", "#636363")
_RECOMPUTE_COLOUR = "#fdd0a2"


def schedule_figure(schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]] = (),
                    picture: StepPicture | None = None, title: str = "graphoffload step"):
    """The figure `plot` writes (matplotlib, Agg). With a planned schedule: its predicted tracks
    (and a recompute lane) above the predicted device memory, on one time axis that runs to the
    end of the last event. Without one: the measured spans of the last run, if any, above the
    device memory at each node of the final graph, against the nodes' order, since a run
    measures spans, not node times. The memory panel draws each of `picture`'s curves, the
    compiled step's first, and shades its recompute spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = picture.timed if picture is not None else schedule is not None
    spans = picture.recompute if picture is not None else ()
    lanes = (*TRACKS, RECOMPUTE) if timed and spans else TRACKS
    colours = {"cpu": "#31a354", "device": "#3182bd", None: "#bdbdbd"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=timed, height_ratios=[2, 1])
    if schedule is not None:
        bars = [(e.track, e.start, e.end, colours[schedule.assignment[e.bucket] if e.bucket is not None else None])
                for e in schedule.events]
        labels = {"CPU-path bucket": colours["cpu"], "device-path bucket": colours["device"],
                  "forward + backward": colours[None]}
        top.set_title(f"{title}: predicted {schedule.step_seconds * 1e3:.2f} ms "
                      f"({schedule.assignment.count('device')} device / {schedule.assignment.count('cpu')} CPU updates)")
    else:
        track_colours = {"compute": colours[None], "d2h": "#fa9fb5", "cpu": colours["cpu"], "h2d": "#3182bd"}
        bars = [(track, start, end, track_colours[track]) for track, _, start, end in measured]
        labels = {"step (graph thread)": track_colours["compute"], "device-to-host copy": track_colours["d2h"],
                  "CPU update": track_colours["cpu"], "host-to-device upload": track_colours["h2d"]}
        step_s = max((end for track, name, _, end in measured if track == "compute"), default=0.0)
        top.set_title(f"{title}: measured {step_s * 1e3:.2f} ms (last run; no planned schedule)" if measured
                      else f"{title}: predicted device memory (no planned schedule, not run with offload)")
    if lanes[-1] == RECOMPUTE:
        bars += [(RECOMPUTE, s.start, s.end, _RECOMPUTE_COLOUR) for s in spans]
        labels["recomputed (activation checkpointing)"] = _RECOMPUTE_COLOUR
    for track, start, end, colour in bars:
        top.barh(lanes.index(track), (end - start) * 1e3, left=start * 1e3, height=0.6,
                 color=colour, edgecolor="black", linewidth=0.3)
    top.set_yticks(range(len(lanes)), lanes)
    top.invert_yaxis()
    top.set_xlabel("time in step (ms, " + ("predicted)" if timed else "measured)"))
    # outside the axes, right of the tracks: inside, it covered the last bars
    top.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in labels.values()], labels=list(labels),
               loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    scale = 1e3 if timed else 1.0
    end = picture.end if picture is not None else 0.0
    for k, curve in enumerate(picture.curves if picture is not None else ()):
        # on time, the bytes at the last node stay live until the step's last event ends
        tail = 1 if timed else 0
        xs = [x * scale for x in curve.positions] + [end * scale] * tail
        ys = [b / 2**20 for b in curve.live]
        ys = ys + ys[-1:] * tail
        bottom.plot(xs, ys, color=_CURVE_COLOURS[k % len(_CURVE_COLOURS)], drawstyle="steps-post",
                    label=f"{curve.label}: peak {curve.peak / 2**20:.2f} MiB", linestyle="-" if k == 0 else "--")
        if k == 0:
            bottom.fill_between(xs, ys, alpha=0.3, color=_CURVE_COLOURS[0], step="post")
    for i, span in enumerate(spans):
        bottom.axvspan(span.start * scale, span.end * scale, color=_RECOMPUTE_COLOUR, alpha=0.5, linewidth=0,
                       label="recomputed (activation checkpointing)" if i == 0 else None)
    if timed:
        top.set_xlim(0, end * 1e3)
        bottom.set_xlabel("time in step (ms, predicted)")
    else:
        bottom.set_xlabel("node of the final graph (execution order)")
        bottom.set_xlim(0, max(end, 1))
    bottom.set_ylabel("device MiB")
    if picture is not None and picture.curves:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot(path: str, schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]] = (),
         picture: StepPicture | None = None, title: str = "graphoffload step") -> str:
    import matplotlib.pyplot as plt

    fig = schedule_figure(schedule, measured, picture, title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
