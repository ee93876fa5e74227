"""Shared by the test modules: tiny model builders, the eager-vs-compiled training loop and the
comparisons every equivalence test makes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from gpt import GPT, GPTConfig
from steps import TINY, hf_step as hf_train_step, token_batches, train_step  # noqa: F401  (re-exported)

import graphoffload


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY.__dict__, **overrides}))


def hf_gpt2(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    # 4 query heads over 2 key/value heads: grouped-query attention
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=64, vocab_size=64,
                                   max_position_embeddings=32, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def nonfinite_eagerly(loss: torch.Tensor, model: torch.nn.Module) -> bool:
    """skip_nonfinite's flag, eagerly, as graphoffload/nonfinite.py sets it after backward: the
    loss, or the L2 norm of the gradients' L2 norms (each taken in at least fp32), not finite."""
    norms = [torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.promote_types(p.grad.dtype, torch.float32))
             for p in model.parameters() if p.grad is not None]
    return not (torch.isfinite(loss).all() and torch.isfinite(torch.linalg.vector_norm(torch.stack(norms), 2.0)))


def loss_steps(loss_fn: Callable) -> tuple[Callable, Callable, Callable]:
    """The three steps the GradScaler and skip_nonfinite tests train around `loss_fn(model, batch)`:
    a plain step, a GradScaler's step (`scaled_step(model, optimizer, scaler, batch)`), and
    skip_nonfinite eagerly (tests/test_skip_nonfinite.py: no step() when the loss or the fp32
    global gradient norm is not finite; returns whether it skipped)."""
    def plain_step(model, optimizer, batch):
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def scaled_step(model, optimizer, scaler, batch):
        loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    def eager_skipping_step(model, optimizer, batch) -> bool:
        loss = loss_fn(model, batch)
        loss.backward()
        skipped = nonfinite_eagerly(loss, model)
        if not skipped:
            optimizer.step()
        optimizer.zero_grad()
        return skipped

    return plain_step, scaled_step, eager_skipping_step


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or state tensor whole: a DTensor (ZeRO stage 3's rows, a sharded state) gathered,
    which is a collective on every rank; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def zero_gpt() -> GPT:
    """The ZeRO tests' tiny GPT, seeded, in fp64: the key bias's gradient is zero up to rounding,
    and AdamW turns fp32 rounding noise of that size into lr-sized steps whichever order the
    ranks' sums are added in."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)).double()


def zero_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The ZeRO tests' optimizers: "sgd" (momentum), else AdamW with weight decay."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def run_steps(step_fn: Callable, model, opt, batches: Sequence[dict], scheduler=None) -> list[torch.Tensor]:
    """Train on `batches`, stepping `scheduler` (if any) between steps as a user would; returns
    the detached losses."""
    losses = []
    for b in batches:
        losses.append(step_fn(model, opt, b).detach().clone())
        if scheduler is not None:
            scheduler.step()
    return losses


def eager_and_compiled(model, make_opt: Callable, batches: Sequence[dict], step_fn: Callable = train_step,
                       make_scheduler: Callable | None = None, **compile_kwargs):
    """Train a copy of `model` eagerly and another copy with the compiled step on the same
    batches. Returns (eager model, eager opt, eager losses, compiled model, compiled opt,
    compiled losses, compiled step)."""
    eager, compiled = model, copy.deepcopy(model)
    opt_e, opt_c = make_opt(eager), make_opt(compiled)
    sched_e = make_scheduler(opt_e) if make_scheduler else None
    sched_c = make_scheduler(opt_c) if make_scheduler else None
    step = graphoffload.offload_compile(step_fn, **compile_kwargs)
    losses_e = run_steps(step_fn, eager, opt_e, batches, sched_e)
    losses_c = run_steps(step, compiled, opt_c, batches, sched_c)
    return eager, opt_e, losses_e, compiled, opt_c, losses_c, step


def assert_tensors_match(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str, rtol: float = 1e-5,
                         atol: float = 1e-6) -> None:
    if exact:
        assert torch.equal(a, b), f"{what}: max abs diff {(a.double() - b.double()).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_training_matches(model_a, opt_a, losses_a, model_b, opt_b, losses_b, exact: bool,
                            rtol: float = 1e-5, atol: float = 1e-6, offloaded: bool = False) -> None:
    """Losses, parameters, buffers and optimizer state of two runs agree (bit for bit if exact).
    `offloaded`: run b's optimizer state may also hold the offload's fp32 master weights."""
    assert len(losses_a) == len(losses_b)
    for i, (la, lb) in enumerate(zip(losses_a, losses_b)):
        assert_tensors_match(la, lb, exact, f"loss of step {i}", rtol, atol)
    named_b = dict(model_b.named_parameters())
    for name, pa in model_a.named_parameters():
        pb = named_b[name]
        assert_tensors_match(pa.detach(), pb.detach(), exact, f"parameter {name}", rtol, atol)
        state_a, state_b = opt_a.state[pa], opt_b.state[pb]
        assert set(state_a) <= set(state_b) if offloaded else set(state_a) == set(state_b), name
        for key in state_a:
            assert_tensors_match(state_a[key], state_b[key].to(state_a[key].device), exact, f"state {key} of {name}", rtol, atol)
    buffers_b = dict(model_b.named_buffers())
    for name, ba in model_a.named_buffers():
        assert_tensors_match(ba, buffers_b[name], exact, f"buffer {name}", rtol, atol)


def snapshot(model, opt=None) -> dict:
    """Deep copies of a model's parameters/buffers and an optimizer's state, to check that a
    failed call left them untouched."""
    return {"model": copy.deepcopy(model.state_dict()),
            "opt": copy.deepcopy(opt.state_dict()) if opt is not None else None}


def assert_unchanged(model, opt, snap: dict) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, snap["model"][name]), f"{name} changed"
    if opt is not None:
        assert_state_dicts_equal(opt.state_dict(), snap["opt"])
    assert all(p.grad is None for p in model.parameters())


def assert_state_dicts_equal(a, b, path: str = "") -> None:
    """Nested dicts/lists of tensors and plain values are equal (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a)} != {set(b)}"
        for k in a:
            assert_state_dicts_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_dicts_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"



class AllocationTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Measured memory on the CPU: the bytes of the storages that ops create while the mode is on,
    live until the storage is freed, each rounded up to `block` bytes as the prediction rounds
    (512, the CUDA caching allocator's block). Storages that existed before (parameters, state,
    the batch) are never counted, so `peak` is comparable with a MemoryProfile's
    `peak - resident`. Sampled after every op, on the calling thread only (a dispatch mode is
    thread-local: the offload worker's host-side work is not seen, as the prediction does not
    count host memory either)."""

    def __init__(self, block: int = 512):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.block = block
        self.storages: dict[int, tuple] = {}   # _cdata -> (weak ref, bytes)
        self.before: set[int] = set()
        self.live = 0
        self.peak = 0

    def __enter__(self):
        import gc

        gc.collect()
        # every storage alive now is the caller's: found through the tensors the collector tracks
        tensors = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter)]
        self.before = {t.untyped_storage()._cdata for t in tensors if not t.is_meta and t.layout == torch.strided}
        return super().__enter__()

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.storages.items() if ref.expired()]:
            self.live -= self.storages.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.storages or key in self.before:
                    continue
                nbytes = -(-storage.nbytes() // self.block) * self.block
                self.storages[key] = (self._ref(storage), nbytes)
                self.live += nbytes
        self.peak = max(self.peak, self.live)
        return out


def assert_movement_and_state_close(eager, opt_e, compiled, opt_c, start: Sequence[torch.Tensor],
                                    rtol: float) -> None:
    """Low-precision training held to eager on the scale of what it changes: per parameter, the
    movement from `start` (in the 2-norm, relative to eager's movement), and per optimizer state
    tensor, relative to eager's state tensor's own norm. A parameter that never moves, or a state
    tensor off by a constant factor, is a relative error of order 1 whatever the tolerance on
    the parameters' absolute values would let through."""
    for (name, pe), pc, p0 in zip(eager.named_parameters(), compiled.parameters(), start):
        moved = pe.detach().double() - p0
        err = ((pc.detach().double() - p0) - moved).norm().item() / max(moved.norm().item(), 1e-30)
        assert err <= rtol, f"{name}: movement {err:.3g} of eager's away from it, bound {rtol}"
        for key, value in opt_e.state[pe].items():
            if key == "step" or not torch.is_tensor(value):
                continue
            want = value.double()
            err = (opt_c.state[pc][key].double() - want).norm().item() / max(want.norm().item(), 1e-30)
            assert err <= rtol, f"{name} {key}: {err:.3g} of its norm away from eager's, bound {rtol}"
