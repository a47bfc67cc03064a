"""α tuning (docs/algorithm.md §6): the best α of the curve, the refinement, auto_tune's seed;
and one online tuning run (`retune`, `decide` with its tolerance, `TuningWindow`)."""

from __future__ import annotations

import dataclasses

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_trace
from hexgen_flow.tuning import (
    ALPHA_GRID,
    AUTO_WINDOW,
    AlphaPoint,
    Decision,
    TuningResult,
    TuningWindow,
    auto_tune,
    decide,
    replay_window,
    retune,
    tune_alpha,
    tuning_grid,
)

QUERIES = load_trace("trace1")[:20]
CLUSTER = parse_cluster("A100,A100,A6000,L40S")
CONFIG = SimConfig(qps=1.0, seed=0)
PAPER = PRESETS["hexgen-flow-paper"]


def test_best_alpha_has_the_lowest_p95_of_the_curve() -> None:
    result = tune_alpha(QUERIES, CLUSTER, PAPER, CONFIG)
    p95s = [p.p95_s for p in result.curve]
    assert result.best.p95_s == pytest.approx(min(p95s), rel=1e-12)
    assert result.best == min(result.curve, key=AlphaPoint.rank)
    assert result.alpha == result.best.alpha
    assert len(set(round(p, 6) for p in p95s)) > 1  # α matters here: the test can fail
    assert [p.alpha for p in result.curve] == sorted(p.alpha for p in result.curve)
    assert result.window == len(QUERIES)


def test_best_alpha_reproduces_in_an_independent_simulation() -> None:
    result = tune_alpha(QUERIES, CLUSTER, PAPER, CONFIG)
    metrics = simulate(QUERIES, CLUSTER, PAPER.with_alpha(result.alpha), CONFIG)
    assert metrics.p95_s == result.best.p95_s
    assert metrics.slo_attainment == result.best.slo_attainment
    for point in result.curve:
        again = simulate(QUERIES, CLUSTER, PAPER.with_alpha(point.alpha), CONFIG)
        assert again.p95_s == point.p95_s


def test_ranking_breaks_p95_ties_on_attainment_then_on_the_smaller_alpha() -> None:
    a = AlphaPoint(0.2, p95_s=100.0, mean_s=50.0, slo_attainment=0.5)
    b = AlphaPoint(0.7, p95_s=100.0 + 1e-12, mean_s=60.0, slo_attainment=0.9)
    c = AlphaPoint(0.4, p95_s=100.0, mean_s=40.0, slo_attainment=0.9)
    d = AlphaPoint(0.9, p95_s=99.0, mean_s=90.0, slo_attainment=0.1)
    assert min([a, b], key=AlphaPoint.rank) is b  # equal P95 (to 1e-9): higher attainment
    assert min([a, b, c], key=AlphaPoint.rank) is c  # then the smaller α
    assert min([a, b, c, d], key=AlphaPoint.rank) is d  # a lower P95 wins outright


def test_alpha_insensitive_cluster_ties_everywhere_and_picks_the_smallest_alpha() -> None:
    # On one instance every α dispatches the same way: every point ties.
    one = parse_cluster("A100")
    result = tune_alpha(QUERIES[:6], one, PAPER, CONFIG)
    assert len({(p.p95_s, p.slo_attainment) for p in result.curve}) == 1
    assert result.alpha == 0.0
    # The refinement at the edge of the grid has one neighbour: a single midpoint.
    assert [p.alpha for p in result.curve] == sorted([*ALPHA_GRID, 0.05])


@pytest.mark.parametrize("name", ["hexgen-flow-paper", "hexgen-flow"])
def test_refinement_adds_the_midpoints_next_to_the_best_grid_value(name: str) -> None:
    preset = PRESETS[name]
    grid = (0.0, 0.25, 0.5, 0.75, 1.0)
    plain = tune_alpha(QUERIES, CLUSTER, preset, CONFIG, grid=grid, refine=False)
    assert tuple(p.alpha for p in plain.curve) == grid
    best_grid = min(plain.curve, key=AlphaPoint.rank).alpha
    assert plain.alpha == best_grid
    refined = tune_alpha(QUERIES, CLUSTER, preset, CONFIG, grid=grid)
    k = grid.index(best_grid)
    mids = {round((best_grid + grid[j]) / 2, 6) for j in (k - 1, k + 1) if 0 <= j < len(grid)}
    assert {p.alpha for p in refined.curve} == set(grid) | mids
    # The grid points themselves are the same runs.
    assert [p for p in refined.curve if p.alpha in grid] == list(plain.curve)
    assert refined.best == min(refined.curve, key=AlphaPoint.rank)
    assert refined.best.rank() <= plain.best.rank()


def test_progress_reports_every_alpha_tried_once() -> None:
    seen: list[float] = []
    result = tune_alpha(
        QUERIES[:8],
        CLUSTER,
        PAPER,
        CONFIG,
        grid=(0.0, 0.5, 1.0),
        progress=lambda p: seen.append(p.alpha),
    )
    assert sorted(seen) == [p.alpha for p in result.curve]
    assert len(seen) == len(set(seen))


def test_window_replays_the_last_queries() -> None:
    grid = (0.0, 1.0)
    windowed = tune_alpha(QUERIES, CLUSTER, PAPER, CONFIG, window=8, grid=grid, refine=False)
    tail = tune_alpha(QUERIES[-8:], CLUSTER, PAPER, CONFIG, grid=grid, refine=False)
    assert windowed.window == 8
    assert windowed.curve == tail.curve


@pytest.mark.parametrize("name", sorted(n for n, p in PRESETS.items() if not p.has_alpha))
def test_presets_without_alpha_cannot_be_tuned(name: str) -> None:
    with pytest.raises(ConfigError, match="alpha"):
        tune_alpha(QUERIES, CLUSTER, PRESETS[name], CONFIG)
    with pytest.raises(ConfigError, match="alpha"):
        auto_tune(QUERIES, CLUSTER, PRESETS[name], CONFIG)


def test_empty_grid_is_rejected() -> None:
    with pytest.raises(ConfigError, match="grid"):
        tune_alpha(QUERIES, CLUSTER, PAPER, CONFIG, grid=())


def test_auto_tune_tunes_on_the_next_seed() -> None:
    config = SimConfig(qps=1.0, slo_scale=2.5, seed=4, arrival_cv=1.5)
    auto = auto_tune(QUERIES, CLUSTER, PAPER, config)
    assert len(QUERIES) < AUTO_WINDOW
    next_seed = tune_alpha(QUERIES, CLUSTER, PAPER, dataclasses.replace(config, seed=5))
    same_seed = tune_alpha(QUERIES, CLUSTER, PAPER, config)
    assert auto.curve == next_seed.curve
    assert auto.best == next_seed.best
    assert auto.curve != same_seed.curve  # the seed matters, so the check above can fail


def test_auto_tune_replays_at_most_the_first_window() -> None:
    queries = load_trace("trace1") * 5  # 450 queries (repeated ids do not matter here)
    assert len(queries) > AUTO_WINDOW
    seen: list[AlphaPoint] = []
    # The first trial (α = 0) is enough to see what was replayed: stop the search there.
    with pytest.raises(_StopSearchError):
        auto_tune(queries, CLUSTER, PAPER, CONFIG, progress=lambda p: _stop(seen, p))
    assert [p.alpha for p in seen] == [0.0]
    next_seed = dataclasses.replace(CONFIG, seed=CONFIG.seed + 1)
    first = simulate(queries[:AUTO_WINDOW], CLUSTER, PAPER.with_alpha(0.0), next_seed)
    everything = simulate(queries, CLUSTER, PAPER.with_alpha(0.0), next_seed)
    assert seen[0] == AlphaPoint.of(0.0, first)
    assert seen[0] != AlphaPoint.of(0.0, everything)


class _StopSearchError(Exception):
    pass


def _stop(seen: list[AlphaPoint], point: AlphaPoint) -> None:
    seen.append(point)
    raise _StopSearchError


# ------------------------------------------------------------------------------ online tuning


def _curve(*points: tuple[float, float, float], window: int = 40) -> TuningResult:
    curve = tuple(AlphaPoint(a, p95, p95 * 0.7, att) for a, p95, att in points)
    best = min(curve, key=AlphaPoint.rank)
    return TuningResult(best, tuple(sorted(curve, key=lambda p: p.alpha)), window)


def test_without_tolerance_any_strictly_better_alpha_wins() -> None:
    result = _curve((0.2, 101.0, 0.9), (0.4, 100.0, 0.9), (0.6, 100.5, 0.9), (0.9, 130.0, 0.8))
    assert decide(result, 0.6) == Decision(
        0.4, True, "alpha 0.6 -> 0.4: P95 100.5 s -> P95 100.0 s over 40 queries"
    )
    assert not decide(result, 0.4).change


def test_tolerance_keeps_a_near_best_alpha_and_otherwise_takes_the_middle_of_the_near_ones() -> (
    None
):
    # Within 3 % of the best (100 s): 0.2, 0.4, 0.5, 0.6; the median of them is 0.4.
    result = _curve(
        (0.0, 140.0, 0.7),
        (0.2, 102.0, 0.9),
        (0.4, 100.0, 0.9),
        (0.5, 101.0, 0.9),
        (0.6, 102.9, 0.9),
        (0.9, 130.0, 0.8),
        (1.0, 150.0, 0.6),
    )
    keep = decide(result, 0.6, tolerance=0.03)
    assert not keep.change and keep.alpha == 0.6
    assert "within 3 %" in keep.reason
    move = decide(result, 1.0, tolerance=0.03)
    assert move.change and move.alpha == 0.4
    assert move.reason == "alpha 1 -> 0.4: P95 150.0 s -> P95 100.0 s over 40 queries"
    # Four near ones, an even count: the lower middle. With five: the middle one.
    wider = decide(result, 0.0, tolerance=0.03)
    assert wider.alpha == 0.4
    five = decide(result, 0.0, tolerance=0.3)  # 0.9 (130 s) joins: 0.2 0.4 0.5 0.6 0.9
    assert five.alpha == 0.5
    assert decide(result, 0.0, tolerance=0.0).alpha == 0.4  # the plain argmin


def test_tuning_window_is_relative_in_arrival_order_with_explicit_slos() -> None:
    records = [(QUERIES[2], 1010.0, 150.0), (QUERIES[0], 1000.0, 120.0), (QUERIES[1], 1010.0, 90.0)]
    window = TuningWindow.of(records)
    assert [q.query_id for q in window.queries] == ["trace1-0", "trace1-1", "trace1-2"]
    assert [q.arrival_s for q in window.queries] == [0.0, 10.0, 10.0]
    assert [q.slo_s for q in window.queries] == [120.0, 90.0, 150.0]
    assert all(q.slo_scale is None for q in window.queries)
    assert window.qps == pytest.approx(2 / 10) and window.span_s == 10.0
    assert TuningWindow.of([]) == TuningWindow((), 0.0)
    assert TuningWindow.of(records[:1]).qps == 0.0


def test_retune_replays_the_window_with_the_current_alpha_or_says_it_is_too_small() -> None:
    window = TuningWindow.of((q, 8.0 * i, 176.7) for i, q in enumerate(QUERIES))
    small = retune(window, CLUSTER, PAPER, 0.45, min_queries=len(QUERIES) + 1)
    assert small.result is None and not small.decision.change and small.decision.alpha == 0.45
    assert small.decision.reason == f"too few queries in the window (20 < {len(QUERIES) + 1})"
    run = retune(window, CLUSTER, PAPER, 0.45, min_queries=len(QUERIES))
    assert run.result is not None
    assert 0.45 in [p.alpha for p in run.result.curve]
    assert run.result == replay_window(window, CLUSTER, PAPER, 0.45)
    assert run.decision == decide(run.result, 0.45)
    assert tuning_grid(0.45) == tuple(sorted({*ALPHA_GRID, 0.45}))
