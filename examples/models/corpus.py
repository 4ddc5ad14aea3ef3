"""An embedded byte-level text corpus that needs no download.

The default text is ``pydoc_data.topics`` -- the ~460 KB of Python reference documentation that
ships with CPython for ``help()`` -- so training runs anywhere Python runs, offline and in CI. Any
UTF-8 text file can be used instead (``path=...``).

Tokens are raw bytes (vocabulary 256). The split is deterministic and contiguous: the last
``val_fraction`` of the byte stream is validation, so no training window overlaps a validation one.
Training samples are non-overlapping ``seq_len + 1``-byte windows (inputs and next-byte targets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

#: Name of the built-in corpus.
PYDOC_TOPICS = "pydoc_topics"


def load_pydoc_topics() -> str:
    """The text of every ``help()`` topic shipped with Python, in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some distributions split the stdlib docs into another package
        raise RuntimeError(
            "The embedded corpus needs `pydoc_data`, part of the Python standard library, which this Python "
            "lacks (some Linux distributions ship it separately, e.g. Debian's `libpython3-stdlib`). Install it, "
            "or pass `path=` a UTF-8 text file to train on."
        ) from error
    return "\n\n".join(f"{name}\n{'=' * len(name)}\n{topics[name].strip()}" for name in sorted(topics))


def encode_bytes(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode_bytes(tokens: Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class ByteWindows(Dataset[tuple[Tensor, Tensor]]):
    """Windows of ``seq_len`` input bytes and the following byte for each as target, every ``stride`` bytes."""

    def __init__(self, tokens: Tensor, seq_len: int, stride: Optional[int] = None) -> None:
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"The text has {tokens.numel()} bytes, fewer than one window of seq_len + 1 = {seq_len + 1}. "
                "Use a shorter seq_len or a larger text/val_fraction."
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.num_windows = (tokens.numel() - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(index)
        start = index * self.stride
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class ByteCorpusDataModule(pl.LightningDataModule):
    """Train/validation (and test = validation) loaders over a byte-level corpus.

    Args:
        seq_len: tokens per sample; must not exceed the model's ``seq_len``.
        batch_size: samples per micro-batch, per rank.
        val_fraction: trailing share of the text held out for validation.
        path: a UTF-8 text file to use instead of the embedded corpus.
        max_bytes: keep only the first ``max_bytes`` bytes (quick experiments).
        num_workers: DataLoader workers (0: load in the training process; the data is in memory).
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        path: Optional[Union[str, Path]] = None,
        max_bytes: Optional[int] = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}.")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}.")
        self.save_hyperparameters()
        if path is not None:
            self.hparams["path"] = str(path)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.train_tokens: Optional[Tensor] = None
        self.val_tokens: Optional[Tensor] = None

    @property
    def source(self) -> str:
        return str(self.path) if self.path is not None else PYDOC_TOPICS

    def load_text(self) -> str:
        if self.path is None:
            return load_pydoc_topics()
        if not self.path.is_file():
            raise FileNotFoundError(f"Corpus file {self.path} does not exist; pass an existing UTF-8 text file.")
        return self.path.read_text(encoding="utf-8")

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_tokens is not None:
            return
        tokens = encode_bytes(self.load_text())
        if self.max_bytes is not None:
            tokens = tokens[: self.max_bytes]
        split = int(tokens.numel() * (1.0 - self.val_fraction))
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]

    def train_dataset(self) -> ByteWindows:
        self.setup()
        assert self.train_tokens is not None
        return ByteWindows(self.train_tokens, self.seq_len)

    def val_dataset(self) -> ByteWindows:
        self.setup()
        assert self.val_tokens is not None
        return ByteWindows(self.val_tokens, self.seq_len)

    def _loader(self, dataset: ByteWindows, shuffle: bool) -> DataLoader:
        # Lightning replaces the sampler with a DistributedSampler (shuffle=True for training).
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers, drop_last=shuffle
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset(), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset(), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset(), shuffle=False)
