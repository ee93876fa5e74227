"""The step's schedule as a picture: a Chrome/Perfetto trace and a PNG with device memory.

`chrome_trace` puts the offload planner's predicted timeline (one track per stream: compute,
host-to-device, device-to-host, CPU worker) beside the measured spans of the last run, as two
processes of one trace that chrome://tracing or ui.perfetto.dev opens. `plot` draws the
predicted schedule above the device memory over the step (live bytes from the memory analysis
plus prefetched state), which shows what fills the memory and when it frees up; a step without
a planned schedule (every update on the CPU path, no calibration) is drawn from what its last
run measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from graphoffload.passes.offload_planner import Prediction

TRACKS = ("compute", "h2d", "d2h", "cpu")


def chrome_trace(schedule: Prediction | None, measured: list[tuple[str, str, float, float]]) -> dict[str, Any]:
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
    for track, name, start, end in measured:
        events.append({"ph": "X", "pid": 2, "tid": TRACKS.index(track), "name": name,
                       "ts": start * 1e6, "dur": (end - start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_s": schedule.step_seconds if schedule else None}}


def write_chrome_trace(path: str, schedule: Prediction | None, measured: list[tuple[str, str, float, float]]) -> str:
    with open(path, "w") as f:
        json.dump(chrome_trace(schedule, measured), f)
    return path


def schedule_figure(schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]] = (),
                    live_bytes: Sequence[int] = (), title: str = "graphoffload step"):
    """The figure `plot` writes (matplotlib, Agg). With a planned schedule: its predicted tracks
    above the predicted device memory, on one time axis that runs to the end of the last
    event. Without one (every bucket on the CPU path, no calibration): the measured spans of the
    last run above the device memory at each node of the graph (`live_bytes`, from the memory
    analysis), against the nodes' order, since a run measures spans, not node times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"cpu": "#31a354", "device": "#3182bd", None: "#bdbdbd"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=schedule is not None, height_ratios=[2, 1])
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
        top.set_title(f"{title}: measured {step_s * 1e3:.2f} ms (last run; no planned schedule)")
    for track, start, end, colour in bars:
        top.barh(TRACKS.index(track), (end - start) * 1e3, left=start * 1e3, height=0.6,
                 color=colour, edgecolor="black", linewidth=0.3)
    top.set_yticks(range(len(TRACKS)), TRACKS)
    top.invert_yaxis()
    top.set_xlabel("time in step (ms, " + ("predicted)" if schedule is not None else "measured)"))
    # outside the axes, right of the tracks: inside, it covered the last bars
    top.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in labels.values()], labels=list(labels),
               loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    if schedule is not None:
        # the bytes at the last node stay live until the step's last event ends
        end = max([schedule.step_seconds, *(e.end for e in schedule.events)])
        xs = [t * 1e3 for t in schedule.node_start] + [end * 1e3]
        ys = [b / 2**20 for b in schedule.device_bytes]
        ys = ys + ys[-1:]
        top.set_xlim(0, end * 1e3)
        bottom.set_xlabel("time in step (ms, predicted)")
    else:
        xs, ys = list(range(len(live_bytes))), [b / 2**20 for b in live_bytes]
        bottom.set_xlabel("node of the final graph (execution order)")
        bottom.set_xlim(0, max(len(xs) - 1, 1))
    bottom.plot(xs, ys, color="#756bb1", drawstyle="steps-post")
    bottom.fill_between(xs, ys, alpha=0.3, color="#756bb1", step="post")
    bottom.set_ylabel("device MiB")
    fig.tight_layout()
    return fig


def plot(path: str, schedule: Prediction | None, measured: Sequence[tuple[str, str, float, float]] = (),
         live_bytes: Sequence[int] = (), title: str = "graphoffload step") -> str:
    import matplotlib.pyplot as plt

    fig = schedule_figure(schedule, measured, live_bytes, title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
