"""The Hugging Face causal-LM training logic: next-token cross-entropy from ``transformers``' own loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from osdp_lightning.recipes.hf.model import build_causal_lm
from osdp_lightning.recipes.task import LanguageModelTask


class HFCausalLMModule(LanguageModelTask):
    """Causal language modelling with a ``transformers`` model held as ``self.net``.

    The model is built here, in ``__init__``, so that Lightning's ``trainer.init_module()`` context
    (the meta device under ``meta_init=true``) applies to it; strategy=osdp then initialises it as
    ``transformers`` would (:mod:`osdp_lightning.profiling.hf_init`). Batches are the GPT recipe's:
    ``{"input_ids": (B, T), "labels": (B, T)}`` with the labels already shifted one token left.
    """

    def __init__(self, model_type: str, hf_config: Mapping[str, Any] | None = None,
                 pretrained: str | None = None, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 10) -> None:
        net = build_causal_lm(model_type, dict(hf_config or {}), pretrained)
        super().__init__(net, lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps)
        # NOTE: where osdp-train finds the weights to load into a model built on the meta device (which
        # took only its config from them): OSDPStrategy(pretrained=...) reads each rank's shards of
        # them once the plan is applied. Built eagerly, the model holds them already.
        self.pretrained = pretrained

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # NOTE: transformers shifts `labels` by one itself unless it is given `shift_labels`; these
        # are shifted already, so all T positions are predicted as in the GPT recipe. Its loss views
        # them flat: the data's labels are a slice of the window, hence contiguous(). No KV cache in
        # training (as transformers' own training path).
        labels = batch["labels"].contiguous()  # (B, T): the token after each input position
        return self.net(input_ids=batch["input_ids"], labels=labels, shift_labels=labels, use_cache=False).loss
