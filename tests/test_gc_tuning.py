"""The serving processes keep start-up's objects out of the garbage collector's passes."""

from __future__ import annotations

import gc

from moeserve import LLM
from moeserve.gc_tuning import freeze_heap


def test_freeze_heap_moves_live_objects_to_the_permanent_generation() -> None:
    gc.unfreeze()
    keep = [object() for _ in range(1000)]  # noqa: F841 (alive across the freeze)
    freeze_heap()
    assert gc.get_freeze_count() >= 1000


def test_engine_start_up_freezes_the_heap() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    LLM("tiny-moe", device="cpu")
    assert gc.get_freeze_count() > 0


def test_freeze_heap_raises_the_young_generation_threshold() -> None:
    """A serving step allocates thousands of objects: the youngest generation collects every
    GEN0_THRESHOLD allocations, not Python's 700; the older generations keep their ratios."""
    from moeserve.gc_tuning import GEN0_THRESHOLD

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, before[1], before[2])
        freeze_heap()
        assert gc.get_threshold() == (GEN0_THRESHOLD, before[1], before[2])
    finally:
        gc.set_threshold(*before)
