"""The private torch APIs graphoffload relies on, behind one boundary.

torch changes private APIs between releases; keeping each use here, with what it relies on,
makes an upgrade a visit to one module. Supported: torch 2.11 and 2.13.

- `recording_created_nodes`: `GraphModule._register_create_node_hook` /
  `_unregister_create_node_hook`, which `Graph.create_node` calls for every node created in a
  graph owned by the module (what `torch.fx.passes.graph_transform_observer` uses to follow a
  pass's changes). The pass manager records provenance with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import fx


@contextlib.contextmanager
def recording_created_nodes(gm: fx.GraphModule) -> Iterator[list[fx.Node]]:
    """Yield a list that collects every node created in `gm`'s graph while the block runs."""
    created: list[fx.Node] = []
    hook = created.append
    gm._register_create_node_hook(hook)
    try:
        yield created
    finally:
        gm._unregister_create_node_hook(hook)
