"""Test setup: the example models under examples/ are importable (`from gpt import GPT`)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


@pytest.fixture(autouse=True, scope="session")
def _own_cache_dir(tmp_path_factory):
    """Calibrations and offload plans cached during the tests go to a directory of the test
    session's (subprocesses inherit it), never to the user's cache."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


# ---- the offload schedule matrix under the sanitizer (issue 12): modules or tests marked
# `sanitizer_matrix` run their CPU cases twice, the second time with GRAPHOFFLOAD_SANITIZE=1,
# so a read the schedule does not order after its transfer's wait fails on the CPU too.


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("sanitizer_matrix") is None:
        return
    metafunc.parametrize("sanitizer_mode", ["plain", "sanitized"], indirect=True)


@pytest.fixture(autouse=True)
def sanitizer_mode(request):
    # autouse, so it is in every test's closure and the marked ones can be parametrized over it
    mode = getattr(request, "param", None)
    if mode is None:
        return None
    monkeypatch = request.getfixturevalue("monkeypatch")
    if mode == "sanitized":
        callspec = getattr(request.node, "callspec", None)
        if callspec is not None and callspec.params.get("device", "cpu") != "cpu":
            pytest.skip("the sanitizer instruments the CPU runtime; on a GPU the streams race for real")
        monkeypatch.setenv("GRAPHOFFLOAD_SANITIZE", "1")
    else:
        monkeypatch.delenv("GRAPHOFFLOAD_SANITIZE", raising=False)
    return mode


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of this process alone (tests/test_zero.py's `AsRank` builds the state's
    DeviceMesh from it, to compile one rank's ZeRO step in a single process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
