"""The benchmark behind ``hexgen-flow bench``: the paper's evaluation, re-run in the simulator.

Parts (each a list of independent simulation tasks, run in a process pool):

- **matrix**: traces x clusters x arrival rates x presets; P95 / mean latency and SLO
  attainment, speedup over ``vllm`` and, per row, over the best load-aware router
  (`plan.LOAD_AWARE`: the routers people run instead of round-robin).
- **goodput**: per trace and preset, the highest steady arrival rate at which at least 95 %
  of the queries meet their SLO (bracketing, then bisection); ratios over ``vllm`` and over
  the best load-aware router of the trace.
- **SLO sweep**: attainment vs SLO scale; **load sweep**: P95 vs arrival rate.
- **multi-tenant**: half the queries at a tight SLO, half at a loose one; attainment per
  tenant.
- **simulator speed**: LLM calls simulated per second of wall time, and the time of one
  full alpha tuning. Run alone in this process after the pool, so that nothing competes.

Every plan runs the matrix and goodput; the other parts are optional (`BenchPlan.parts`: the
README's plan leaves them out).

**Stable regimes** (`stable`, ``hexgen-flow bench --stable``, its own plan `StablePlan`):
every policy at 50, 70 and 90 % of the best router's goodput, and goodput itself, under
the clairvoyant information model and the realistic ones (a table that is not the
engines', no output lengths, costs and lengths learned online). The README's headline
comes from it; the matrix's fixed rates overload the paper's cluster.

Presets with an alpha run with it auto-tuned (`hexgen_flow.tuning.auto_tune`, as
``--alpha auto``), at every setting they are measured at.

Everything but the wall-clock timings is deterministic: every task is a pure function of
its key, and results are assembled in plan order, never in completion order.

Outputs in the ``--out`` folder: ``results.md`` (summary, then tables), ``results.json``
(the same, machine-readable), and the plots ``p95_matrix.png``, ``goodput.png``,
``p95_vs_load.png`` and ``attainment_vs_slo.png``.

Modules: `plan` (what runs: `BenchPlan`, the full and quick plans, their tasks), `tasks`
(one task, as a pool worker runs it), `run` (the pool, the results document, `run_bench`),
`report` (results.md), `plots` (the PNGs), `readme` (the README's results block, from a
plan of its own) and `stable` (the stable-regime part and the README's headline block).
"""

from __future__ import annotations

from hexgen_flow.bench.plan import FULL_PLAN, QUICK_PLAN, BenchPlan, Task
from hexgen_flow.bench.plots import PLOTS
from hexgen_flow.bench.readme import README_PLAN, render_readme_block
from hexgen_flow.bench.run import BenchOutcome, run_bench, run_plan
from hexgen_flow.bench.tasks import find_goodput, run_task

__all__ = [
    "FULL_PLAN",
    "PLOTS",
    "QUICK_PLAN",
    "README_PLAN",
    "BenchOutcome",
    "BenchPlan",
    "Task",
    "find_goodput",
    "render_readme_block",
    "run_bench",
    "run_plan",
    "run_task",
]
