"""The models the PyTorch jobs train, by name and shape: the image classifiers and the transformer's sizes.

Shapes only (no weights, no framework), so that the parser can check a layout against a model, and the
memory estimate and MFU can count parameters and FLOPs, before torch is imported. The modules themselves
are built from these by training/torch/models.py (ResNets) and training/torch/transformer.py (GPT).

Runs wherever a job runs. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_MODELS = ("resnet50", "resnet_tiny", "simple_cnn")  # every framework's image classifiers
RESNETS = ("resnet50", "resnet_tiny")  # the image models FSDP and pipeline stages split by residual block
SYNTHETIC_CLASSES = 1000  # the classifier's width on synthetic images, without --num-classes (ImageNet's)


@dataclass(frozen=True)
class GPTConfig:
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_seq_len: int
    n_kv_heads: int | None = None  # grouped-query attention (Llama 3); None: one K/V head per query head
    swiglu: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


GPT_CONFIGS = {
    # Small enough for multi-process CPU tests in seconds; byte-level text fits its 256 tokens. It
    # has the Llama block (grouped-query attention, SwiGLU) so the tests cover every TP sharding.
    "gpt-tiny": GPTConfig("gpt-tiny", 256, 64, 4, 4, 128, 256, n_kv_heads=2, swiglu=True),
    # GPT-2 small and GPT-3 XL shapes (Radford et al. 2019; Brown et al. 2020, table 2.1).
    "gpt-125m": GPTConfig("gpt-125m", 50257, 768, 12, 12, 3072, 1024),
    "gpt-1.3b": GPTConfig("gpt-1.3b", 50257, 2048, 24, 16, 8192, 2048),
    # Llama 3 8B (Meta's params.json: 8.03B parameters).
    "llama-8b": GPTConfig(
        "llama-8b", 128256, 4096, 32, 32, 14336, 8192, n_kv_heads=8, swiglu=True, rope_theta=500000.0
    ),
}


def parameter_count(cfg: GPTConfig) -> int:
    """Parameters of the transformer (training.torch.transformer.GPT) with ``cfg``, from the shapes alone."""
    kv_dim = cfg.kv_heads * cfg.head_dim
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim
    mlp = (3 if cfg.swiglu else 2) * cfg.dim * cfg.ffn_dim
    block = attention + mlp + 2 * cfg.dim  # two RMSNorm weights
    return cfg.n_layers * block + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x the parameters that multiply (all but the
    embedding lookup) plus attention's scores and weighted sum, 12 x layers x dim x seq_len
    (Chowdhery et al. 2022, appendix B; causal masking not subtracted, as is usual for MFU)."""
    matmul_params = parameter_count(cfg) - cfg.vocab_size * cfg.dim
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len
