"""The host-transfer and host-update ops of the graph: schemas and fake kernels.

`offload_optimizer` and `park_gradients` emit these nodes; the runtime (runtime/host_offload.py)
registers their kernels, which run on its copy streams and CPU worker. Declaring them here lets
capture and the passes build and trace graphs that use them without importing the runtime, and
keeps each op's contract (what it mutates, what it returns) in one place.

Each launch returns a ticket (a 0-d int64 tensor) that its wait consumes, so data edges order
the side effects; the ops list in `mutates_args` what they write, so dead-code elimination
keeps them.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor


# the copy stream each transfer op runs on; `assign_streams` writes it into the graph
# (node.meta["stream"]) so the printed schedule shows it, and the runtime uses the same table
COPY_STREAMS = ("d2h", "h2d_prefetch", "h2d_upload")
_STREAM_OF_OP = {"copy_to_host": "d2h", "prefetch_to_device": "h2d_prefetch", "copy_to_device": "h2d_upload"}


def stream_of(target: object) -> str | None:
    """The copy stream a graph node's target runs on, or None for the compute stream / host."""
    name = getattr(target, "__name__", "")
    namespace = getattr(target, "namespace", None)
    return _STREAM_OF_OP.get(name.split(".")[0]) if namespace == "graphoffload" else None


def assign_streams(graph) -> None:
    """Record in `node.meta["stream"]` the copy stream of every transfer node of an fx graph."""
    for node in graph.nodes:
        stream = stream_of(node.target)
        if stream is not None:
            node.meta["stream"] = stream


# hand-over keys of the running gradient sums (Offload.accumulate_on="host"): an accumulating
# call hands its CPU add into a parameter's sum over to the next call under this key, and every
# variant of the step names that sum the same way, so the next call waits for it whichever
# variant it is, right before it first touches the sum
_GRAD_SUM_KEY = "grad_sum "


def grad_sum_key(param: str) -> str:
    """The hand-over key of the CPU add into `param`'s running gradient sum."""
    return _GRAD_SUM_KEY + param


def param_of_grad_sum_key(key: str) -> str | None:
    """The parameter whose running sum a hand-over key names, or None for another key (an upload's)."""
    return key[len(_GRAD_SUM_KEY):] if key.startswith(_GRAD_SUM_KEY) else None


def _no_kernel(name: str) -> RuntimeError:
    return RuntimeError(f"{name} has no kernel: its kernels live in the runtime (import graphoffload.runtime), "
                        "which runs it inside a compiled step's executor")


def _returns_nothing(*args, **kwargs) -> None:
    return None   # the fake kernel of a wait: it only orders, and writes nothing new


def _ticket_fake() -> Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("graphoffload::copy_to_host", mutates_args=("host",))
def copy_to_host(grads: list[Tensor], host: list[Tensor]) -> Tensor:
    """Start copying device tensors into host buffers; returns a ticket."""
    raise _no_kernel("graphoffload::copy_to_host")


@copy_to_host.register_fake
def _copy_to_host_fake(grads, host):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::host_adam_", 
                         mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps"))
def host_adam_(after: Tensor, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: Tensor,
               beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool, maximize: bool,
               decoupled: bool, grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
               grad_multiplier: Tensor | None = None) -> Tensor:
    """Adam/AdamW on host tensors, on the worker, once `after` is done; returns a ticket.
    With a GradScaler's `grad_scale`/`found_inf` (host copies) it unscales and skips on inf;
    with `grad_multiplier` (a host scalar) it first scales the gradients in place."""
    raise _no_kernel("graphoffload::host_adam_")


@host_adam_.register_fake
def _host_adam_fake(after, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay,
                    eps, amsgrad, maximize, decoupled, grad_scale=None, found_inf=None, grad_multiplier=None):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::host_sgd_", mutates_args=("params", "grads", "momentum_buffers"))
def host_sgd_(after: Tensor, params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
              lr: Tensor, weight_decay: float, momentum: float, dampening: float, nesterov: bool,
              maximize: bool, is_first_step: bool, grad_scale: Tensor | None = None,
              found_inf: Tensor | None = None, grad_multiplier: Tensor | None = None) -> Tensor:
    """SGD on host tensors, on the worker, once `after` is done; returns a ticket."""
    raise _no_kernel("graphoffload::host_sgd_")


@host_sgd_.register_fake
def _host_sgd_fake(after, params, grads, momentum_buffers, lr, weight_decay, momentum, dampening, nesterov, maximize,
                   is_first_step, grad_scale=None, found_inf=None, grad_multiplier=None):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::host_accumulate_", mutates_args=("sums", "grads"))
def host_accumulate_(after: Tensor, sums: list[Tensor], grads: list[Tensor], drain: bool) -> Tensor:
    """Running gradient sums kept on the host (`Offload.accumulate_on="host"`), on the worker,
    once `after` (the copy that landed `grads` on the host) is done; returns a ticket.
    `drain=False` (a call that accumulates): `sums += grads`. `drain=True` (the call that
    updates): `grads += sums`, then `sums` are zeroed for the next window, so the update that
    follows reads the window's whole gradient from `grads`."""
    raise _no_kernel("graphoffload::host_accumulate_")


@host_accumulate_.register_fake
def _host_accumulate_fake(after, sums, grads, drain):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::host_grad_norm_", mutates_args=("out",))
def host_grad_norm_(after: Tensor, grads: list[Tensor], out: list[Tensor], ord: float, foreach: bool) -> Tensor:
    """clip_grad_norm_'s per-gradient norms of gradients kept on the host (the accumulated
    gradients of `Offload(accumulate_on="host")`), on the worker, once `after` (the drain that
    made them whole) is done: `out[i] = ||grads[i]||_ord`, computed as the step computed them on
    the device (`torch._foreach_norm` when `foreach`, else `torch.linalg.vector_norm`), here on
    host tensors; returns a ticket (`prefetch_to_device` brings `out` to the device)."""
    raise _no_kernel("graphoffload::host_grad_norm_")


@host_grad_norm_.register_fake
def _host_grad_norm_fake(after, grads, out, ord, foreach):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::host_unscale_", mutates_args=("grads", "found_inf"))
def host_unscale_(after: Tensor, scale_after: Tensor, grads: list[Tensor], found_inf: list[Tensor],
                  inv_scale: Tensor) -> Tensor:
    """A GradScaler's inf check and unscale of gradients kept on the host (the accumulated
    gradients of `Offload(accumulate_on="host")`), on the worker, once `after` (the drain that
    made them whole) and `scale_after` (the copy that landed `inv_scale` on the host) are done:
    `found_inf[0]` is zeroed, then `torch._amp_foreach_non_finite_check_and_unscale_(grads,
    found_inf[0], inv_scale)`, the op the step traced, sets it to 1 on a non-finite element and
    multiplies the gradients by `inv_scale` in place; returns a ticket (`prefetch_to_device`
    brings the flag back, to be combined with the device checks' flag by its max)."""
    raise _no_kernel("graphoffload::host_unscale_")


@host_unscale_.register_fake
def _host_unscale_fake(after, scale_after, grads, found_inf, inv_scale):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::copy_to_device", mutates_args=("staging",))
def copy_to_device(after: Tensor, master: list[Tensor], staging: list[Tensor], params: list[Tensor]) -> Tensor:
    """Once `after` is done, copy host master weights (through low-precision staging buffers
    when the parameters are narrower) into the device parameters; returns a ticket. The
    parameters count as written by `wait_device`, where the data is there."""
    raise _no_kernel("graphoffload::copy_to_device")


@copy_to_device.register_fake
def _copy_to_device_fake(after, master, staging, params):
    return _ticket_fake()


@torch.library.custom_op("graphoffload::prefetch_to_device", mutates_args=())
def prefetch_to_device(host: list[Tensor], device: torch.device, after: list[Tensor]) -> list[Tensor]:
    """Start copying host tensors into new device buffers; returns the buffers, then a ticket
    that `wait_device` redeems before anything reads them. `after`: tickets of the copies to
    the host that fill `host` (the copy waits for them in stream order, the host does not), or
    of the worker's tasks that compute them (`host_grad_norm_`: the host waits for those)."""
    raise _no_kernel("graphoffload::prefetch_to_device")


@prefetch_to_device.register_fake
def _prefetch_to_device_fake(host, device, after):
    return [torch.empty_like(h, device=device) for h in host] + [_ticket_fake()]


@torch.library.custom_op("graphoffload::wait_host", mutates_args=("host",))
def wait_host(ticket: Tensor, host: list[Tensor]) -> None:
    """Block until the device-to-host copy behind `ticket` has landed in `host`."""
    raise _no_kernel("graphoffload::wait_host")


wait_host.register_fake(_returns_nothing)


@torch.library.custom_op("graphoffload::carry_host_write", mutates_args=("host",))
def carry_host_write(ticket: Tensor, host: list[Tensor]) -> None:
    """Let the device-to-host copy behind `ticket` land after the step returns, instead of
    blocking the host until it has: the next step's prefetch of `host` waits for it in stream
    order, host updates and uploads wait for it on the worker, and `synchronize()` (run before
    any outside access the step can see) waits for it on the host."""
    raise _no_kernel("graphoffload::carry_host_write")


carry_host_write.register_fake(_returns_nothing)


@torch.library.custom_op("graphoffload::wait_device", mutates_args=("params",))
def wait_device(ticket: Tensor, params: list[Tensor]) -> None:
    """Make the compute stream wait until the upload behind `ticket` has landed in `params`."""
    raise _no_kernel("graphoffload::wait_device")


wait_device.register_fake(_returns_nothing)


@torch.library.custom_op("graphoffload::hand_over", mutates_args=("params",))
def hand_over(ticket: Tensor, params: list[Tensor], key: str) -> None:
    """Let the upload behind `ticket` finish during the next step: that step's
    `wait_handed_over(key)` waits for it, right before its forward first reads `params`. Also
    the CPU add of an accumulating call into a running sum (`params`: the sum; key
    `grad_sum_key(name)`): the next call waits for it before it first touches that sum."""
    raise _no_kernel("graphoffload::hand_over")


hand_over.register_fake(_returns_nothing)


@torch.library.custom_op("graphoffload::wait_handed_over", mutates_args=("params",))
def wait_handed_over(params: list[Tensor], key: str) -> None:
    """Make the compute stream wait for the upload (or running sum's CPU add) the previous step
    handed over under `key`."""
    raise _no_kernel("graphoffload::wait_handed_over")


wait_handed_over.register_fake(_returns_nothing)


# Each op's node value as a function of its inputs' fake values: the fake kernels above,
# called directly under the graph's fake mode (`graphoffload.graph.fake_value`). They read only
# shapes, dtypes and devices, so the passes that build hundreds of these nodes skip the custom-op
# dispatcher, whose fake path costs 0.3-1.2 ms a call (cache keys over long operand lists,
# autograd and mutation bookkeeping): about 0.6 s of a 48-layer GPT's compile. The value is
# the same either way, as the registered fake kernel is this same function.
VALUE_RULES = MappingProxyType({
    torch.ops.graphoffload.copy_to_host.default: _copy_to_host_fake,
    torch.ops.graphoffload.host_adam_.default: _host_adam_fake,
    torch.ops.graphoffload.host_sgd_.default: _host_sgd_fake,
    torch.ops.graphoffload.host_accumulate_.default: _host_accumulate_fake,
    torch.ops.graphoffload.host_grad_norm_.default: _host_grad_norm_fake,
    torch.ops.graphoffload.host_unscale_.default: _host_unscale_fake,
    torch.ops.graphoffload.copy_to_device.default: _copy_to_device_fake,
    torch.ops.graphoffload.prefetch_to_device.default: _prefetch_to_device_fake,
    **{op.default: _returns_nothing for op in (torch.ops.graphoffload.wait_host, torch.ops.graphoffload.carry_host_write,
                                                torch.ops.graphoffload.wait_device, torch.ops.graphoffload.hand_over,
                                                torch.ops.graphoffload.wait_handed_over)},
})
