"""The models the planner knows: published transformer shapes, a local Hugging Face ``config.json``, presets.

The planner needs a model's *shape*, not only its parameter count: the layers set the number of FSDP units
(the latency paid per collective, the prefetch buffers), the hidden size, heads and MLP width set the
activation memory, and the sequence length the attention FLOPs. A shape that is guessed from a count alone
("33 layers x 4224") plans a model nobody trains, so the CLI takes the shape from a preset written from a
published ``config.json`` (:data:`MODEL_SHAPES`), from a local ``config.json`` (:func:`read_hf_config`; no
network), or from flags that give it in full.

:class:`TransformerShape` holds what such a config says and derives the parameter count from it
(:attr:`TransformerShape.params`): the figures below reproduce the counts the models' cards state (e.g.
Llama-3 8B: 8,030,261,248; GPT-2: 124,439,808), which ``tests/test_planner_presets.py`` checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mics.planner.specs import PAPER_MODELS, ModelSpec

#: The sequence length a plan assumes unless told (``--seq-len``), capped at the model's positions: the
#: training sequence is a choice of the run, not of the model, and 2,048 is what the live planner assumes too.
DEFAULT_SEQ_LEN = 2048


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer as its Hugging Face ``config.json`` describes it.

    Two block families are modelled: ``gated_mlp=True`` is the Llama / Mistral block (RMSNorm, a SwiGLU MLP of
    three ``hidden x intermediate`` matrices, grouped-query attention with ``kv_heads`` key/value heads, no
    biases unless the config asks for them); ``gated_mlp=False`` is GPT-2's (LayerNorm with biases, a GELU MLP
    of two matrices, biases on every linear layer, learned position embeddings).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    gated_mlp: bool = True
    #: the output head shares the input embedding's matrix (GPT-2), or has its own (Llama)
    tied_embeddings: bool = False
    #: a ``max_positions x hidden`` table of learned position embeddings (GPT-2); rotary models have none
    learned_positions: bool = False
    qkv_bias: bool = False  #: biases on the query, key and value projections
    out_bias: bool = False  #: a bias on the attention's output projection
    mlp_bias: bool = False  #: biases on the MLP's projections
    norm_bias: bool = False  #: LayerNorm (weight and bias) rather than RMSNorm (weight only)
    #: per attention head; ``None``: ``hidden / heads`` (configs that set it otherwise say ``head_dim``)
    head_dim: Optional[int] = None
    #: where the numbers come from (a Hugging Face repository's ``config.json``, or a local file)
    source: str = ""

    def __post_init__(self) -> None:
        for field_name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "max_positions"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field_name} must be a positive int, got {value!r}.")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.name}: {self.heads} attention heads cannot share {self.kv_heads} key/value heads evenly "
                "(grouped-query attention needs kv_heads to divide heads)."
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"{self.name}: hidden size {self.hidden} is not a multiple of {self.heads} heads; give head_dim."
            )

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        """One block's parameters: attention, MLP and the two norms."""
        h, q_dim = self.hidden, self.heads * self.attention_head_dim
        kv_dim = self.kv_heads * self.attention_head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        attention += (q_dim + 2 * kv_dim if self.qkv_bias else 0) + (h if self.out_bias else 0)
        matrices = 3 if self.gated_mlp else 2
        mlp = matrices * h * self.intermediate
        mlp += ((matrices - 1) * self.intermediate + h) if self.mlp_bias else 0
        norms = 2 * h * (2 if self.norm_bias else 1)
        return attention + mlp + norms

    @property
    def params(self) -> int:
        """Every parameter: the blocks, the final norm, the embeddings (and positions), the output head."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        positions = self.max_positions * self.hidden if self.learned_positions else 0
        final_norm = self.hidden * (2 if self.norm_bias else 1)
        return self.layers * self.params_per_layer + embeddings + positions + final_norm

    def model_spec(self, seq_len: Optional[int] = None, fused_attention: bool = True) -> ModelSpec:
        """The planner's :class:`ModelSpec` of this model at ``seq_len`` tokens per sequence (default:
        :data:`DEFAULT_SEQ_LEN`, at most :attr:`max_positions`).

        ``fused_attention``: the attention runs in a fused kernel (``F.scaled_dot_product_attention``,
        FlashAttention -- Hugging Face's default for these models), so no ``s x s`` scores are stored.

        Raises:
            ValueError: for a sequence longer than the model's positions.
        """
        if seq_len is None:
            seq_len = min(DEFAULT_SEQ_LEN, self.max_positions)
        if seq_len > self.max_positions:
            raise ValueError(
                f"--seq-len {seq_len} is longer than {self.name}'s {self.max_positions} positions "
                f"(max_position_embeddings of {self.source or 'its config'}). Plan a sequence of at most "
                f"{self.max_positions}, or, for a context-extended model, its own config.json with --hf-config."
            )
        return ModelSpec(
            params=self.params,
            layers=self.layers,
            hidden=self.hidden,
            seq_len=seq_len,
            heads=self.heads,
            vocab=self.vocab,
            name=self.name,
            fused_attention=fused_attention,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
            gated_mlp=self.gated_mlp,
            max_positions=self.max_positions,
        )


def _llama(name: str, source: str, **shape: int) -> TransformerShape:
    return TransformerShape(name=name, source=source, gated_mlp=True, **shape)


def _gpt2(name: str, source: str, hidden: int, layers: int, heads: int) -> TransformerShape:
    # GPT-2's config.json: n_embd, n_layer, n_head; n_inner null (= 4 n_embd), n_positions 1024, vocab 50257,
    # gelu_new MLP, LayerNorm and biases everywhere, tied output head, learned positions.
    return TransformerShape(
        name=name,
        source=source,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=heads,
        intermediate=4 * hidden,
        vocab=50257,
        max_positions=1024,
        gated_mlp=False,
        tied_embeddings=True,
        learned_positions=True,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        norm_bias=True,
    )


#: Published shapes, copied from each model's ``config.json`` on the Hugging Face Hub (the repository named in
#: ``source``): hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
#: vocab_size, max_position_embeddings (GPT-2: n_embd, n_layer, n_head, n_positions).
MODEL_SHAPES: dict[str, TransformerShape] = {
    shape.name: shape
    for shape in (
        # meta-llama/Meta-Llama-3-8B/config.json
        _llama("llama-3-8b", "meta-llama/Meta-Llama-3-8B", hidden=4096, layers=32, heads=32, kv_heads=8,
               intermediate=14336, vocab=128256, max_positions=8192),
        # meta-llama/Meta-Llama-3-70B/config.json
        _llama("llama-3-70b", "meta-llama/Meta-Llama-3-70B", hidden=8192, layers=80, heads=64, kv_heads=8,
               intermediate=28672, vocab=128256, max_positions=8192),
        # meta-llama/Llama-2-7b-hf/config.json
        _llama("llama-2-7b", "meta-llama/Llama-2-7b-hf", hidden=4096, layers=32, heads=32, kv_heads=32,
               intermediate=11008, vocab=32000, max_positions=4096),
        # meta-llama/Llama-2-13b-hf/config.json
        _llama("llama-2-13b", "meta-llama/Llama-2-13b-hf", hidden=5120, layers=40, heads=40, kv_heads=40,
               intermediate=13824, vocab=32000, max_positions=4096),
        # meta-llama/Llama-2-70b-hf/config.json
        _llama("llama-2-70b", "meta-llama/Llama-2-70b-hf", hidden=8192, layers=80, heads=64, kv_heads=8,
               intermediate=28672, vocab=32000, max_positions=4096),
        # mistralai/Mistral-7B-v0.1/config.json (sliding_window 4096 is not modelled: attention is fused)
        _llama("mistral-7b", "mistralai/Mistral-7B-v0.1", hidden=4096, layers=32, heads=32, kv_heads=8,
               intermediate=14336, vocab=32000, max_positions=32768),
        # openai-community/gpt2, gpt2-medium, gpt2-large, gpt2-xl: config.json
        _gpt2("gpt2", "openai-community/gpt2", hidden=768, layers=12, heads=12),
        _gpt2("gpt2-medium", "openai-community/gpt2-medium", hidden=1024, layers=24, heads=16),
        _gpt2("gpt2-large", "openai-community/gpt2-large", hidden=1280, layers=36, heads=20),
        _gpt2("gpt2-xl", "openai-community/gpt2-xl", hidden=1600, layers=48, heads=25),
    )
}

#: Every named model: the published shapes above (at :data:`DEFAULT_SEQ_LEN` tokens, fused attention) and the
#: papers' experiments (:data:`~lightning_mics.planner.specs.PAPER_MODELS`: BERT-10B and the GPT-3 family).
MODEL_PRESETS: dict[str, ModelSpec] = {
    **{name: shape.model_spec() for name, shape in MODEL_SHAPES.items()},
    **PAPER_MODELS,
}

# ---------------------------------------------------------------------------------------------- config.json

#: ``model_type`` values read as the Llama block (:class:`TransformerShape` with ``gated_mlp=True``), with the
#: ``tie_word_embeddings`` default of their Hugging Face config class when the file leaves it out
_LLAMA_STYLE_TIED_DEFAULT: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": False}
#: keys of mixture-of-experts configs: every token uses only some experts, which the cost model does not price
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_SUPPORTED = ", ".join([*_LLAMA_STYLE_TIED_DEFAULT, "gpt2"])


def read_hf_config(path: Union[str, Path], name: Optional[str] = None) -> TransformerShape:
    """The shape a local Hugging Face ``config.json`` describes (a file, or a model folder holding one).
    Nothing is downloaded: point it at a checkpoint's folder or a saved config.

    Raises:
        ValueError: for a file that is not a config of a supported decoder, naming what it lacks.
        OSError: when the file cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"--hf-config {path} is not JSON ({error}); pass a model's config.json.") from None
    if not isinstance(config, Mapping):
        raise ValueError(f"--hf-config {path} holds a {type(config).__name__}, not a config.json object.")
    return shape_from_hf_config(config, name or _config_name(config, path), source=str(path))


def _config_name(config: Mapping[str, Any], path: Path) -> str:
    """A readable name: the config's ``_name_or_path`` when it records one, else its folder's name."""
    recorded = config.get("_name_or_path")
    if isinstance(recorded, str) and recorded:
        return recorded.rstrip("/").split("/")[-1]
    return path.resolve().parent.name or str(path)


def shape_from_hf_config(config: Mapping[str, Any], name: str, source: str = "config.json") -> TransformerShape:
    """:func:`read_hf_config` on an already loaded ``config.json`` dict.

    Raises:
        ValueError: for a model type the planner does not model (its ``model_type`` and the supported ones
            named), a mixture-of-experts or multimodal config, or a missing key.
    """
    model_type = config.get("model_type")
    experts = [key for key in _EXPERT_KEYS if config.get(key)]
    if experts:
        raise ValueError(
            f"{source} describes a mixture-of-experts model ({experts[0]}={config[experts[0]]!r}): the planner prices "
            "every parameter as used by every token, which overstates such a model's FLOPs. Give the shape with "
            "--params --layers --hidden --seq-len instead."
        )
    if "text_config" in config and "hidden_size" not in config:
        raise ValueError(
            f"{source} describes a multimodal model (its language model is under text_config): save that part "
            "as a config.json of its own and pass it to --hf-config."
        )
    if model_type == "gpt2":
        return _gpt2_from_config(config, name, source)
    if model_type in _LLAMA_STYLE_TIED_DEFAULT:
        return _llama_from_config(config, name, source, _LLAMA_STYLE_TIED_DEFAULT[model_type])
    raise ValueError(
        f"{source}: model_type {model_type!r} is not one the planner reads (it reads {_SUPPORTED}). For another "
        "model give its shape with --params --layers --hidden --heads --seq-len."
    )


def _required(config: Mapping[str, Any], source: str, *keys: str) -> dict[str, int]:
    missing = [key for key in keys if not isinstance(config.get(key), int)]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)} (integers a {config.get('model_type')} config has).")
    return {key: int(config[key]) for key in keys}


def _llama_from_config(config: Mapping[str, Any], name: str, source: str, tied_default: bool) -> TransformerShape:
    values = _required(
        config,
        source,
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    )
    heads = values["num_attention_heads"]
    attention_bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
    return TransformerShape(
        name=name,
        source=source,
        hidden=values["hidden_size"],
        layers=values["num_hidden_layers"],
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate=values["intermediate_size"],
        vocab=values["vocab_size"],
        max_positions=values["max_position_embeddings"],
        gated_mlp=True,
        tied_embeddings=bool(config.get("tie_word_embeddings", tied_default)),
        qkv_bias=attention_bias,
        # Qwen2 puts biases on q, k and v only; Llama's attention_bias covers the output projection too
        out_bias=attention_bias and config.get("model_type") != "qwen2",
        mlp_bias=bool(config.get("mlp_bias", False)),
        head_dim=config.get("head_dim") if isinstance(config.get("head_dim"), int) else None,
    )


def _gpt2_from_config(config: Mapping[str, Any], name: str, source: str) -> TransformerShape:
    values = _required(config, source, "n_embd", "n_layer", "n_head", "vocab_size")
    positions = config.get("n_positions", config.get("n_ctx"))
    if not isinstance(positions, int):
        raise ValueError(f"{source} lacks n_positions (an integer a gpt2 config has).")
    hidden = values["n_embd"]
    inner = config.get("n_inner")
    return replace(
        _gpt2(name, source, hidden=hidden, layers=values["n_layer"], heads=values["n_head"]),
        intermediate=int(inner) if isinstance(inner, int) else 4 * hidden,
        vocab=values["vocab_size"],
        max_positions=positions,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def nearest_presets(params: int, count: int = 2) -> list[str]:
    """The published shapes closest to ``params`` parameters (by ratio), for a refusal that names them."""
    ranked = sorted(MODEL_SHAPES.values(), key=lambda shape: abs(math.log(shape.params / params)))
    return [f"{shape.name} ({shape.params / 1e9:.2f}B)" for shape in ranked[:count]]
