"""Running the integer programs of :mod:`osdp_lightning.solve`: HiGHS by default, CBC as fallback.

PuLP is the modelling layer (``pulp.LpProblem``); this module hands a problem to a solver and
reads back our status, the best bound when the solve stopped short, and the variables' values.

- HiGHS (package ``highspy``, a dependency) solves the plans of 1,000-2,000 units in one to two
  seconds where CBC needs minutes (``benchmarks/solver_bench.py``): proven optimal, or within 1e-4
  when its units all differ (settling, below). The problem goes to it in bulk (PuLP's own HiGHS
  interface adds one column and one row at a time from Python).
- CBC ships inside PuLP: used when ``highspy`` is not installed (one warning says so), or when
  asked for with ``solver="cbc"`` or ``OSDP_SOLVER=cbc``.

Both are asked for the proven optimum (relative gap 0) unless a ``gap`` or a time limit is given;
HiGHS may also be told to settle for a small gap once proving the rest takes long (``settle_gap``).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

try:
    import pulp
except ImportError as _err:  # say how to get it rather than a bare ModuleNotFoundError
    raise ImportError("osdp_lightning solves its plans with PuLP, which is not installed: run "
                      "`pip install pulp` (it bundles the CBC solver)") from _err

HIGHS, CBC = "highs", "cbc"
SOLVERS = (HIGHS, CBC)
SOLVER_ENV = "OSDP_SOLVER"
"""Environment variable that picks the solver (``highs`` or ``cbc``) when none is passed."""

OPTIMAL = "Optimal"
INFEASIBLE = "Infeasible"
TIME_LIMIT = "Time limit"
"""Stopped by the time limit with a feasible, not proven optimal, assignment."""
NOT_SOLVED = "Not Solved"
"""Stopped (time limit) before any feasible assignment was found."""
FEASIBLE = "Feasible"
"""Fits, but optimality is not proven (see :attr:`~osdp_lightning.solve.Solution.gap`)."""

_HINT = ("install the solvers again (`pip install --force-reinstall highspy pulp`; PuLP bundles CBC), "
         "or skip the solver with OSDPStrategy(plan=<saved plan>) or uniform_choice=")


class SolverUnavailableError(RuntimeError):
    """The solver is missing or failed to run."""


@dataclass(frozen=True)
class SolverSettings:
    """How to run one solve."""

    name: str
    """:data:`HIGHS` or :data:`CBC`."""
    time_limit_s: float | None = None
    gap: float | None = None
    """Relative gap at which to stop; ``None`` or 0: prove the optimum."""
    tie: float = 0.0
    """Objective difference that counts as no improvement (absolute, in the objective's units; far
    below any real difference)."""
    msg: bool = False
    settle_gap: float = 0.0
    """Relative gap HiGHS settles for once it has run ``settle_after_s`` without proving the optimum
    (0: never; ignored when ``gap`` is given): it then stops at its first plan proven within it, as
    with ``gap``. CBC, which has no callback to stop it by, keeps proving."""
    settle_after_s: float = 0.0


@dataclass(frozen=True)
class RunResult:
    status: str
    """:data:`OPTIMAL`, :data:`FEASIBLE` (stopped at the gap asked for), :data:`TIME_LIMIT` (stopped by
    the time limit with a solution), :data:`INFEASIBLE` or :data:`NOT_SOLVED`."""
    bound: float | None = None
    """Best bound on the objective when the solve stopped before proving its optimum."""


_warned_fallback = threading.Event()


def highs_installed() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def pick_solver(name: str | None = None) -> str:
    """``name``, else ``$OSDP_SOLVER``, else HiGHS when ``highspy`` is installed, else CBC (said once)."""
    chosen = (name or os.environ.get(SOLVER_ENV) or "").strip().lower()
    if chosen and chosen not in SOLVERS:
        raise ValueError(f"unknown solver {chosen!r}: use one of {SOLVERS} (argument solver= or ${SOLVER_ENV})")
    if chosen == HIGHS and not highs_installed():
        raise SolverUnavailableError("the HiGHS solver was asked for but `highspy` is not installed: run "
                                     "`pip install highspy`, or use CBC (solver='cbc' or OSDP_SOLVER=cbc)")
    if chosen:
        return chosen
    if highs_installed():
        return HIGHS
    if not _warned_fallback.is_set():
        _warned_fallback.set()
        warnings.warn("osdp_lightning: highspy is not installed, solving with CBC (proving large plans optimal "
                      "can take minutes): `pip install highspy` for the HiGHS solver", stacklevel=3)
    return CBC


def run(problem: pulp.LpProblem, settings: SolverSettings, warm_start: dict[str, float] | None = None,
        variables: tuple[pulp.LpVariable, ...] | None = None) -> RunResult:
    """Solve ``problem``; variables get their values (``varValue``) when a solution was found.

    ``warm_start``: a feasible assignment by variable name, tried first (a starting incumbent).
    ``variables``: all of the problem's variables, when the caller has them (PuLP collects them
    from every row otherwise, which takes longer than HiGHS's solve on large tables).
    """
    if settings.name == HIGHS:
        return _run_highs(problem, settings, warm_start, variables)
    return _run_cbc(problem, settings, warm_start)


# ---------------------------------------------------------------------------------------------
# HiGHS
# ---------------------------------------------------------------------------------------------
_quiet_lock = threading.Lock()
_banner_shown = False


def _new_highs(msg: bool):  # noqa: ANN202 (highspy is imported lazily)
    """A ``highspy.Highs``; without ``msg`` its once-per-process banner is kept off stdout."""
    import highspy

    global _banner_shown
    with _quiet_lock:
        if msg or _banner_shown:
            highs = highspy.Highs()
        else:
            # NOTE: HiGHS prints its banner from C++ when the first instance is built, before any
            # option can silence it: point file descriptor 1 elsewhere for that moment.
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as null:
                    os.dup2(null.fileno(), 1)
                    highs = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        _banner_shown = True
    highs.setOptionValue("output_flag", bool(msg))
    return highs


def _load_highs(highs, problem: pulp.LpProblem,  # noqa: ANN001
                variables: tuple[pulp.LpVariable, ...] | None) -> list[pulp.LpVariable]:
    """Columns, rows and objective of ``problem`` in a few bulk calls; the columns' variables."""
    import numpy as np

    variables = list(variables) if variables is not None else problem.variables()
    index = {var.name: i for i, var in enumerate(variables)}
    objective = problem.objective
    costs = np.zeros(len(variables))
    for var, coef in objective.items():
        costs[index[var.name]] = coef
    inf = float("inf")
    lower = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    upper = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=float)
    highs.addCols(len(variables), costs, lower, upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32),
                  np.zeros(0))
    integer = np.array([i for i, v in enumerate(variables) if v.cat == pulp.LpInteger], dtype=np.int32)
    if len(integer):
        highs.changeColsIntegrality(len(integer), integer, np.ones(len(integer), dtype=np.uint8))
    highs.changeObjectiveOffset(float(objective.constant))
    starts, cols, values, row_lower, row_upper = [], [], [], [], []
    rows = problem.constraints() if callable(problem.constraints) else problem.constraints.values()  # PuLP 3.3 / 2.x
    for row in rows:
        starts.append(len(cols))
        for var, coef in row.items():
            cols.append(index[var.name])
            values.append(coef)
        row_lower.append(-inf if row.getLb() is None else row.getLb())
        row_upper.append(inf if row.getUb() is None else row.getUb())
    highs.addRows(len(starts), np.array(row_lower), np.array(row_upper), len(cols),
                  np.array(starts, dtype=np.int32), np.array(cols, dtype=np.int32), np.array(values))
    return variables


_ENUMERATION_RULE = 1 << 16
"""HiGHS's ``presolve_rule_off`` bit of its Enumeration rule."""
_SLOW_RULES = (1 << 17) | (1 << 19)
"""HiGHS's bits (1.14 on; unknown bits are ignored) of its Dual fixing and Column stuffing presolve
rules. Every binary is in the memory row, and presolving the model again when the search restarts
at the root took seconds with them (2,000 uniform units: 4.5 s of a 5 s proof, to leave one row);
without them no benchmark table proved slower, and the settling callback is not starved."""


def _configure(highs, settings: SolverSettings) -> None:  # noqa: ANN001
    rules = _SLOW_RULES
    if (highs.versionMajor(), highs.versionMinor()) >= (1, 14):
        # NOTE: HiGHS 1.14-1.16's "Enumeration" presolve rule (new in 1.14) reduces some of these
        # models wrongly: bert_large at +2% of its smallest budget, with the order rows of
        # symmetry.py, came out "Infeasible" (its solutions violate a row after postsolve); with
        # the rule off, and in HiGHS 1.13, it solves to the optimum.
        rules |= _ENUMERATION_RULE
    highs.setOptionValue("presolve_rule_off", rules)
    highs.setOptionValue("mip_rel_gap", float(settings.gap or 0.0))
    highs.setOptionValue("mip_abs_gap", float(settings.tie))
    if settings.time_limit_s is not None:
        highs.setOptionValue("time_limit", float(settings.time_limit_s))


def _run_highs(problem: pulp.LpProblem, settings: SolverSettings, warm_start: dict[str, float] | None,
               variables: tuple[pulp.LpVariable, ...] | None) -> RunResult:
    import highspy

    highs = _new_highs(settings.msg)
    _configure(highs, settings)
    variables = _load_highs(highs, problem, variables)
    settling = bool(settings.settle_gap) and not settings.gap and _settle(highs, settings.settle_gap,
                                                                          settings.settle_after_s)
    if warm_start:
        start = highspy.HighsSolution()
        start.col_value = [warm_start.get(v.name, 0.0) for v in variables]
        highs.setSolution(start)
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if has_solution:
        for var, value in zip(variables, highs.getSolution().col_value, strict=True):
            var.varValue = value
    kinds = highspy.HighsModelStatus
    if status == kinds.kOptimal:  # within the gap asked for: proven only when that gap is 0
        return RunResult(FEASIBLE, info.mip_dual_bound) if settings.gap else RunResult(OPTIMAL)
    if settling and status == kinds.kInterrupt and has_solution:  # stopped by _settle: within its gap
        return RunResult(FEASIBLE, info.mip_dual_bound)
    if status in (kinds.kInfeasible, kinds.kUnboundedOrInfeasible):  # our problems are bounded
        return RunResult(INFEASIBLE)
    if status in (kinds.kLoadError, kinds.kModelError, kinds.kPresolveError, kinds.kSolveError,
                  kinds.kPostsolveError, kinds.kUnbounded):
        raise SolverUnavailableError(f"the HiGHS solver failed ({highs.modelStatusToString(status)}); {_HINT}")
    # Time limit or another stop: keep what was found and the bound it was proven against.
    return RunResult(TIME_LIMIT, info.mip_dual_bound) if has_solution else RunResult(NOT_SOLVED)


def _settle(highs, gap: float, after_s: float) -> bool:  # noqa: ANN001
    """Interrupt ``highs`` at its first plan proven within ``gap`` once it has run ``after_s`` seconds;
    ``False`` (it proves the optimum) when this highspy has no callbacks."""
    import highspy

    kinds = getattr(getattr(highspy, "cb", None), "HighsCallbackType", None)
    if kinds is None:
        return False

    def check(_kind, _message, out, into, _data) -> None:  # noqa: ANN001
        objective, bound = out.objective_function_value, out.mip_dual_bound
        if into is None or out.running_time < after_s or not (math.isfinite(objective) and math.isfinite(bound)):
            return
        if objective - bound <= gap * max(abs(objective), 1e-12):
            into.user_interrupt = True

    # NOTE: the low-level callback of highspy 1.7 on; it replaces the high-level Highs' own, unused here.
    highs.setCallback(check, None)
    highs.startCallback(kinds.kCallbackMipInterrupt)
    return True


# ---------------------------------------------------------------------------------------------
# CBC
# ---------------------------------------------------------------------------------------------
def _run_cbc(problem: pulp.LpProblem, settings: SolverSettings,
             warm_start: dict[str, float] | None) -> RunResult:
    # NOTE: CBC's default cutoff increment (1e-5, absolute) and gaps can stop short of the
    # optimum on small objectives; ask for the exact optimum unless a time limit says otherwise.
    options = ["allow 0", f"ratio {float(settings.gap or 0.0)!r}"]
    if settings.tie:
        options.append(f"increment {settings.tie!r}")
    if warm_start:
        for var in problem.variables():
            var.setInitialValue(warm_start.get(var.name, 0.0))
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "cbc.log"
        with warnings.catch_warnings():
            # PuLP 3.3 deprecates its bundled CBC for PuLP 4.0; it is still the one that ships.
            warnings.filterwarnings("ignore", "PULP_CBC_CMD is deprecated", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=settings.time_limit_s, options=options,
                                       logPath=str(log_path), warmStart=bool(warm_start))
        if not solver.available():
            raise SolverUnavailableError(f"the CBC solver is not available ({solver.path}); {_HINT}")
        try:
            problem.solve(solver)
        except pulp.PulpSolverError as err:
            raise SolverUnavailableError(f"the CBC solver failed: {err}; {_HINT}") from err
        log = log_path.read_text() if log_path.exists() else ""
    if settings.msg:
        print(log)
    # NOTE: PuLP reports "Optimal" for a time-limited incumbent too; sol_status tells them apart.
    if problem.sol_status == pulp.LpSolutionOptimal:
        return RunResult(FEASIBLE, _parse_cbc_bound(log)) if settings.gap else RunResult(OPTIMAL)
    if problem.sol_status == pulp.LpSolutionIntegerFeasible:
        return RunResult(TIME_LIMIT, _parse_cbc_bound(log))
    if problem.status == pulp.LpStatusInfeasible:
        return RunResult(INFEASIBLE)
    return RunResult(NOT_SOLVED)


def _parse_cbc_bound(log: str) -> float | None:
    # The progress lines print the bound with more digits than the final "Lower bound:" line.
    found = re.findall(r"best possible ([-+0-9.eE]+)", log)
    return float(found[-1]) if found else None
