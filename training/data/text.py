"""Token batches for the transformer: synthetic sequences, or byte-level tokens from text files.

A step's global batch depends only on ``(seed, step)``: every layout trains on the same samples
(data-parallel replicas take disjoint slices of it, tensor-parallel and pipeline ranks of one
replica take the same slice), and a resumed run continues with exactly the batches the
interrupted one would have seen. Each row has ``seq_len + 1`` tokens: the inputs are the first
``seq_len``, the targets the last ``seq_len`` (next-token prediction).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from training.data.imagenet import DataDirError
from training.errors import BadInput

MAX_STRIDE = 7  # synthetic rows count up by 1..7 (mod vocab)
BYTE_VOCAB = 256


class TokenSource(Protocol):
    def batch(self, step: int, rows: int, seq_len: int) -> np.ndarray:
        """The global batch of ``step``: ``rows`` x ``seq_len + 1`` token ids (int64)."""
        ...


@dataclass(frozen=True)
class SyntheticTokens:
    """Arithmetic sequences (a random start and a random stride per row, modulo the vocabulary):
    learnable from two tokens of context, so the loss falls quickly and a run that does not learn
    shows it, and as cheap to make as random tokens."""

    seed: int
    vocab_size: int

    def batch(self, step: int, rows: int, seq_len: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, self.vocab_size, size=(rows, 1))
        strides = rng.integers(1, MAX_STRIDE + 1, size=(rows, 1))
        return (starts + strides * np.arange(seq_len + 1)) % self.vocab_size


@dataclass(frozen=True)
class TextCorpus:
    """Every file under a directory as bytes (token = byte value), concatenated in path order; each
    row of a batch is a window at a random offset. The corpus is held in memory."""

    data: np.ndarray  # uint8
    seed: int
    root: Path

    @classmethod
    def load(cls, root: Path, seed: int, seq_len: int) -> TextCorpus:
        """Read ``root``; :class:`DataDirError` if it holds fewer than ``seq_len + 1`` bytes."""
        if not root.is_dir():
            raise DataDirError(f"--data-dir {root}: {'not a directory' if root.exists() else 'does not exist'}")
        files = sorted(path for path in root.rglob("*") if path.is_file() and not path.name.startswith("."))
        try:
            data = np.concatenate([np.fromfile(path, dtype=np.uint8) for path in files] or [np.zeros(0, np.uint8)])
        except OSError as exc:
            raise DataDirError(f"--data-dir {root}: cannot read {exc.filename}: {exc.strerror}") from None
        if len(data) <= seq_len:
            raise DataDirError(
                f"--data-dir {root}: {len(files)} files with {len(data)} bytes in all, fewer than one sequence "
                f"(--seq-len {seq_len} + 1): add text files or lower --seq-len"
            )
        return cls(data, seed, root)

    def batch(self, step: int, rows: int, seq_len: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        offsets = rng.integers(0, len(self.data) - seq_len, size=rows)
        windows = np.lib.stride_tricks.sliding_window_view(self.data, seq_len + 1)
        return windows[offsets].astype(np.int64)


def token_source(kind: str, data_dir: Path | None, seed: int, vocab_size: int, seq_len: int) -> TokenSource:
    if kind == "text":
        assert data_dir is not None  # the parser requires it
        if vocab_size < BYTE_VOCAB:
            raise BadInput(f"--data text needs a vocabulary of at least {BYTE_VOCAB} tokens (bytes)")
        return TextCorpus.load(data_dir, seed, seq_len)
    return SyntheticTokens(seed, vocab_size)


def replica_rows(tokens: np.ndarray, replica: int, batch_size: int) -> np.ndarray:
    """Replica ``replica``'s ``batch_size`` rows of a global batch, each ``seq_len + 1`` tokens: a
    row's first ``seq_len`` are the inputs, its last ``seq_len`` the targets."""
    return tokens[replica * batch_size : (replica + 1) * batch_size]
