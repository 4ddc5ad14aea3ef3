"""Models and data for examples and benchmarks: a GPT-style LM and an embedded byte-level corpus."""

from examples.models.corpus import ByteCorpusDataModule, ByteWindows, decode_bytes, encode_bytes
from examples.models.gpt import GPT, GPT_PRESETS, GPTConfig, GPTLightningModule

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "ByteCorpusDataModule",
    "ByteWindows",
    "GPTConfig",
    "GPTLightningModule",
    "decode_bytes",
    "encode_bytes",
]
