"""Host offload runtime: copy streams, CPU update worker, and the kernels of the graph ops that drive
them (declared, with their schemas and fake kernels, in graphoffload/ops/host_transfer.py).

The `offload_optimizer` pass rewrites each update bucket into four graph nodes:

    t1 = graphoffload.copy_to_host(grads, host_grads)           # D2H on the d2h stream
    t2 = graphoffload.host_adam_(t1, master, host_grads, ...)    # CPU update on a worker thread
    t3 = graphoffload.copy_to_device(t2, master, staging, params)  # H2D on the h2d stream
    graphoffload.wait_device(t3, params)                         # compute stream waits

Each launch returns a *ticket* (an int64 scalar) that the next op consumes, so the order is a
data edge, and every op that fills a tensor lists it as mutated, so alias analysis and
dead-code elimination see the writes. Launches never block the graph thread: the CPU update
and the upload run on the worker, which waits for the D2H copy's event; only `wait_device`
blocks, where the graph needs the uploaded parameters.

Races this avoids (each one shipped in another offload implementation): the d2h stream waits
for the compute stream before reading a gradient, and the gradient's block is kept from reuse
with `record_stream` until the copy is done; the h2d stream waits for an event recorded where
the graph issued the upload, after every reader of the parameter on the compute stream; the
compute stream waits for the upload's event before anything reads the parameter again.

On a machine without CUDA the same ops run with CPU tensors: copies are real copies into
separate buffers and the update still runs on the worker thread, so tests exercise the whole
schedule. The runtime in use is the one activated by the executor (`with runtime.active()`),
a context variable rather than process-global state.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from graphoffload.calibration import use_intraop_threads
from graphoffload.ops import host_transfer
from graphoffload.errors import StateError, describe
from graphoffload.ops.host_transfer import COPY_STREAMS, param_of_grad_sum_key
from graphoffload.runtime.sanitizer import Sanitizer

_ACTIVE: contextvars.ContextVar[OffloadRuntime | None] = contextvars.ContextVar("graphoffload_offload", default=None)


def _done(value: object) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _landed(fut: Future) -> object:
    """A task's result once what it started has landed: the event a copy stream recorded (the
    result of a device copy) is waited for on the host; None (nothing on a stream) passes."""
    event = fut.result()
    if event is not None:
        event.synchronize()
    return event


class OffloadRuntime:
    """Streams, the CPU worker and in-flight tickets of one compiled step."""

    def __init__(self, device: torch.device, cpu_workers: int = 1, cpu_threads: int | None = None,
                 sanitizer: Sanitizer | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # the CPU runtime's copies are synchronous; a sanitizer makes them late and poisoned
        self.sanitizer = None if self.cuda else sanitizer
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # one stream per entry of COPY_STREAMS: prefetches (issued early by the graph thread) and
        # uploads (issued late by the worker) on separate host-to-device streams, so an upload
        # never queues behind prefetches issued before it, as the planner assumes
        self.streams = {name: torch.cuda.Stream(self.device) for name in COPY_STREAMS} if self.cuda else {}
        self.d2h = self.streams.get("d2h")
        # one worker by default: buckets update in FIFO order and the fused CPU kernel already
        # uses torch's intra-op threads. A new thread's current CUDA device is 0, not the
        # caller's: `torch.cuda.stream(stream)` would switch it to ours and back to 0 on exit,
        # creating a context on GPU 0 in every process of a multi-GPU job, so workers start on ours
        # `cpu_threads`: each worker's intra-op threads (Offload.cpu_threads), None: torch's default
        self.pool = ThreadPoolExecutor(max_workers=cpu_workers, thread_name_prefix="graphoffload-host",
                                       initializer=_start_worker, initargs=(self.device, cpu_threads))
        if cpu_threads is not None:
            _start_all(self.pool, cpu_workers)
        self._tickets: dict[int, Future] = {}
        self._next = 0
        self.spans: list[tuple[str, str, float, float]] = []   # (track, name, start, end) of the last step
        self._t0 = time.perf_counter()
        # on CUDA the copies run on the streams, not on a thread: their spans are timing events,
        # read after the GPU got there (measured_spans), relative to an event at the step's start
        self._stream_spans: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._t0_event: torch.cuda.Event | None = None
        # uploads a step handed over to the next one (Offload.overlap_next_step): bucket key ->
        # the upload's future; `inbound` is what the running step took over from the last one
        self.carried: dict[str, Future] = {}
        self.inbound: dict[str, Future] = {}
        # device-path write-backs a step let land after it returned (carry_host_write): the host
        # tensor's address -> the copy's future; readers of that host memory wait for it
        self.host_writes: dict[int, Future] = {}
        # the error of the first handed-over add into a running sum that failed: the window's
        # sums are incomplete, so the step refuses to run or save until its load_state_dict
        # resets them (and clears this)
        self.failed_sums: StateError | None = None
        # fp32 copies of low-precision host gradients, by (gradient buffer, shape, dtype): kept
        # across steps, as the gradient buffers themselves are
        self.widened_grads: dict[tuple[int, tuple[int, ...], torch.dtype], Tensor] = {}

    def shutdown(self) -> None:
        """End the worker threads once the work already queued has run (uploads handed over to a
        call that will never come still land). Does not wait, so it is safe from a finalizer."""
        self.pool.shutdown(wait=False)

    def _span(self, track: str, name: str, start: float) -> None:
        self.spans.append((track, name, start - self._t0, time.perf_counter() - self._t0))

    def _stream_start(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _stream_end(self, track: str, name: str, start: torch.cuda.Event, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """The event that marks the end of copies on `stream`; threads may block on it."""
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        end.record(stream)
        self._stream_spans.append((track, name, start, end))
        return end

    def measured_spans(self) -> list[tuple[str, str, float, float]]:
        """(track, name, start, end) in seconds from the last step's start: the CPU worker's and,
        on CUDA, each copy stream's (this waits for the GPU to finish the step's copies). Waits
        for the worker's tasks the step handed over (running sums' adds, uploads) to end first:
        they are the step's work, still running after it returned."""
        for fut in list(self.carried.values()):
            fut.exception()
        spans = list(self.spans)
        if self.cuda and self._t0_event is not None:
            # the worker may still record uploads handed over to the next step: read only the
            # events recorded before the synchronization, which it completes
            recorded = list(self._stream_spans)
            torch.cuda.synchronize(self.device)
            t0 = self._t0_event
            spans += [(track, name, t0.elapsed_time(a) / 1e3, t0.elapsed_time(b) / 1e3)
                      for track, name, a, b in recorded]
        return spans

    @contextlib.contextmanager
    def active(self) -> Iterator[OffloadRuntime]:
        token = _ACTIVE.set(self)
        self.spans, self._t0 = [], time.perf_counter()
        if self.cuda:
            self._stream_spans = []
            self._t0_event = self._stream_start(torch.cuda.current_stream(self.device))
        self.inbound, self.carried = self.carried, {}
        failed = False
        try:
            yield self
        except BaseException:
            failed = True
            raise
        finally:
            _ACTIVE.reset(token)
            self.drain(settle_sums=failed)
            self._span("compute", "step", self._t0)

    def drain(self, settle_sums: bool = False) -> None:
        """Wait for every in-flight task (after a step, or when a step failed half-way), except
        the uploads and running sums' adds the step handed over to the next one. `settle_sums`
        (the step failed): wait for the handed-over adds too, so whatever the caller does
        after the error sees finished sums; a failed add stays carried, and the next call or
        `synchronize()` raises its error."""
        pending, self._tickets = list(self._tickets.values()), {}
        for fut in pending:
            fut.exception()
        # an upload the last step handed over that this one failed before waiting for: the
        # next step (or synchronize) still must
        for key, fut in self.inbound.items():
            self.carried.setdefault(key, fut)
        self.inbound = {}
        if settle_sums:
            for key, fut in self.carried.items():
                if param_of_grad_sum_key(key) is not None:
                    fut.exception()

    def synchronize(self, keep: frozenset[str] = frozenset()) -> None:
        """Wait until every handed-over upload has landed in the parameters, every carried
        write-back in the host state and every handed-over add in its running sum. `keep`:
        hand-over keys of running sums to leave carried (the next call waits for them itself).
        A failed add raises here (`StateError`), after everything else has been waited for."""
        carried = {key: fut for key, fut in self.carried.items() if key not in keep}
        self.carried = {key: fut for key, fut in self.carried.items() if key in keep}
        writes, self.host_writes = list({id(f): f for f in self.host_writes.values()}.values()), {}
        for fut in [*carried.values(), *writes]:
            fut.exception()   # everything lands before any error is raised
        for key, fut in carried.items():
            self._handed_over_result(key, fut)
        self._wait_host_writes(writes)

    def _handed_over_result(self, key: str, fut: Future) -> object:
        """The result of a handed-over task, waiting for it; an upload's error as it is, a
        running sum's add's as a `StateError` that says what it leaves behind."""
        param = param_of_grad_sum_key(key)
        if param is None:
            return _landed(fut)
        try:
            return fut.result()
        except Exception as exc:
            error = StateError(
                f"the CPU add of an earlier accumulating call into the running gradient sum of {param} failed after "
                f"that call returned ({describe(exc)}), so this accumulation window's sums are incomplete and an "
                "update from them would be wrong. Restore the model, the optimizer and the step from a checkpoint "
                "(step.load_state_dict(...) resets the window to the checkpoint's), then go on")
            if self.failed_sums is None:
                self.failed_sums = error
            raise error from exc

    @property
    def in_flight(self) -> bool:
        """Whether an upload or a write-back of an earlier step may still be landing."""
        return bool(self.carried or self.host_writes)

    def issue(self, fut: Future) -> Tensor:
        ticket = self._next
        self._next += 1
        self._tickets[ticket] = fut
        return torch.tensor(ticket, dtype=torch.int64)

    def redeem(self, ticket: Tensor) -> Future:
        return self._tickets.pop(int(ticket))

    # ---------------------------------------------------------------- the ops' bodies

    def copy_to_host(self, device_tensors: list[Tensor], host: list[Tensor]) -> Tensor:
        if self.sanitizer is not None:
            sources = [d.clone() for d in device_tensors]   # read at launch, as the stream does

            def land():
                for s, h in zip(sources, host):
                    h.copy_(s)
            return self.issue(self.sanitizer.launch("d2h", host, [], land))
        if not self.cuda:
            start = time.perf_counter()
            for d, h in zip(device_tensors, host):
                h.copy_(d)
            self._span("d2h", "copy", start)
            return self.issue(_done(None))
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            start = self._stream_start(self.d2h)
            for d, h in zip(device_tensors, host):
                h.copy_(d, non_blocking=True)
                d.record_stream(self.d2h)
            # threads block on this event (the worker before its update, wait_host): a blocking
            # event makes them sleep instead of spinning on a core the CPU update needs
            event = self._stream_end("d2h", "copy", start, self.d2h)
        return self.issue(_done(event))

    def _host_writes_into(self, host: list[Tensor]) -> list[Future]:
        """The carried write-backs (an earlier step's, landing late) into any of `host`."""
        found = {id(f): f for h in host for f in [self.host_writes.get(h.data_ptr())] if f is not None}
        return list(found.values())

    def _wait_host_writes(self, writes: list[Future]) -> None:
        for fut in writes:
            _landed(fut)

    def run_on_host(self, after: Tensor, work, name: str = "update") -> Tensor:
        dependency = self.redeem(after)
        # a host update may read host memory a carried write-back is still filling (only after a
        # re-plan moved a bucket between paths; the write-back landed long ago otherwise)
        writes = list({id(f): f for f in self.host_writes.values()}.values())

        def task():
            self._wait_host_writes(writes)
            _landed(dependency)
            start = time.perf_counter()
            result = work()
            self._span("cpu", name, start)   # the measured timeline's span on the CPU track
            return result
        if self.sanitizer is not None:
            return self.issue(self.sanitizer.launch("cpu", [], [], task))
        return self.issue(self.pool.submit(task))

    def copy_to_device(self, after: Tensor, master: list[Tensor], staging: list[Tensor],
                       device_tensors: list[Tensor]) -> Tensor:
        dependency = self.redeem(after)
        issued_at = None
        if self.cuda:
            issued_at = torch.cuda.Event()
            issued_at.record(torch.cuda.current_stream(self.device))

        writes = self._host_writes_into(master)

        def task():
            self._wait_host_writes(writes)
            dependency.result()
            sources = master
            if staging:
                for s, m in zip(staging, master):
                    s.copy_(m)
                sources = staging
            if not self.cuda:
                start = time.perf_counter()
                for d, s in zip(device_tensors, sources):
                    d.copy_(s)
                self._span("h2d", "upload", start)
                return None
            self.streams["h2d_upload"].wait_event(issued_at)
            with torch.cuda.stream(self.streams["h2d_upload"]):
                start = self._stream_start(self.streams["h2d_upload"])
                for d, s in zip(device_tensors, sources):
                    d.copy_(s, non_blocking=True)
                return self._stream_end("h2d", "upload", start, self.streams["h2d_upload"])
        if self.sanitizer is not None:
            return self.issue(self.sanitizer.launch("h2d", [*device_tensors, *staging], [], task))
        return self.issue(self.pool.submit(task))

    def prefetch(self, host: list[Tensor], after: list[Tensor] | None = None) -> list[Tensor]:
        """Copies of host tensors on the device, filled asynchronously; the ticket comes last.
        `after`: tickets of device-to-host copies that fill `host`; the prefetch stream waits for
        them on the GPU (stream order), the host does not block."""
        dependencies = [self.redeem(t) for t in after or []] + self._host_writes_into(host)
        out = [torch.empty_like(h, device=self.device) for h in host]
        if self.sanitizer is not None:
            # read when it runs, after its dependencies, as the stream does
            sources = [h.clone() for h in host] if not dependencies else host

            def land():
                for o, s in zip(out, sources):
                    o.copy_(s)
            return out + [self.issue(self.sanitizer.launch("h2d", out, dependencies, land))]
        if not self.cuda:
            for dependency in dependencies:
                dependency.result()
            for o, h in zip(out, host):
                o.copy_(h)
            return out + [self.issue(_done(None))]
        for dependency in dependencies:
            event = dependency.result()   # a copy stream's event: recorded already, not waited for
            if event is not None:
                self.streams["h2d_prefetch"].wait_event(event)
        # the buffers may reuse blocks that held activations the compute stream still reads
        self.streams["h2d_prefetch"].wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.streams["h2d_prefetch"]):
            start = self._stream_start(self.streams["h2d_prefetch"])
            for o, h in zip(out, host):
                o.copy_(h, non_blocking=True)
                o.record_stream(self.streams["h2d_prefetch"])
            event = self._stream_end("h2d", "prefetch", start, self.streams["h2d_prefetch"])
        return out + [self.issue(_done(event))]

    def wait_host(self, ticket: Tensor) -> None:
        _landed(self.redeem(ticket))

    def carry_host_write(self, ticket: Tensor, host: list[Tensor]) -> None:
        fut = self.redeem(ticket)
        for h in host:
            self.host_writes[h.data_ptr()] = fut

    def wait_device(self, ticket: Tensor) -> None:
        self._wait_on_compute_stream(self.redeem(ticket))

    def _wait_on_compute_stream(self, fut: Future) -> None:
        event = fut.result()
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def hand_over(self, ticket: Tensor, key: str) -> None:
        self.carried[key] = self.redeem(ticket)

    def wait_handed_over(self, key: str) -> None:
        fut = self.inbound.pop(key, None)
        if fut is None:   # the first step has nothing to wait for
            return
        if param_of_grad_sum_key(key) is not None:   # a running sum's add: done on the host
            self._handed_over_result(key, fut)
        else:
            self._wait_on_compute_stream(fut)

    def sums_in_flight(self) -> list[str]:
        """Parameters whose running sum an earlier call's CPU add may still be writing (handed
        over, not waited for yet), for tests and inspection."""
        return [p for key, fut in self.carried.items() for p in [param_of_grad_sum_key(key)]
                if p is not None and not fut.done()]


def _start_worker(device: torch.device, threads: int | None) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads is not None:
        use_intraop_threads(threads)


def _start_all(pool: ThreadPoolExecutor, workers: int) -> None:
    """Start every worker now, then restore this thread's intra-op count as torch's default
    (`use_intraop_threads` changed it for threads that start later)."""
    own = torch.get_num_threads()
    started = threading.Barrier(workers)
    for fut in [pool.submit(started.wait) for _ in range(workers)]:
        fut.result()
    torch.set_num_threads(own)


def active_runtime() -> OffloadRuntime:
    runtime = _ACTIVE.get()
    if runtime is None:
        raise RuntimeError("graphoffload offload ops run inside a compiled step's executor (or `with "
                           "OffloadRuntime(device).active():`), which owns their streams and worker")
    return runtime


# ------------------------------------------------------------------ graph ops
# the kernels of the ops graphoffload/ops/host_transfer.py declares (their docstrings say what each does)

@host_transfer.copy_to_host.register_kernel(None)
def copy_to_host(grads: list[Tensor], host: list[Tensor]) -> Tensor:
    return active_runtime().copy_to_host(grads, host)


def _host_fp32_grads(runtime: OffloadRuntime, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    # low-precision gradients land as they are and are widened here, on the host, into
    # persistent scratch (one buffer per gradient buffer) rather than new memory every step
    out = []
    for p, g in zip(params, grads):
        if g.dtype != p.dtype:
            key = (g.data_ptr(), tuple(g.shape), p.dtype)
            if key not in runtime.widened_grads:
                runtime.widened_grads[key] = torch.empty(g.shape, dtype=p.dtype)
            g = runtime.widened_grads[key].copy_(g)
        out.append(g)
    return out


def _scale_host_grads(grads: list[Tensor], grad_multiplier: Tensor | None) -> None:
    # the step's own scaling of the gradients after backward (clip_grad_norm_'s clip_coef), moved
    # to the host copies: the same elementwise product, so the same bits
    if grad_multiplier is not None:
        torch._foreach_mul_(grads, grad_multiplier)


@host_transfer.host_adam_.register_kernel(None)
def host_adam_(after: Tensor, params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
               exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor], lr: Tensor,
               beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool, maximize: bool,
               decoupled: bool, grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
               grad_multiplier: Tensor | None = None) -> Tensor:
    lr = lr.clone()   # the graph's lr tensor may be gone by the time the worker runs
    runtime = active_runtime()

    def work():
        _scale_host_grads(grads, grad_multiplier)
        torch._foreach_add_(steps, 1)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(params, _host_fp32_grads(runtime, params, grads), exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
               lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
               maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
    return runtime.run_on_host(after, work)


@host_transfer.host_sgd_.register_kernel(None)
def host_sgd_(after: Tensor, params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
              lr: Tensor, weight_decay: float, momentum: float, dampening: float, nesterov: bool,
              maximize: bool, is_first_step: bool, grad_scale: Tensor | None = None,
              found_inf: Tensor | None = None, grad_multiplier: Tensor | None = None) -> Tensor:
    lr = lr.clone()
    runtime = active_runtime()

    def work():
        _scale_host_grads(grads, grad_multiplier)
        torch._fused_sgd_(params, _host_fp32_grads(runtime, params, grads), momentum_buffers, weight_decay=weight_decay,
                          momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize,
                          is_first_step=is_first_step, grad_scale=grad_scale, found_inf=found_inf)
    return runtime.run_on_host(after, work)


@host_transfer.host_accumulate_.register_kernel(None)
def host_accumulate_(after: Tensor, sums: list[Tensor], grads: list[Tensor], drain: bool) -> Tensor:
    def work():
        if drain:   # g + sum, as the device form's last add: fp32 addition commutes bit for bit
            torch._foreach_add_(grads, sums)
            torch._foreach_zero_(sums)
        else:
            torch._foreach_add_(sums, grads)
    return active_runtime().run_on_host(after, work, "accumulate")


@host_transfer.host_grad_norm_.register_kernel(None)
def host_grad_norm_(after: Tensor, grads: list[Tensor], out: list[Tensor], ord: float, foreach: bool) -> Tensor:
    def work():
        # the op the step's clip_grad_norm_ traced, on the host copies: the same reduction over
        # the same fp32 (or the gradients' own dtype) values
        norms = torch._foreach_norm(grads, ord) if foreach else [torch.linalg.vector_norm(g, ord) for g in grads]
        for o, n in zip(out, norms):
            o.copy_(n)
    return active_runtime().run_on_host(after, work, "norm")


@host_transfer.host_unscale_.register_kernel(None)
def host_unscale_(after: Tensor, scale_after: Tensor, grads: list[Tensor], found_inf: list[Tensor],
                  inv_scale: Tensor) -> Tensor:
    runtime = active_runtime()
    scale_copied = runtime.redeem(scale_after)

    def work():
        _landed(scale_copied)   # the copy of inv_scale
        # the op the step's GradScaler traced, on the host copies: the same check, the same product
        found_inf[0].zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf[0], inv_scale)
    return runtime.run_on_host(after, work, "unscale")


@host_transfer.copy_to_device.register_kernel(None)
def copy_to_device(after: Tensor, master: list[Tensor], staging: list[Tensor], params: list[Tensor]) -> Tensor:
    return active_runtime().copy_to_device(after, master, staging, params)


@host_transfer.prefetch_to_device.register_kernel(None)
def prefetch_to_device(host: list[Tensor], device: torch.device, after: list[Tensor]) -> list[Tensor]:
    return active_runtime().prefetch(host, after)


@host_transfer.wait_host.register_kernel(None)
def wait_host(ticket: Tensor, host: list[Tensor]) -> None:
    active_runtime().wait_host(ticket)


@host_transfer.carry_host_write.register_kernel(None)
def carry_host_write(ticket: Tensor, host: list[Tensor]) -> None:
    active_runtime().carry_host_write(ticket, host)


@host_transfer.wait_device.register_kernel(None)
def wait_device(ticket: Tensor, params: list[Tensor]) -> None:
    active_runtime().wait_device(ticket)


@host_transfer.hand_over.register_kernel(None)
def hand_over(ticket: Tensor, params: list[Tensor], key: str) -> None:
    active_runtime().hand_over(ticket, key)


@host_transfer.wait_handed_over.register_kernel(None)
def wait_handed_over(params: list[Tensor], key: str) -> None:
    active_runtime().wait_handed_over(key)


