"""Imports go one way: graph types, ops, config, errors <- capture, passes, runtime <- api.

Each check runs in a fresh interpreter, so what an import pulls in is not hidden by modules an
earlier test loaded."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('graphoffload'))))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _under(modules: set[str], package: str) -> set[str]:
    return {m for m in modules if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize("module", ["graphoffload", "graphoffload.ops", "graphoffload.graph", "graphoffload.config",
                                    "graphoffload.errors", "graphoffload.diagnostics"])
def test_the_bottom_layer_imports_no_layer_above_it(module):
    loaded = _loaded_after(f"import {module}")
    for above in ("graphoffload.capture", "graphoffload.passes", "graphoffload.runtime", "graphoffload.api"):
        assert not _under(loaded, above), f"import {module} loaded {sorted(_under(loaded, above))}"


@pytest.mark.parametrize("module", ["graphoffload.passes", "graphoffload.capture"])
def test_capture_and_passes_do_not_import_the_runtime_or_the_api(module):
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert not _under(loaded, "graphoffload.runtime"), sorted(_under(loaded, "graphoffload.runtime"))
    assert "graphoffload.api" not in loaded


def test_the_runtime_does_not_import_the_passes_or_the_api():
    loaded = _loaded_after("import graphoffload.runtime")
    assert "graphoffload.runtime.executor" in loaded
    assert not _under(loaded, "graphoffload.passes"), sorted(_under(loaded, "graphoffload.passes"))
    assert "graphoffload.api" not in loaded


def test_every_op_is_declared_by_the_vocabulary_and_traceable_without_the_runtime():
    # the fake kernels come with graphoffload.ops; the runtime only adds real kernels
    code = """
import torch, graphoffload.ops
from torch._subclasses.fake_tensor import FakeTensorMode
names = ["attention", "attention_backward", "attention_mask_grad", "grouped_mm", "rng_state", "swap_rng_state",
         "copy_to_host", "copy_to_device", "prefetch_to_device", "wait_host", "carry_host_write", "wait_device", "hand_over",
         "wait_handed_over", "host_adam_", "host_sgd_", "ring_attention", "ring_attention_backward"]
missing = [n for n in names if not hasattr(torch.ops.graphoffload, n)]
assert not missing, missing
with FakeTensorMode():
    q = torch.randn(1, 2, 8, 4)
    out, lse = torch.ops.graphoffload.ring_attention(q, q, q, True, None, "zigzag", "g", 1.0)
    ticket = torch.ops.graphoffload.copy_to_host([q], [torch.empty_like(q)])
assert out.shape == q.shape and ticket.dtype == torch.int64
try:
    torch.ops.graphoffload.copy_to_host([torch.ones(2)], [torch.empty(2)])
except RuntimeError as exc:
    assert "graphoffload.runtime" in str(exc), exc
else:
    raise AssertionError("a host op ran without the runtime's kernel")
import sys
assert not [m for m in sys.modules if m.startswith("graphoffload.runtime")]
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_registering_the_fused_optimizer_meta_kernels_is_explicit_and_idempotent():
    code = """
import torch, graphoffload.ops
has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_adamw_", "Meta")
before = has()
first = graphoffload.ops.register_fused_optimizer_meta_kernels()
assert graphoffload.ops.register_fused_optimizer_meta_kernels() is first
assert has()
print(before)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() in ("True", "False")


PRIVATE_TORCH = re.compile(r"(?:from|import)\s+torch\._|torch\.utils\._pytree|torch\.fx\.experimental|torch\._C\._"
                           r"|_resolve_process_group|\._sequence_nr\(|_register_create_node_hook")


def test_private_torch_api_is_used_only_behind_its_boundary():
    """Issue 15 item 7: one module (graphoffload/torch_private.py) owns every private torch API
    the library relies on; an upgrade of torch is a visit to it."""
    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for package in ("graphoffload", "passes", "runtime"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "torch_private.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE_TORCH.search(line):
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "private torch API outside graphoffload/torch_private.py:\n" + "\n".join(offenders)
