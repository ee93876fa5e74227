"""The step's schedule as a picture: a Chrome/Perfetto trace and a PNG with device memory.

`chrome_trace` puts the offload planner's predicted timeline (one track per stream: compute,
host-to-device, device-to-host, CPU worker) beside the measured spans of the last run, as two
processes of one trace that chrome://tracing or ui.perfetto.dev opens. `plot` draws the
predicted schedule above the device memory over the step (live bytes from the memory analysis
plus prefetched state), which shows what fills the memory and when it frees up.
"""

from __future__ import annotations

import json
from typing import Any

from graphoffload.offload_planner import Prediction

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


def plot(path: str, schedule: Prediction, title: str = "graphoffload step") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"cpu": "#31a354", "device": "#3182bd", None: "#bdbdbd"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, height_ratios=[2, 1])
    for e in schedule.events:
        path_kind = schedule.assignment[e.bucket] if e.bucket is not None else None
        top.barh(TRACKS.index(e.track), (e.end - e.start) * 1e3, left=e.start * 1e3, height=0.6,
                 color=colours[path_kind], edgecolor="black", linewidth=0.3)
    top.set_yticks(range(len(TRACKS)), TRACKS)
    top.invert_yaxis()
    top.set_title(f"{title}: predicted {schedule.step_seconds * 1e3:.2f} ms "
                  f"({schedule.assignment.count('device')} device / {schedule.assignment.count('cpu')} CPU updates)")
    top.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in ("cpu", "device", None)],
               labels=["CPU-path bucket", "device-path bucket", "forward + backward"], loc="lower right", fontsize=8)
    bottom.plot([t * 1e3 for t in schedule.node_start], [b / 2**20 for b in schedule.device_bytes], color="#756bb1")
    bottom.fill_between([t * 1e3 for t in schedule.node_start], [b / 2**20 for b in schedule.device_bytes],
                        alpha=0.3, color="#756bb1")
    bottom.set_ylabel("device MiB")
    bottom.set_xlabel("time in step (ms, predicted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
