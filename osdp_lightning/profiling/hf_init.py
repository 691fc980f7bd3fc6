"""Hugging Face ``transformers`` models on the meta device: which module initialises which, and how.

A ``PreTrainedModel`` initialises its modules through its ``_init_weights(module)`` (what
``post_init()`` / ``initialize_weights()`` run, children before parents, each nested
``PreTrainedModel`` with its own); its modules mostly have no ``reset_parameters()`` (RMS and T5
norms, GPT-2's ``Conv1D``), and it re-creates the non-persistent buffers computed in ``__init__``
(rotary ``inv_freq`` / ``original_inv_freq`` from the config, BERT's ``position_ids``). This module
finds the model that owns a module and runs its ``_init_weights``; ``transformers`` is never imported
here: a model built from it has already loaded the module that defines ``PreTrainedModel``.
"""

from __future__ import annotations

import sys

from torch import nn


def is_hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``."""
    modeling = sys.modules.get("transformers.modeling_utils")
    model_class = getattr(modeling, "PreTrainedModel", None)
    return model_class is not None and isinstance(module, model_class)


def hugging_face_owner(root: nn.Module, name: str) -> nn.Module | None:
    """The innermost Hugging Face model among ``root``'s module ``name`` and its ancestors (``None``:
    none), the one whose ``_init_weights`` initialises that module (or a copy of it)."""
    owner = root if is_hugging_face_model(root) else None
    module = root
    for part in name.split(".") if name else ():
        module = module.get_submodule(part)
        owner = module if is_hugging_face_model(module) else owner
    return owner


def init_as_hugging_face(owner: nn.Module, module: nn.Module) -> None:
    """``owner._init_weights(module)``, as ``owner.initialize_weights()`` would run it for ``module``.

    NOTE: not ``_initialize_weights``, which sets ``module._is_hf_initialized`` and skips the module
    from then on: materializing runs every module once per unit, each time on new tensors. Those
    tensors carry no ``_is_hf_initialized`` flag of their own, so ``transformers.initialization``'s
    functions write them.
    """
    owner._init_weights(module)
