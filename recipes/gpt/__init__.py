"""GPT recipe: decoder-only language model with causal attention and a tied output head."""

from osdp_lightning.recipes.gpt.data import GPTDataModule
from osdp_lightning.recipes.gpt.model import GPT, GPTConfig
from osdp_lightning.recipes.gpt.module import GPTLitModule

__all__ = ["GPT", "GPTConfig", "GPTDataModule", "GPTLitModule"]
