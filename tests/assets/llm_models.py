"""Tiny random decoder LMs of the families gml.llm captures (shared by tests/llm and benchmarks)."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "phi3", "gpt2")
VOCAB = 128


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    """A random ``*ForCausalLM`` of ``family``, eager attention, fp32, eval mode; weights scaled up from
    HF's 0.02 init so the logits are not all near-tied."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(num_key_value_heads=2, **common)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(num_key_value_heads=1, **common)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
        cls = tf.Qwen3ForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=2, sliding_window=16, **common)
        cls = tf.MistralForCausalLM
    elif family == "gemma":
        cfg = tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **common)
        cls = tf.GemmaForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
            **common,
        )
        cls = tf.Gemma3ForCausalLM
    elif family == "phi3":
        cfg = tf.Phi3Config(num_key_value_heads=2, **common)
        cls = tf.Phi3ForCausalLM
    elif family == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
        )
        cls = tf.GPT2LMHeadModel
    else:
        raise KeyError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(5.0)
            elif p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """HF eager fp32 greedy decoding without a cache (the whole prefix recomputed per token)."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(new):
            tok = model(ids, use_cache=False).logits[0, -1].argmax()
            out.append(int(tok))
            ids = torch.cat([ids, tok.view(1, 1)], dim=1)
    return out
