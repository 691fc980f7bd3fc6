"""Hugging Face causal LMs: built from a config (random weights) or read from a local directory.

Nothing is downloaded. A config names an architecture (``model_type``: ``llama``, ``gpt2``,
``gpt_neox``, any type ``transformers.AutoModelForCausalLM`` knows) and its sizes, in the
architecture-neutral names every ``transformers`` config accepts (``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``max_position_embeddings``; GPT-2's config maps them
to its own ``n_embd``, ``n_layer``...). A pretrained model is a directory written by
``save_pretrained``, read with ``local_files_only=True``.

``transformers`` is an optional dependency: it is imported here when a model is built, never by
``import osdp_lightning``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def build_causal_lm(model_type: str, hf_config: Mapping[str, Any], pretrained: str | None = None) -> nn.Module:
    """A ``transformers`` causal LM: ``pretrained``'s weights, or random ones from ``hf_config``
    (the fields of the architecture's ``transformers`` config).

    Built where tensors are being created: under ``torch.device("meta")`` (Lightning's
    ``trainer.init_module(empty_init=True)``) it holds shapes only, and a ``pretrained`` directory
    only gives its config (its weights are for the strategy to load into the shards).
    With ``pretrained``, the directory's ``config.json`` decides the architecture: ``model_type``
    and ``hf_config`` are not used.
    """
    hf = import_transformers()
    if pretrained is not None and not creates_meta_tensors():
        net = hf.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
        # NOTE: transformers keeps the dtype the weights were saved in; the optimizer and Lightning's
        # precision plugins expect float32 parameters.
        net = net.to(torch.float32)
        # NOTE: from_pretrained returns the model in eval mode, which Lightning keeps: dropout would be
        # off and Hugging Face blocks would not checkpoint. A model built from a config trains.
        net.train()
    else:
        config = (hf.AutoConfig.from_pretrained(pretrained, local_files_only=True) if pretrained is not None
                  else hf.AutoConfig.for_model(model_type, **hf_config))
        net = hf.AutoModelForCausalLM.from_config(config)
    # NOTE: transformers picks the loss from the class name; GPT2LMHeadModel's does not end in
    # ForCausalLM, and without this it warns that it falls back to the causal-LM loss anyway.
    net.loss_type = "ForCausalLM"
    return net


def creates_meta_tensors() -> bool:
    """Whether a tensor made here lands on the meta device (inside ``torch.device("meta")``)."""
    return torch.empty(0).is_meta


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("the Hugging Face recipe (model=hf_*) needs transformers: "
                          "pip install 'osdp_lightning[hf]'") from error
    return transformers
