"""A GPT-style decoder-only language model and the LightningModule that trains it.

The model is deliberately plain (pre-LayerNorm blocks, PyTorch SDPA causal attention, GELU MLP)
so that what the benchmarks measure is the sharding, not the model. Two properties matter to the
strategy:

* the transformer blocks live in an ``nn.ModuleList``, so MiCS's default wrap policy makes each
  block one FSDP unit (one all-gather / reduce-scatter per block);
* every module that owns parameters defines ``reset_parameters()``, so the model can be created
  on the meta device (``trainer.init_module(empty_init=True)``) and initialised shard by shard
  after sharding, with the same distribution as an eager initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from lightning_mics.planner import ModelSpec

#: Byte-level tokens: every byte value is a token, so any text encodes without a tokenizer.
BYTE_VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. Use :meth:`preset` for the named sizes (:data:`GPT_PRESETS`)."""

    vocab_size: int = BYTE_VOCAB_SIZE
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    #: Share the token embedding with the output head (fewer parameters; one FSDP unit holds both).
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                f"(each head gets d_model / n_heads dimensions); pick n_heads among the divisors of {self.d_model}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must lie in [0, 1), got {self.dropout!r}.")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size (``tiny``, ``small``, ``medium``, ``large``, ``xl``), optionally with fields changed."""
        if name not in GPT_PRESETS:
            raise ValueError(f"Unknown GPT size {name!r}. Choose one of: {', '.join(GPT_PRESETS)}.")
        return replace(GPT_PRESETS[name], **overrides)

    @classmethod
    def resolve(cls, spec: Union[GPTConfig, str, Mapping[str, Any]]) -> GPTConfig:
        """Accept a config, a preset name, or a plain mapping (as stored in checkpoint hyperparameters)."""
        if isinstance(spec, GPTConfig):
            return spec
        if isinstance(spec, str):
            return cls.preset(spec)
        if isinstance(spec, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(f"Unknown GPTConfig fields {unknown}; valid fields: {sorted(known)}.")
            return cls(**dict(spec))
        raise TypeError(f"Expected a GPTConfig, a preset name or a mapping of its fields, got {type(spec).__name__}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # ------------------------------------------------------------------ analytic sizes
    @property
    def num_block_params(self) -> int:
        """Parameters of one transformer block: 2 LayerNorms, qkv + output projection, MLP (all with bias)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        layer_norms = 2 * 2 * d
        attention = (d * 3 * d + 3 * d) + (d * d + d)
        mlp = (d * hidden + hidden) + (hidden * d + d)
        return layer_norms + attention + mlp

    @property
    def num_params(self) -> int:
        """All parameters, counting a tied embedding once."""
        embeddings = self.vocab_size * self.d_model + self.seq_len * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        final_norm = 2 * self.d_model
        return embeddings + self.n_layers * self.num_block_params + final_norm + head

    def model_spec(self, params: Optional[int] = None, name: str = "demo GPT") -> ModelSpec:
        """This shape as the planner's :class:`~lightning_mics.planner.ModelSpec` (memory and step-time
        model). ``params``: a measured count to use instead of :attr:`num_params`. The blocks compute
        attention with ``F.scaled_dot_product_attention``, a fused kernel that stores no scores."""
        return ModelSpec(
            params=self.num_params if params is None else params,
            layers=self.n_layers,
            hidden=self.d_model,
            seq_len=self.seq_len,
            heads=self.n_heads,
            vocab=self.vocab_size,
            flops_per_token=self.flops_per_token,
            name=name,
            fused_attention=True,
        )

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), the convention of the PaLM paper (App. B):
        ``6 * N_matmul + 12 * n_layers * d_model * seq_len``.

        ``N_matmul`` counts the weights that take part in matrix multiplies (the blocks' linear layers
        and the output head, not the embedding look-ups, biases or norms): each costs 2 FLOPs per
        token forward and 4 backward. The second term is attention's ``QK^T`` and ``AV`` products
        (no discount for the causal mask, like the paper). This is what MFU is measured against.
        """
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        block_matmul = d * 3 * d + d * d + 2 * d * hidden
        head_matmul = self.vocab_size * d
        return 6.0 * (self.n_layers * block_matmul + head_matmul) + 12.0 * self.n_layers * d * self.seq_len


#: Named sizes, from one that trains in minutes on CPU ranks to a 1.2-1.4B-parameter model
#: (GPT-3 "XL" shape: d_model 2048, 24 layers, 16 heads, 2048 tokens; ~1.21B parameters with the
#: 256-byte vocabulary, ~1.42B with GPT-2's 50,257-token vocabulary untied).
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "small": GPTConfig(seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    "medium": GPTConfig(seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "large": GPTConfig(seq_len=1024, d_model=1536, n_layers=24, n_heads=16),
    "xl": GPTConfig(seq_len=2048, d_model=2048, n_layers=24, n_heads=16),
}


# ---------------------------------------------------------------------------------- layers
#: GPT-2's initialisation: N(0, 0.02) for weights, residual projections scaled by 1/sqrt(2 * layers).
INIT_STD = 0.02


class NormalLinear(nn.Linear):
    """``nn.Linear`` initialised N(0, std) with zero bias; ``reset_parameters`` re-creates that init,
    which is what meta-device materialisation calls."""

    def __init__(self, in_features: int, out_features: int, std: float = INIT_STD, bias: bool = True) -> None:
        self.init_std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=getattr(self, "init_std", INIT_STD))
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02), GPT-2 style, also on re-initialisation."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        residual_std = INIT_STD / math.sqrt(2 * config.n_layers)
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = NormalLinear(config.d_model, 3 * config.d_model)
        self.proj = NormalLinear(config.d_model, config.d_model, std=residual_std)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (batch, heads, seq, head_dim), the layout SDPA expects.
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = NormalLinear(config.d_model, hidden)
        self.proj = NormalLinear(hidden, config.d_model, std=INIT_STD / math.sqrt(2 * config.n_layers))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x)))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final LayerNorm, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = NormalEmbedding(config.vocab_size, config.d_model)
        self.position_embedding = NormalEmbedding(config.seq_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        # Tied: the head reuses the embedding matrix (no module of its own, so nothing to shard twice).
        self.head = None if config.tie_embeddings else NormalLinear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for integer ``tokens`` of shape ``(batch, seq)``."""
        seq = tokens.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"Sequence of {seq} tokens is longer than the model's seq_len={self.config.seq_len}.")
        positions = torch.arange(seq, device=tokens.device)
        h = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            h = block(h)
        h = self.ln_final(h)
        if self.head is None:
            return F.linear(h, self.token_embedding.weight)
        return self.head(h)


# ---------------------------------------------------------------------------------- LightningModule
class GPTLightningModule(pl.LightningModule):
    """Next-token prediction with :class:`GPT`: AdamW, linear warm-up then cosine decay, validation
    loss and perplexity through torchmetrics.

    Args:
        config: a :class:`GPTConfig`, a preset name (``"tiny"``...) or a mapping of its fields.
        learning_rate: peak AdamW learning rate.
        weight_decay: applied to matrices only (not to biases, norms, embeddings' positions... 1-D params).
        betas: AdamW betas.
        warmup_steps: linear warm-up length in optimizer steps.
        min_lr_ratio: the cosine decays to ``learning_rate * min_lr_ratio`` at the last step.
    """

    def __init__(
        self,
        config: Union[GPTConfig, str] = "tiny",
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = GPTConfig.resolve(config)
        if learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        # Plain containers only: checkpoints are loaded with weights_only=True.
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = asdict(self.config)
        self.hparams["betas"] = list(betas)
        self.model = GPT(self.config)
        self.val_loss = MeanMetric()
        self.val_perplexity = Perplexity()

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token; read by :class:`~lightning_mics.telemetry.TrainingTelemetry` for MFU."""
        return self.config.flops_per_token

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss, logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch[0].shape[0])
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        loss, logits = self._loss(batch)
        self.val_loss.update(loss.detach(), weight=batch[1].numel())
        self.val_perplexity.update(logits.detach().float(), batch[1])
        log_kwargs = dict(on_step=False, on_epoch=True, batch_size=batch[0].shape[0])
        self.log(f"{stage}/loss", self.val_loss, prog_bar=True, **log_kwargs)
        self.log(f"{stage}/perplexity", self.val_perplexity, **log_kwargs)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
        )
        total_steps = self._total_steps()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> Optional[int]:
        try:
            steps = self.trainer.estimated_stepping_batches
        except (RuntimeError, AttributeError):  # no trainer attached (e.g. a bare module in a script)
            return None
        return int(steps) if math.isfinite(steps) else None


def warmup_cosine(step: int, warmup_steps: int, total_steps: Optional[int], min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine to ``min_ratio`` at ``total_steps``
    (constant after warm-up when the run length is unknown)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not total_steps or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
