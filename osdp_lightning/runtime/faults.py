"""Fail fast together: a rank that raises must not leave the others waiting in a collective.

Stages that run locally on every rank (applying the plan, finishing a checkpoint on rank 0) end
with one all-gather of a status; when any rank failed, every rank raises, naming the failed rank
and its error, instead of waiting in the next collective until the process-group timeout. Also
here: the object collectives this needs (they work in one process without a process group), and
the torchrun restart fix (:func:`init_elastic_process_group`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class RankFailedError(RuntimeError):
    """Another rank failed in a stage this rank finished."""


# -- object collectives that also work without a process group (one process) ----------------------
def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# -- failing together ------------------------------------------------------------------------------
def portable_error(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (to be broadcast to the other ranks), else a
    ``RuntimeError`` with its type and message: an exception holding an unpicklable object (a
    pybind11 function record, a lock) must still reach every rank."""
    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001  (any failure to round-trip: send the text instead)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return copy if isinstance(copy, BaseException) else RuntimeError(f"{type(error).__name__}: {error}")


def raise_if_any_rank_failed(error: BaseException | None, stage: str) -> None:
    """Call on every rank with this rank's error (or ``None``); raises on every rank if any failed."""
    messages = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failures = [(r, message) for r, message in enumerate(messages) if message]
    if failures:
        failed_rank, message = failures[0]
        raise RankFailedError(f"rank {failed_rank} failed while {stage}: {message}")


@contextlib.contextmanager
def all_ranks_succeed(stage: str) -> Iterator[None]:
    """Run the block on every rank; afterwards either every rank continues or every rank raises."""
    error: BaseException | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001  (re-raised below, after the others heard of it)
        error = err
    raise_if_any_rank_failed(error, stage)


def init_elastic_process_group(backend: str, rank: int, world_size: int, timeout: timedelta) -> bool:
    """Under torchrun, start the default process group in a key space of its own restart attempt.

    torchrun (torch >= 2.5, c10d rendezvous) shares its TCPStore with the workers and keeps it
    across restarts, but the workers' ``env://`` rendezvous does not prefix keys per attempt: a
    restarted rank reads the previous attempt's addresses and fails with "Gloo connectFullMesh
    failed" (pytorch/pytorch#135712). Each node's agent counts restarts itself, so the count is a
    consistent prefix only on one node; with several nodes run torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead (each attempt then gets a fresh store).
    Returns whether it started the group (otherwise Lightning starts it as usual).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or dist.is_initialized():
        return False
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"/osdp/attempt_{attempt}/", shared)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if backend == "nccl":  # as Lightning does: torch warns about an undestroyed NCCL group at exit
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return True
