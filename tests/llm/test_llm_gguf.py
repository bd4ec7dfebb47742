""".gguf sources: tiny random Llama / Gemma 3 written with the gguf package's writer, read by gml.llm through
transformers' GGUF loader, logits against HF eager on the same weights; the load errors."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch

import gml
from assets.llm_models import tiny
from gml.errors import InputError, ModelLoadError, UnsupportedError

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")
from assets.gguf_models import roundtrip_weights, write_gguf  # noqa: E402  (needs gguf)

PROMPT = list(range(3, 23))  # 20 positions: past the Gemma 3 model's sliding window of 8


def tiny_gemma3() -> torch.nn.Module:
    """6 layers, so Gemma 3's default 5 local : 1 global pattern has a global layer. A GGUF does not store
    ``query_pre_attn_scalar``, the local RoPE base or the layer pattern: the model keeps HF's defaults."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # as tests/assets/llm_models.tiny: logits not near-tied
        for p in model.parameters():
            p.mul_(5.0) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
    return model


MODELS = {"llama": lambda: tiny("llama"), "gemma3": tiny_gemma3}


def _hf_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT]), use_cache=False).logits[0]


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_logits_match_hf(tmp_path, family, qtype):
    # Q8_0: the reference is HF on the same weights quantized and dequantized by the gguf package.
    model = MODELS[family]()
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path, qtype)
    ref = _hf_logits(model if qtype == "F32" else roundtrip_weights(copy.deepcopy(model), qtype))
    lm = gml.llm(str(path), max_length=32)
    assert lm.tokenizer is None  # GGUF sources take token ids
    got = lm.logits(PROMPT)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_gguf_int8_weights_and_greedy(tmp_path):
    model = tiny("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path)
    from_gguf = gml.llm(path, max_length=48, weights="int8")  # an os.PathLike works too
    from_module = gml.llm(model, max_length=48, weights="int8")
    assert from_gguf.generate(PROMPT, 16) == from_module.generate(PROMPT, 16)


def test_generate_cli_on_gguf(tmp_path, capsys):
    from gml.cli import main

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny("llama"), path)
    want = gml.llm(str(path), max_length=16).generate([5, 17, 3], 4)
    assert main(["generate", str(path), "--prompt-ids", "5,17,3", "--max-new-tokens", "4"]) == 0
    assert " ".join(map(str, want)) in capsys.readouterr().out
    # This GGUF has no tokenizer.ggml.* vocabulary: --prompt cannot be tokenized.
    assert main(["generate", str(path), "--prompt", "hello", "--max-new-tokens", "4"]) == InputError.exit_code
    assert "no tokenizer, so --prompt cannot be tokenized" in capsys.readouterr().out


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("not a model")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        gml.llm(str(path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        gml.llm(str(tmp_path / "missing.gguf"))


def test_gguf_package_missing_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny("llama"), path)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ModelLoadError, match=r"(?s)needs the package\(s\) gguf.*gml-lab\[llm\]"):
        gml.llm(str(path))


def _write_raw(path, arch: str, tensors: dict) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_architecture_transformers_cannot_read(tmp_path):
    path = tmp_path / "rwkv.gguf"
    _write_raw(path, "rwkv6", {"token_embd.weight": (torch.zeros(8, 4).numpy(), None)})
    with pytest.raises(UnsupportedError, match=r"(?s)'rwkv6' model.*reads only.*gemma3.*llama"):
        gml.llm(str(path))


def test_tensor_type_gguf_cannot_dequantize(tmp_path):
    # Q8_K (llama.cpp's activation format for K-quants) has no dequantizer in the gguf package.
    import numpy as np

    q8k = gguf.GGMLQuantizationType.Q8_K
    block, nbytes = gguf.GGML_QUANT_SIZES[q8k]
    path = tmp_path / "q8k.gguf"
    _write_raw(
        path,
        "llama",
        {
            "token_embd.weight": (np.zeros((4, nbytes), dtype=np.uint8), q8k),  # 4 rows of `block` values
            "output_norm.weight": (np.ones(block, dtype=np.float32), None),
        },
    )
    with pytest.raises(UnsupportedError, match=r"(?s)type Q8_K \(e\.g\. token_embd\.weight\).*requantize"):
        gml.llm(str(path))


def test_gguf_missing_a_tensor(tmp_path):
    # transformers would keep the missing matrix's random init; gml.llm refuses instead.
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny("llama"), path, drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"does not provide 1 of the model's parameters \(e\.g\. model\.layers\.1"):
        gml.llm(str(path))


def test_int4_symmetric_is_q4_0_or_better():
    # Against the gguf package's Q4_0 quantizer (an independent copy of ggml's), ties included — half
    # the weights sit exactly between two levels, as in a Q4_K GGUF requantized: where GML keeps Q4_0's
    # scale its levels are Q4_0's, bit for bit; every group's squared error is at most Q4_0's.
    from gml.ir.llm_ops import dequantize_weight, integer_weight, quantize_weight

    torch.manual_seed(3)
    n, k = 8, 256
    grid = torch.randint(-15, 16, (n, k)).float() / 2  # ±7.5 in half steps: ties for a scale of 1
    grid[:, ::32] = -8.0  # each block's extreme: Q4_0's scale is exactly 1
    grid[:2, 1::32] = 7.5  # in rows 0-1 Q4_0 clips a value (to 7)
    w = grid * torch.rand(n, 1).add(0.5)  # a scale per row
    qw = quantize_weight(w, 4, 32)
    ours = integer_weight(qw.qweight, None, 4, 32).reshape(n, k // 32, 32)
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(n, k // 32, 18)
    nibbles = blocks[..., 2:]
    theirs = torch.from_numpy(np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).astype(np.int32) - 8)
    s_q4_0 = w.reshape(n, k // 32, 32)[..., 0] / -8  # the extreme, on -8 (fp32, not the file's fp16)
    kept = qw.scales == s_q4_0
    assert kept.any() and not kept.all()  # both choices are exercised
    assert torch.equal(ours[kept], theirs[kept])
    err = (dequantize_weight(*qw) - w).reshape(n, k // 32, 32).square().sum(-1)
    err_q4_0 = (theirs * s_q4_0[..., None] - w.reshape(n, k // 32, 32)).square().sum(-1)
    assert (err <= err_q4_0).all() and (err[~kept] < err_q4_0[~kept]).all()


def test_q4_0_gguf_to_int4_keeps_its_weights(tmp_path):
    # A Q4_0 file read with weights="int4" is requantized without loss: each block's extreme is already
    # at -8 steps, so the scale and every level come back — the logits equal the fp32 read of the file.
    model = tiny("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path, "Q4_0")
    ref = gml.llm(str(path), max_length=32).logits(PROMPT)
    int4 = dict(weights="int4", lm_head_weights="int4", embed_weights="int4", kv_cache="fp32")  # fp32: as `ref`
    got = gml.llm(str(path), max_length=32, **int4).logits(PROMPT)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
