"""Write a tiny HF Llama / Gemma 3 to a .gguf the way llama.cpp's converter lays it out (tests/llm).

Only the ``gguf`` package's writer is used: metadata keys through ``GGUFWriter.add_*``, tensor names
from ``gguf.get_tensor_name_map`` (the table llama.cpp's ``convert_hf_to_gguf.py`` uses), and the two
conversions the converter applies and transformers' loader undoes: Llama's Q/K rows permuted from HF's
rotate-half order to GGML's interleaved pairs, Gemma's RMSNorm weights stored as ``1 + w``.
"""

from __future__ import annotations

import numpy as np
import torch

GGUF_ARCH = {"llama": "LLAMA", "gemma3_text": "GEMMA3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.permute``: per head, rows ``[x0..x_{d/2}, y0..]`` -> ``[x0, y0, x1, y1, ..]``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, path, qtype: str = "F32", drop: str | None = None) -> None:
    """Write ``model`` (a tiny ``LlamaForCausalLM`` / ``Gemma3ForCausalLM``) to ``path``.

    ``qtype``: ``F32`` | ``F16`` | ``Q8_0`` | ``Q4_0`` for the 2-D matrices (norms stay F32, as llama.cpp keeps them).
    ``drop``: a GGUF tensor name to leave out (a broken file).
    """
    import gguf

    cfg = model.config
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[cfg.model_type])
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.model_type == "llama":
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for hf_name, t in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if (base == "lm_head" and cfg.tie_word_embeddings) or f"{name}.{suffix}" == drop:
            continue  # tied: no output.weight, the embedding is the head
        data = t.detach().float().numpy()
        if cfg.model_type == "llama" and name.endswith("attn_q"):
            data = _permute(data, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and name.endswith("attn_k"):
            data = _permute(data, cfg.num_key_value_heads)
        elif cfg.model_type == "gemma3_text" and base.endswith("norm"):
            data = data + 1.0
        if data.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{name}.{suffix}", gguf.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(f"{name}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def roundtrip_weights(model: torch.nn.Module, qtype: str) -> torch.nn.Module:
    """``model`` with every 2-D weight replaced by ``dequantize(quantize(w, qtype))`` (in place)."""
    import gguf

    quant = getattr(gguf.GGMLQuantizationType, qtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                q = gguf.quantize(p.detach().numpy(), quant)
                p.copy_(torch.from_numpy(gguf.dequantize(q, quant).reshape(p.shape).copy()))
    return model
