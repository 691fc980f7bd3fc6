"""Command-line entry points (Hydra apps; configs in the top-level ``conf`` package).

- ``osdp-train`` (:mod:`osdp_lightning.cli.train`): train a recipe with a strategy on a cluster,
  print the plan and a summary; with ``-m``, a sweep that ends with a summary table
  (:mod:`osdp_lightning.cli.sweep`).
- ``osdp-plan`` (:mod:`osdp_lightning.cli.plan`): profile and solve without training; osdp
  against the ddp / zero2 / zero3 baselines side by side.
"""
