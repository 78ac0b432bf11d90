"""A decoder-only transformer (Llama-style block), for the model-parallel job, at the four sizes of
training/config/models.py (``GPT_CONFIGS``).

Shapes only: no weights are downloaded. Every block is pre-norm (RMSNorm), with rotary position
embeddings, no biases, causal ``F.scaled_dot_product_attention``, and either a GELU MLP
(``w1``, ``w2``: the GPT sizes) or a SwiGLU MLP (``w1``, ``w2``, ``w3``: Llama 3). The output
projection is not tied to the embeddings, so a pipeline's last stage can own it; that is why
``gpt-125m`` counts 162M parameters (GPT-2 small's 124M tie the two 38.6M matrices and add
learned positions and biases).

The model is laid out for model parallelism:

* ``layers`` is an ``nn.ModuleDict`` keyed ``"0"``..``"n-1"``: a pipeline stage deletes the keys
  it does not own and keeps the fully-qualified names of the rest (checkpoints match by name);
  ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` on stages that do not own them;
* attention derives its head count from the width of ``wq``'s output at run time, so
  column-sharded ``wq``/``wk``/``wv`` (tensor parallel) simply run fewer heads per rank.

Initialization is deterministic from a seed and independent of the layout: :func:`build_gpt`
creates the module on the meta device (no memory, no random numbers) and :meth:`GPT.init_weights`
fills it in parameter order from a ``torch.Generator``. Models too big to build whole in every
process are materialized after sharding instead (``training.model_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.config.models import GPTConfig

INIT_STD = 0.02  # GPT-2's init; the residual projections are scaled down further with depth


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, heads, seq, head_dim); heads are this rank's share when wq/wk/wv are column-sharded.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_tables(seq, self.head_dim, self.rope_theta, x.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Local query heads h*g..h*g+g-1 share local K/V head h, also when TP splits both evenly.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq, head_dim), computed per call: no buffers to place or
    shard, and the cost (seq x head_dim) is nothing beside the matmuls."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention (GPT-NeoX, Hugging Face Llama)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) if cfg.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One transformer layer: the unit of FSDP sharding, activation checkpointing and pipeline splits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab); a pipeline stage without
        ``tok_embeddings`` takes hidden states, one without ``output`` returns them."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        init_weights(self, self.cfg.n_layers, generator)


@torch.no_grad()
def init_weights(model: nn.Module, n_layers: int, generator: torch.Generator | None = None) -> None:
    """Fill every parameter of ``model`` (a :class:`GPT`, or a pipeline chunk of one) in
    ``named_parameters`` order: normal(0.02) for matrices, with the residual projections (``wo``,
    ``w2``) scaled by 1/sqrt(2 x layers) as in GPT-2; ones for norms. The same generator state
    gives the same weights in every process."""
    residual_std = INIT_STD / (2 * n_layers) ** 0.5
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
            param.normal_(0.0, std, generator=generator)


def build_gpt(cfg: GPTConfig, seed: int | None, device: torch.device | str = "cpu") -> GPT:
    """The model with deterministic weights from ``seed`` on ``device``; ``seed=None`` leaves it on
    the meta device, unallocated (for parameter counts, or to materialize after sharding)."""
    with torch.device("meta"):
        model = GPT(cfg)
    if seed is None:
        return model
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.init_weights(generator)
    return model
