"""Where in the user's code a node, an error or a call comes from.

Capture, the passes, the runtime and inspection all point errors and notes at the user's line
(a node's recorded `stack_trace`, a traceback, the calling frame), skipping the frames of torch
and of graphoffload itself; this module is the one place that knows how.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import sys
import traceback
from types import FrameType

import torch


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)   # without importing it: the runtime stays unloaded
    return os.path.join(list(spec.submodule_search_locations)[0], "")


# frames under these directories are not the user's code: torch, and graphoffload's three
# packages (passes/ and runtime/ sit beside graphoffload/ in a source checkout)
OWN_DIRS = (os.path.join(os.path.dirname(torch.__file__), ""), os.path.join(os.path.dirname(__file__), ""),
            _package_dir("graphoffload.passes"), _package_dir("graphoffload.runtime"))


def calling_user_line() -> str | None:
    """`File "...", line N, in name` + code of the innermost frame outside torch and graphoffload."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(OWN_DIRS):
        frame = frame.f_back
    return frame_line(frame)


def frame_line(frame: FrameType | None) -> str | None:
    """`File "...", line N, in name` + code of `frame` (calling_user_line's format)."""
    if frame is None:
        return None
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f'File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n    {text}'


def user_frame(tb: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of user code (not torch, not graphoffload)."""
    for frame in reversed(tb):
        if not frame.filename.startswith(OWN_DIRS) and not frame.filename.startswith("<"):
            return frame
    return None


def user_line_of_stack_trace(stack_trace: str | None) -> str | None:
    """'file:line in func' of the innermost user frame of a node's recorded stack trace."""
    if not stack_trace:
        return None
    lines = [ln.strip() for ln in stack_trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i]
        if ln.startswith('File "'):
            path = ln.split('"')[1]
            if not path.startswith(OWN_DIRS) and not path.startswith("<"):
                rest = ln.split('"', 2)[2].strip(", ")
                code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith('File "') else ""
                return f"{os.path.basename(path)}:{rest.replace('line ', '')}" + (f"  {code}" if code else "")
    return None


def where_in_user_code(exc: BaseException) -> str:
    frame = user_frame(traceback.extract_tb(exc.__traceback__))
    if frame is None:
        return ""
    return f" at {frame.filename}:{frame.lineno} ({frame.name}): {(frame.line or '').strip()}"


def is_installed_package(filename: str) -> bool:
    """A file of an installed library (transformers, ...) rather than the user's own code."""
    parts = filename.split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts
