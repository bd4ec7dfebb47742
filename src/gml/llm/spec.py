"""Capture a Hugging Face decoder-only causal LM as GML's own description: a :class:`ModelSpec`
(the math, read from the config) and :class:`LayerWeights` (the tensors, in one canonical layout).

One :class:`Family` per supported ``model_type``: a value holding how to read that family's weights.
Every family's layer is the same computation, with the config choosing the variants::

    h   = embed[ids] * embed_scale (+ wpe[pos] for learned positions)
    per layer:  a = attn_in_norm(h);  q, k, v = split(a @ Wqkv^T + bqkv)
                q, k = qk_norm(q), qk_norm(k)          (Qwen3, Gemma3)
                q, k = rope(q, pos), rope(k, pos)      (not GPT-2; partial rotary: Phi-3)
                o    = attention(q, K_cache, V_cache)  (causal, GQA, optional sliding window)
                h    = h + attn_out_norm(o @ Wo^T + bo)              (attn_out_norm: Gemma3 only)
                m    = mlp_in_norm(h)
                m    = act(m @ Wg^T) * (m @ Wu^T)  (gated)  |  act(m @ Wu^T + bu)  (GPT-2)
                h    = h + mlp_out_norm(m @ Wd^T + bd)               (mlp_out_norm: Gemma3 only)
    logits = softcap(final_norm(h) @ W_lm^T)

Norms are RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``; Gemma: ``* (1 + w)``) or LayerNorm (GPT-2).
Q/K/V and gate/up are merged into one matrix each at capture (one GEMV instead of three / two).
RoPE cos/sin tables come from the model's own rotary module (HF's definition of every rope type),
evaluated once for positions ``0..max_length-1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gml.errors import UnsupportedError


@dataclass(frozen=True)
class ModelSpec:
    """The facts of a decoder LM that GML's layers need (all read from the HF config)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    norm_plus_one: bool  # Gemma: x * (1 + w)
    activation: str  # "silu" | "gelu" | "gelu_tanh" | "relu"
    gated_mlp: bool
    attn_scale: float
    embed_scale: float
    rotary_dim: int  # 0: no RoPE (learned positions)
    learned_positions: bool
    qk_norm: bool
    sandwich_norms: bool  # Gemma3: norms after attention and after the MLP too
    sliding_windows: tuple[int | None, ...]  # per layer: window or None (full attention)
    final_logit_softcap: float | None
    max_positions: int | None  # learned position table size (GPT-2), else None


@dataclass
class Norm:
    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class Linear:
    """``y = x @ weight^T + bias``, ``weight: [out, in]``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass
class LayerWeights:
    attn_in_norm: Norm
    qkv: Linear
    o: Linear
    mlp_in_norm: Norm
    up: Linear  # gated: gate and up stacked ([2I, H], gate first); GPT-2: the up projection
    down: Linear
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    attn_out_norm: Norm | None = None
    mlp_out_norm: Norm | None = None


@dataclass
class CapturedLM:
    spec: ModelSpec
    embed: torch.Tensor  # [V, H]
    positions: torch.Tensor | None  # [P, H] learned (GPT-2)
    layers: list[LayerWeights]
    final_norm: Norm
    lm_head: Linear
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer type -> cos, sin


_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": None,
    "relu": "relu",
}
# Rope types whose frequencies depend on the current sequence length: one table for all positions would
# differ from HF's, so GML refuses them rather than give other numbers.
_SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")


def _t(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.detach().float().contiguous()


def _norm(m: nn.Module) -> Norm:
    return Norm(_t(m.weight), _t(getattr(m, "bias", None)))


def _linear(m: nn.Module) -> Linear:
    return Linear(_t(m.weight), _t(m.bias))


def _cat(parts: list[Linear]) -> Linear:
    weight = torch.cat([p.weight for p in parts])
    if all(p.bias is None for p in parts):
        return Linear(weight)
    biases = [p.bias if p.bias is not None else torch.zeros(p.weight.shape[0]) for p in parts]
    return Linear(weight, torch.cat(biases))


def _conv1d(m: nn.Module) -> Linear:
    """GPT-2's ``Conv1D`` stores ``weight`` as ``[in, out]``."""
    return Linear(_t(m.weight).t().contiguous(), _t(m.bias))


def _llama_layer(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):  # Phi-3
        qkv = _linear(attn.qkv_proj)
    else:
        qkv = _cat([_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)])
    up = (
        _linear(mlp.gate_up_proj)
        if hasattr(mlp, "gate_up_proj")
        else _cat([_linear(mlp.gate_proj), _linear(mlp.up_proj)])
    )
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    return LayerWeights(
        attn_in_norm=_norm(layer.input_layernorm),
        qkv=qkv,
        o=_linear(attn.o_proj),
        mlp_in_norm=_norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
        up=up,
        down=_linear(mlp.down_proj),
        q_norm=_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
        k_norm=_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
        attn_out_norm=_norm(layer.post_attention_layernorm) if sandwich else None,
        mlp_out_norm=_norm(layer.post_feedforward_layernorm) if sandwich else None,
    )


def _gpt2_layer(block: nn.Module) -> LayerWeights:
    return LayerWeights(
        attn_in_norm=_norm(block.ln_1),
        qkv=_conv1d(block.attn.c_attn),
        o=_conv1d(block.attn.c_proj),
        mlp_in_norm=_norm(block.ln_2),
        up=_conv1d(block.mlp.c_fc),
        down=_conv1d(block.mlp.c_proj),
    )


@dataclass(frozen=True)
class Family:
    """How to read one ``model_type``'s modules: the attribute names of its decoder body (on the
    model), and of the layer list, final norm and token embedding (on the body); ``layer`` reads one
    layer's weights."""

    body: str
    layers: str
    final_norm: str
    embed: str
    layer: Callable[[nn.Module], LayerWeights]


_LLAMA_LIKE = Family("model", "layers", "norm", "embed_tokens", _llama_layer)
_GPT2 = Family("transformer", "h", "ln_f", "wte", _gpt2_layer)

#: model_type -> Family. The families GML captures.
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    "phi3": _LLAMA_LIKE,
    "gpt2": _GPT2,
}


def _unsupported(what: str, hint: str) -> UnsupportedError:
    return UnsupportedError(what, hint)


def _activation(config) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if config.model_type == "gpt2":
        name = config.activation_function
    act = _ACTIVATIONS.get(name)
    if act is None:
        raise _unsupported(
            f"activation {name!r} of this {config.model_type} model is not one GML's LLM layers compute",
            f"use a model whose activation is one of {sorted(k for k, v in _ACTIVATIONS.items() if v)}",
        )
    return act


def _sliding_windows(config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if config.model_type == "mistral" and window is not None:
        return (window,) * n
    return (None,) * n


def _rope_parameters(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def _layer_types(config) -> list[str | None]:
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else [None] * config.num_hidden_layers


def _rope_tables(config, rotary: nn.Module, max_length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos, sin ``[max_length, rotary_dim]`` per layer type, from the model's own rotary module."""
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    tables = {}
    pos = torch.arange(max_length)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for lt in dict.fromkeys(_layer_types(config)):
        rope_type = _rope_parameters(config, lt).get("rope_type", "default")
        if rope_type in _SEQ_DEPENDENT_ROPE:
            raise _unsupported(
                f"rope type {rope_type!r} changes its frequencies with the sequence length; GML's KV cache "
                "keeps one RoPE table",
                f"use a checkpoint whose rope_type is not one of {_SEQ_DEPENDENT_ROPE}",
            )
        with torch.no_grad():
            cos, sin = rotary(x, pos, lt) if takes_type else rotary(x, pos)
        tables[lt or "full_attention"] = (cos[0].float().contiguous(), sin[0].float().contiguous())
    return tables


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def capture_lm(model: nn.Module, max_length: int) -> CapturedLM:
    """Read a HF ``*ForCausalLM`` module into a :class:`CapturedLM` (weights copied as fp32)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise _unsupported(
            f"gml.llm cannot capture a {model_type or type(model).__name__!r} model",
            f"give a decoder-only causal LM of a supported family: {', '.join(supported_families())}",
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise _unsupported("attention logit soft-capping (Gemma-2 style) is not supported", "use Gemma/Gemma-3")
    body = getattr(model, family.body)
    gpt2 = model_type == "gpt2"
    heads = config.num_attention_heads if not gpt2 else config.n_head
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = heads if gpt2 else (getattr(config, "num_key_value_heads", None) or heads)
    rotary_dim = 0
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if not gpt2:
        rope = _rope_tables(config, body.rotary_emb, max_length)
        rotary_dim = next(iter(rope.values()))[0].shape[-1]
    if gpt2 and (config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn):
        raise _unsupported("GPT-2's scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn options", "turn them off")
    if model_type == "gemma3_text":
        attn_scale = config.query_pre_attn_scalar**-0.5
        embed_scale = hidden**0.5
    else:
        attn_scale = head_dim**-0.5 if (not gpt2 or config.scale_attn_weights) else 1.0
        embed_scale = hidden**0.5 if model_type == "gemma" else 1.0
    layers_m = list(getattr(body, family.layers))
    layers = [family.layer(m) for m in layers_m]
    spec = ModelSpec(
        family=model_type,
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        num_layers=len(layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm="layer" if gpt2 else "rms",
        norm_eps=config.layer_norm_epsilon if gpt2 else config.rms_norm_eps,
        norm_plus_one=model_type in ("gemma", "gemma3_text"),
        activation=_activation(config),
        gated_mlp=not gpt2,
        attn_scale=attn_scale,
        embed_scale=embed_scale,
        rotary_dim=rotary_dim,
        learned_positions=gpt2,
        qk_norm=layers[0].q_norm is not None,
        sandwich_norms=layers[0].attn_out_norm is not None,
        sliding_windows=_sliding_windows(config),
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        max_positions=config.n_positions if gpt2 else None,
    )
    out_emb = model.get_output_embeddings()
    lm_head = Linear(_t(out_emb.weight), _t(getattr(out_emb, "bias", None)))
    return CapturedLM(
        spec=spec,
        embed=_t(getattr(body, family.embed).weight),
        positions=_t(body.wpe.weight) if gpt2 else None,
        layers=layers,
        final_norm=_norm(getattr(body, family.final_norm)),
        lm_head=lm_head,
        rope=rope,
    )
