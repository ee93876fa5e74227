"""The errors graphoffload raises: each says what is wrong and what to do about it."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """`Type: first line of the message`, to quote a lower-level error inside one of ours."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class GraphOffloadError(Exception):
    """Base class of every graphoffload error."""


class CaptureError(GraphOffloadError):
    """The train step cannot be captured as one graph (data-dependent control flow, `.item()`,
    no backward, ...). The message names the user's source line where it can."""


class UnsupportedError(GraphOffloadError):
    """An op, optimizer or option graphoffload does not support (yet)."""


class HostSumsUnsupportedError(UnsupportedError):
    """The step's running gradient sums cannot live on the host (`Offload(accumulate_on="host")`):
    it reads them, or the accumulated gradients, in a way host sums do not serve. A class of its own
    so that `accumulate_on="auto"` under ZeRO, which tries host sums for the whole step, can tell
    this refusal from any other and keep the sums on the device instead."""


class PassError(GraphOffloadError):
    """A pass failed or left the graph broken; the message names the pass."""


class StateError(GraphOffloadError):
    """The model, the optimizer, or the ranks' inputs are in a state a compiled step cannot
    start from."""


class PartialUpdateError(StateError):
    """A compiled step was interrupted after some of its fused updates ran: the model and
    optimizer are part-way through an update. The message names what was updated."""


class RankTimeoutError(GraphOffloadError, RuntimeError):
    """A rank of a parallel step's group did not answer in time: it failed, or never reached the
    step. Raised on the ranks that waited, instead of a hang. The step's groups are not used
    again: after it (and its subclasses), every later call, `synchronize()` and `state_dict()` of
    that step raise `StateError` at once, whether or not the step had changed anything. End every
    rank and restart the job from the last checkpoint. The rank whose own error (or interrupt) made
    the others time out gets that error, not this one; its step refuses later uses alike if the
    error came after the step's first collective (its peers went on into later ones)."""


class RingTimeoutError(RankTimeoutError):
    """Under sequence parallelism, a rank did not answer in time: it failed, or never reached
    the step or one of its ring exchanges. Raised on the ranks that waited, instead of a hang."""


class RankFailedMidUpdateError(RankTimeoutError, PartialUpdateError):
    """A rank of a parallel step's group failed inside the step after this rank's fused updates
    had changed part of the model and optimizer: both a `RankTimeoutError` (the group is gone:
    restart the job) and a `PartialUpdateError` (the message names what changed)."""


class StepRunError(GraphOffloadError):
    """An op of the compiled graph failed while the step ran (bad input values, such as token
    ids beyond an embedding table). The message names the op and the user's source line it
    was captured from; the original error is its `__cause__`."""
