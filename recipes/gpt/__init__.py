"""GPT recipe: decoder-only language model with causal attention and a tied output head."""

from recipes.gpt.data import GPTDataModule
from recipes.gpt.model import GPT, GPTConfig
from recipes.gpt.module import GPTLitModule

__all__ = ["GPT", "GPTConfig", "GPTDataModule", "GPTLitModule"]
