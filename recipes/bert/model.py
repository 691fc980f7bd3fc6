"""BERT: a bidirectional transformer encoder with a masked-language-model head.

The original layout (post-LayerNorm blocks, learned positions, GELU), without the segment
embeddings and pooler that only next-sentence prediction needs. Shapes: B = batch,
T = sequence, C = ``hidden``, H = heads, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 384
    """Token ids the embedding covers (byte-level data needs 359; BERT's WordPiece 30522)."""
    max_seq_len: int = 128
    """Longest sequence (learned position embeddings); BERT uses 512."""
    n_layer: int = 2
    """Encoder layers."""
    n_head: int = 4
    """Attention heads per layer; ``hidden`` must divide by it."""
    hidden: int = 64
    """Hidden size C."""
    intermediate: int = 256
    """Feed-forward inner size (4 * hidden in BERT)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (BERT pre-training used 0.1)."""

    def __post_init__(self) -> None:
        if self.hidden % self.n_head:
            raise ValueError(f"hidden={self.hidden} is not a multiple of n_head={self.n_head}")


class SelfAttention(nn.Module):
    """Every position attends to every position (no causal mask)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class EncoderLayer(nn.Module):
    """Post-LayerNorm block: x = ln(x + attn(x)), then x = ln(x + ffn(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.ln_attention = nn.LayerNorm(config.hidden, eps=1e-12)
        self.intermediate = nn.Linear(config.hidden, config.intermediate)
        self.output = nn.Linear(config.intermediate, config.hidden)
        self.ln_output = nn.LayerNorm(config.hidden, eps=1e-12)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_attention(x + self.dropout(self.attention(x)))  # (B, T, C)
        h = F.gelu(self.intermediate(x))  # (B, T, 4C)
        return self.ln_output(x + self.dropout(self.output(h)))  # (B, T, C)


class MLMHead(nn.Module):
    """Transform, then score against the (tied) word embeddings."""

    def __init__(self, config: BertConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = nn.Linear(config.hidden, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=1e-12)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)
        self.decoder.weight = word_embeddings.weight  # NOTE: tied; one sharding unit must own both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(F.gelu(self.transform(x))))  # (B, T, V)


class Bert(nn.Module):
    """Token ids (B, T), some replaced by ``[MASK]``, in; logits (B, T, V) for every position out."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden)
        self.ln_embeddings = nn.LayerNorm(config.hidden, eps=1e-12)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layer))
        self.mlm_head = MLMHead(config, self.word_embeddings)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT's init: normal(0, 0.02) weights, zero biases; runs at construction and, for a model built on the meta device, when osdp
        materializes it (after each layer's own ``reset_parameters``, which this overrides)."""
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)  # (B, T, C)
        x = self.dropout(self.ln_embeddings(x))
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        return self.mlm_head(x)  # (B, T, V)
