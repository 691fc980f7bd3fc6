"""Stage 3: choose one choice per unit (docs/design.md, section 4).

- :mod:`~osdp_lightning.solve.evaluate`: an assignment's exact peak bytes and step seconds under the
  model the ILP uses, and the bounds no assignment passes;
- :mod:`~osdp_lightning.solve.model`: the integer program's variables and rows;
- :mod:`~osdp_lightning.solve.search`: the fastest plan within a budget (:func:`solve_choice_table`),
  the k best (:func:`next_best_solutions`) and the smallest budget (:func:`smallest_feasible_budget`);
- :mod:`~osdp_lightning.solve.knapsack`: the OSDP authors' knapsack dynamic program (the baseline,
  and the solver's first incumbent).
"""

from osdp_lightning.solve.evaluate import (
    Solution,
    choice_step_s,
    moment_bytes,
    peak_bytes,
    peak_lower_bound,
    step_lower_bound,
    step_seconds,
)
from osdp_lightning.solve.knapsack import knapsack_dp
from osdp_lightning.solve.search import (
    SETTLE_AFTER_S,
    SETTLE_GAP,
    next_best_solutions,
    smallest_feasible_budget,
    solve_choice_table,
)
from osdp_lightning.solve.solvers import (
    FEASIBLE,
    INFEASIBLE,
    NOT_SOLVED,
    OPTIMAL,
    TIME_LIMIT,
    SolverUnavailableError,
)

__all__ = ["FEASIBLE", "INFEASIBLE", "NOT_SOLVED", "OPTIMAL", "SETTLE_AFTER_S", "SETTLE_GAP", "TIME_LIMIT", "Solution",
           "SolverUnavailableError", "choice_step_s", "knapsack_dp", "moment_bytes", "next_best_solutions",
           "peak_bytes", "peak_lower_bound", "smallest_feasible_budget", "solve_choice_table", "step_lower_bound",
           "step_seconds"]
