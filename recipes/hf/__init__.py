"""Hugging Face recipe: ``transformers`` causal LMs (Llama, GPT-2, GPT-NeoX...) built from a config.

The model is ``transformers.AutoModelForCausalLM.from_config`` (random weights, nothing downloaded)
or ``from_pretrained`` on a local directory (``model.pretrained=DIR``); the data is the GPT recipe's
byte-level text. ``transformers`` is an optional dependency (``pip install 'osdp_lightning[hf]'``):
importing this package does not import it, building a model does.
"""

from osdp_lightning.recipes.hf.module import HFCausalLMModule

__all__ = ["HFCausalLMModule"]
