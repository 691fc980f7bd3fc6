"""T5: an encoder-decoder transformer with relative position bias (the T5 v1.0 layout).

Pre-RMSNorm blocks without biases, ReLU feed-forward, no position embeddings: each stack learns
one bias per head and relative-distance bucket, computed once and added to the attention scores
of all its layers. Attention scores are not scaled by 1/sqrt(d) (the init absorbs it). One
embedding is shared by encoder, decoder and output head. Shapes: B = batch, S = encoder
length, T = decoder length, D = ``d_model``, H = heads, V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class T5Config:
    vocab_size: int = 384
    """Token ids the embedding covers (byte-level data needs 359; T5's SentencePiece 32128)."""
    d_model: int = 64
    """Hidden size D."""
    d_kv: int = 16
    """Size of each head's query, key and value."""
    d_ff: int = 256
    """Feed-forward inner size."""
    n_head: int = 4
    """Attention heads."""
    n_encoder_layer: int = 2
    """Encoder blocks."""
    n_decoder_layer: int = 2
    """Decoder blocks."""
    num_buckets: int = 32
    """Relative-distance buckets of the position bias (half per direction in the encoder)."""
    max_distance: int = 128
    """Distances beyond this share the last bucket."""
    dropout: float = 0.0
    """Dropout on residual branches and attention weights (T5 pre-training used 0.1)."""


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each ``key - query`` distance: exact for small ones, logarithmic up to ``max_distance``."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket += (relative > 0).long() * num_buckets  # keys after the query get their own half
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # the decoder only looks back
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + log_ratio * (num_buckets - max_exact)).long().clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, far)


class RelativePositionBias(nn.Module):
    """A learned scalar per head and distance bucket, added to the attention scores."""

    def __init__(self, config: T5Config, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.num_buckets
        self.max_distance = config.max_distance
        self.embedding = nn.Embedding(config.num_buckets, config.n_head)

    def forward(self, q_len: int, k_len: int) -> torch.Tensor:
        device = self.embedding.weight.device
        relative = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, q_len, k_len)


class Attention(nn.Module):
    """Multi-head attention; self-attention when ``context`` is None, cross-attention otherwise."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.n_head, self.d_kv = config.n_head, config.d_kv
        self.dropout = config.dropout
        inner = config.n_head * config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        context = x if context is None else context  # (B, S, D) for cross-attention
        q = self.q(x).view(B, T, self.n_head, self.d_kv).transpose(1, 2)  # (B, H, T, d_kv)
        k = self.k(context).view(B, -1, self.n_head, self.d_kv).transpose(1, 2)  # (B, H, S, d_kv)
        v = self.v(context).view(B, -1, self.n_head, self.d_kv).transpose(1, 2)  # (B, H, S, d_kv)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, d_kv)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_head * self.d_kv))  # (B, T, D)


class FeedForward(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(F.relu(self.wi(x))))  # (B, T, D)


class EncoderBlock(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.ln_self, self.self_attn = nn.RMSNorm(config.d_model, eps=1e-6), Attention(config)
        self.ln_ff, self.ff = nn.RMSNorm(config.d_model, eps=1e-6), FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.ln_self(x), bias))
        return x + self.dropout(self.ff(self.ln_ff(x)))  # (B, S, D)


class DecoderBlock(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.ln_self, self.self_attn = nn.RMSNorm(config.d_model, eps=1e-6), Attention(config)
        self.ln_cross, self.cross_attn = nn.RMSNorm(config.d_model, eps=1e-6), Attention(config)
        self.ln_ff, self.ff = nn.RMSNorm(config.d_model, eps=1e-6), FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, self_bias: torch.Tensor, memory: torch.Tensor,
                cross_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.ln_self(x), self_bias))
        x = x + self.dropout(self.cross_attn(self.ln_cross(x), cross_bias, context=memory))
        return x + self.dropout(self.ff(self.ln_ff(x)))  # (B, T, D)


class T5(nn.Module):
    """Encoder ids (B, S), their padding mask and decoder ids (B, T) in; logits (B, T, V) out."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder_bias = RelativePositionBias(config, bidirectional=True)
        self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_encoder_layer))
        self.encoder_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.decoder_bias = RelativePositionBias(config, bidirectional=False)
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.n_decoder_layer))
        self.decoder_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.shared.weight  # NOTE: tied; one sharding unit must own both
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """T5's init: each matrix scaled by its fan-in; runs at construction and, for a model built on the meta device, when osdp
        materializes it (after each layer's own ``reset_parameters``, which this overrides)."""
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # T5's init: each matrix scaled by its fan-in, which also stands in for 1/sqrt(d_kv).
        c = self.config
        if isinstance(module, Attention):
            nn.init.normal_(module.q.weight, std=(c.d_model * c.d_kv) ** -0.5)
            nn.init.normal_(module.k.weight, std=c.d_model**-0.5)
            nn.init.normal_(module.v.weight, std=c.d_model**-0.5)
            nn.init.normal_(module.o.weight, std=(c.n_head * c.d_kv) ** -0.5)
        elif isinstance(module, FeedForward):
            nn.init.normal_(module.wi.weight, std=c.d_model**-0.5)
            nn.init.normal_(module.wo.weight, std=c.d_ff**-0.5)
        elif isinstance(module, RelativePositionBias):
            nn.init.normal_(module.embedding.weight, std=c.d_model**-0.5)
        elif module is self:
            nn.init.normal_(self.shared.weight, std=1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                decoder_input_ids: torch.Tensor) -> torch.Tensor:
        S, T = input_ids.shape[1], decoder_input_ids.shape[1]
        neg = torch.finfo(self.shared.weight.dtype).min
        # Padding keys of the encoder input get a large negative score in every attention over them.
        pad_bias = torch.zeros(attention_mask.shape, dtype=self.shared.weight.dtype, device=input_ids.device)
        pad_bias = pad_bias.masked_fill(~attention_mask.bool(), neg)[:, None, None, :]  # (B, 1, 1, S)

        x = self.dropout(self.shared(input_ids))  # (B, S, D)
        encoder_bias = self.encoder_bias(S, S) + pad_bias  # (B, H, S, S)
        for block in self.encoder:
            x = block(x, encoder_bias)
        memory = self.dropout(self.encoder_norm(x))  # (B, S, D)

        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()  # (T, T)
        decoder_bias = self.decoder_bias(T, T).masked_fill(~causal, neg)  # (1, H, T, T)
        y = self.dropout(self.shared(decoder_input_ids))  # (B, T, D)
        for block in self.decoder:
            y = block(y, decoder_bias, memory, pad_bias)
        y = self.dropout(self.decoder_norm(y))  # (B, T, D)
        return self.lm_head(y * self.config.d_model**-0.5)  # (B, T, V)
