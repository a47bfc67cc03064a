"""`hexgen_service.gc_tuning`: the collector tuned for the completion path, and measured."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from hexgen_service.gc_tuning import DEFAULT_THRESHOLDS, GcPauses, freeze_startup


@pytest.fixture
def restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_freezing_takes_startup_objects_out_of_every_later_collection(restore_gc: None) -> None:
    kept = [[i] for i in range(10_000)]  # containers alive after start-up
    frozen = freeze_startup()
    assert frozen >= len(kept) and gc.get_freeze_count() == frozen
    assert gc.get_threshold() == DEFAULT_THRESHOLDS
    # A full collection no longer walks them: it sees only what was made since.
    pauses = GcPauses().install()
    try:
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert gc.get_count()[2] == 0 and len(gc.get_objects(2)) < frozen


def test_every_collection_is_timed_by_generation() -> None:
    seen: list[tuple[int, float]] = []
    pauses = GcPauses(observe=lambda g, s: seen.append((g, s))).install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.count[0] >= 1 and pauses.count[2] >= 1
    assert seen[0][0] == 0 and [g for g, _ in seen].count(2) == pauses.count[2]
    assert all(s >= 0 for _, s in seen) and pauses.longest_s[2] > 0
    assert pauses._callback not in gc.callbacks  # uninstalled
