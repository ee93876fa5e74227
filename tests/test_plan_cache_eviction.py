"""The on-disk plan cache stays under its size cap: after each write the least recently used
entries go (a hit counts as a use), never the one just written, and another process removing
an entry first, or an entry nobody can read, is no error."""

from __future__ import annotations

import logging
import os

import pytest

from graphoffload.passes import offload_plan_cache as cache_module
from graphoffload.passes.offload_plan_cache import (MAX_BYTES, evict, load_activations, plan_path, plans_dir,
                                                    store_activations)


@pytest.fixture
def plans(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "graphoffload" / "plans"


def _key(i: int) -> str:
    return f"{i:064x}"


def _store(i: int, cap: int, t: float | None = None) -> str:
    """Store a ~1 KB entry `i` under `cap`; `t`: then date it (seconds), as an older use would."""
    store_activations(_key(i), {"edits": "x" * 1000, "i": i}, max_bytes=cap)
    path = plan_path(_key(i), "activations")
    if t is not None and os.path.exists(path):
        os.utime(path, (t, t))
    return path


def _kept(plans) -> set[int]:
    return {int(p.name.split("-")[1].split(".")[0], 16) for p in plans.glob("activations-*.json")}


def test_the_least_recently_used_go_and_a_hit_keeps_an_entry(plans, caplog):
    assert MAX_BYTES == 256 * 2**20 and plans_dir() == str(plans)
    size = None
    for i in range(4):   # entries 0..3, 0 the oldest, the cap far above them
        path = _store(i, 10**9, t=1000.0 + i)
        size = os.path.getsize(path)
    assert _kept(plans) == {0, 1, 2, 3}
    assert load_activations(_key(0)) is not None   # a hit: 0 is now the most recently used
    assert os.path.getmtime(plan_path(_key(0), "activations")) > 1003.0
    caplog.set_level(logging.DEBUG, logger="graphoffload")
    _store(4, 3 * size)   # room for three: the two least recently used (1, 2) go
    assert _kept(plans) == {0, 3, 4}
    assert "evicted 2 least recently used entries" in caplog.text and _key(1) in caplog.text
    assert sum(p.stat().st_size for p in plans.iterdir()) <= 3 * size


def test_the_entry_just_written_survives_a_cap_below_it(plans):
    for i in range(3):
        _store(i, 10**9, t=1000.0 + i)
    path = _store(3, 10)   # a cap no entry fits: every other goes, the new one stays
    assert _kept(plans) == {3} and load_activations(_key(3)) == {"edits": "x" * 1000, "i": 3}
    assert os.path.exists(path)


def test_unreadable_entries_and_other_writers_are_no_error(plans, monkeypatch):
    for i in range(3):
        _store(i, 10**9, t=1000.0 + i)
    (plans / f"activations-{_key(9)}.json").write_text("{torn")   # unreadable: evicted by age like any other
    os.utime(plans / f"activations-{_key(9)}.json", (900.0, 900.0))
    in_progress = plans / ".tmp-abcactivations-x.json"   # another process's write under way: left alone
    in_progress.write_text("y" * 5000)
    abandoned = plans / ".tmp-defactivations-y.json"   # a crashed writer's, hours old: evicted
    abandoned.write_text("z" * 5000)
    os.utime(abandoned, (1.0, 1.0))
    real_remove = os.remove

    def raced(path):   # another process evicts entry 0 between our listing and our remove
        if path.endswith(f"activations-{_key(0)}.json"):
            real_remove(path)
            raise FileNotFoundError(path)
        return real_remove(path)
    monkeypatch.setattr(cache_module.os, "remove", raced)
    removed = evict(str(plans), plan_path(_key(2), "activations"), max_bytes=1500)
    assert _kept(plans) == {2} and in_progress.exists() and not abandoned.exists()
    assert plan_path(_key(0), "activations") not in removed   # not ours to report
    assert load_activations(_key(9)) is None   # gone, so a miss, no error
