"""What an exact resume needs besides weights and optimizer state: RNG states and data position.

Lightning restores the loops, learning-rate schedulers and callbacks from a checkpoint, and the
``DistributedSampler`` it injects shuffles by ``seed + epoch``: an epoch-boundary resume already
sees the same data. Mid-epoch it only continues a loader that is *stateful* (has ``state_dict`` /
``load_state_dict``); :class:`ResumableDataLoader` is a drop-in ``DataLoader`` that is. The osdp
strategy stores every rank's RNG state in its checkpoints and restores it when the world size is
unchanged (dropout then continues where it stopped).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that Lightning can resume mid-epoch.

    It counts the batches it has handed out in the current pass; after ``load_state_dict`` the next
    pass skips that many (drawn and dropped, so samplers, workers and their seeds stay exactly as in
    an uninterrupted run). Lightning saves the count with the fit loop when the loader has a length
    (it then does not fetch ahead). Across world sizes the count is per rank, so a resumed epoch
    continues at the same batch index, not at the same samples.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_served = 0
        self._skip = 0
        self._pass_start_generator: torch.Tensor | None = None
        self._resume_generator: torch.Tensor | None = None

    def __iter__(self) -> Iterator[Any]:
        return self._resumable_iter()

    def _resumable_iter(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if self.generator is not None:
            if self._resume_generator is not None:
                # the state the interrupted pass started from (or, after a finished pass, the next one's)
                self.generator.set_state(self._resume_generator)
                self._resume_generator = None
            self._pass_start_generator = self.generator.get_state()
        iterator = super().__iter__()
        self._batches_served = 0
        for _ in range(skip):
            next(iterator)  # drawn and dropped: sampler order and worker seeds stay as uninterrupted
            self._batches_served += 1
        for batch in iterator:
            self._batches_served += 1
            yield batch

    def _finished_pass(self, served: int) -> bool:
        try:
            return served >= len(self) > 0
        except TypeError:  # no length: a pass ends only when the data does
            return False

    def state_dict(self) -> dict[str, Any]:
        return {"batches_served": self._batches_served, "pass_start_generator": self._pass_start_generator,
                "generator_now": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        served = int(state.get("batches_served", 0))
        if self._finished_pass(served):  # saved on the last batch: the next pass starts afresh
            self._skip, self._resume_generator = 0, state.get("generator_now")
        else:
            self._skip, self._resume_generator = served, state.get("pass_start_generator")


def collect_rng_state() -> dict[str, Any]:
    """This process's RNG states, in types that ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_own_rng_state(info: dict[str, Any], rank: int, world_size: int) -> None:
    """Restore this rank's saved RNG state (``info["rng_states"][rank]``) when the world size matches."""
    states = info.get("rng_states") or []
    # NOTE: under another world size there is no rank-to-rank correspondence; keep fresh RNGs.
    if len(states) == world_size:
        restore_rng_state(states[rank])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
