"""Every private Lightning API osdp uses, imported in this one place.

Lightning does not promise these names from one release to the next; when an upgrade moves one,
this module is the only import to fix. Imported here (each re-exported under a public name):

- ``lightning.fabric.plugins.collectives.torch_collective.default_pg_timeout``: the process-group
  timeout both of Lightning's ``ModelParallelStrategy`` classes default to;
- ``lightning.fabric.utilities.optimizer._optimizers_to_device``: optimizer state onto the device
  (the Trainer strategy, after it built the optimizers);
- ``lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher`` and
  ``lightning.fabric.strategies.launchers.subprocess_script._SubprocessScriptLauncher``: the
  launchers both strategies build on every rank (they also set each rank's thread count);
- ``lightning.fabric.strategies.strategy._BackwardSyncControl``: the interface behind
  ``fabric.no_backward_sync``;
- ``lightning.fabric.strategies.strategy._validate_keys_for_strict_loading``: Fabric's own error for
  a ``fabric.load`` that asks for keys the checkpoint lacks;
- ``lightning.fabric.utilities.types._Stateful``: what Fabric saves through ``state_dict()``.

Private members the strategies override or read (not imports, listed so an upgrade checks them):
``_configure_launcher``, ``_setup_distributed``, ``_set_world_ranks``, ``_get_process_group_backend``,
``_launcher``, ``_timeout``, ``_save_distributed_checkpoint``, ``_backward_sync_control`` and
``_device_mesh`` of both ``ModelParallelStrategy`` classes.
"""

from __future__ import annotations

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricScriptLauncher,
)
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.strategies.strategy import (
    _validate_keys_for_strict_loading as validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.types import _Stateful as Stateful
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as TrainerScriptLauncher,
)

__all__ = [
    "BackwardSyncControl",
    "FabricScriptLauncher",
    "Stateful",
    "TrainerScriptLauncher",
    "default_pg_timeout",
    "optimizers_to_device",
    "validate_keys_for_strict_loading",
]
