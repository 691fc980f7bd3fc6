"""Hydra configs of ``osdp-train`` and ``osdp-plan`` (a package so they install with the code).

Groups: ``model/`` (a recipe at a size, with its default data), ``data/``, ``cluster/``,
``strategy/``, ``trainer/``, ``logger/``, ``experiment/``. Add your own directory of configs with
``--config-dir /path/to/my_conf`` (searched before these; same group layout).
"""
