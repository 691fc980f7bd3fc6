"""From a model and a cluster to a plan: profiling it with each choice family's hooks (whole or
from shapes), pricing every choice per unit, solving, and the planner every entry point shares."""
