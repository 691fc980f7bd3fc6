"""The cost model's vocabulary: memory budgets, the cluster (links, calibrated step terms), and
what a choice costs a unit."""
