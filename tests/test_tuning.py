"""α tuning (docs/algorithm.md §6): the best α of the curve, the refinement, auto_tune's seed."""

from __future__ import annotations

import dataclasses

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_trace
from hexgen_flow.tuning import ALPHA_GRID, AUTO_WINDOW, AlphaPoint, auto_tune, tune_alpha

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
