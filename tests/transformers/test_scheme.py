"""#15: the transformer INT8 scheme as the default of ``gml.quantize`` / ``gml bench``, its
accuracy-driven fallback and SmoothQuant, calibration on varied token ids, and the tooling bugs of
the issue (``--leaf``, eval-mode capture, ``ModelOutput`` from a leaf, opaque blocks in coverage)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import fx, nn

import gml
from gml.capture import capture
from gml.cli import main
from gml.errors import InputError
from gml.quant.calibrate import describe_generated, generate_batches
from gml.quant.transformer import DynamicQuantLinear, quantize_transformer, transformer_reason

transformers = pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 1000}  # fmt: skip


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**SMALL)).eval()


def _tokens(batch: int = 2, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 1000, (batch, seq), generator=torch.Generator().manual_seed(seq))
    return ids, torch.ones(batch, seq, dtype=torch.long)


class _Encoder(nn.Module):
    """A torch.nn transformer with a projection in and out (not a transformers model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x)))


# --- 1. the scheme is the default of the Python API ------------------------------------------------


def test_quantize_api_picks_the_transformer_scheme_for_a_transformer() -> None:
    model, inputs = _bert(), _tokens()
    res = gml.quantize(model, 2, example_inputs=inputs)
    assert res.scheme == "transformer"
    assert "it is a transformers BertModel" in res.scheme_reason and "0.881" in res.scheme_reason
    gemms = [p for p in res.precisions if p.op.startswith("linear")]
    assert len(gemms) == 9 and all(p.precision == "int8" for p in gemms)  # 2 x (QKV, out, 2 MLP) + pooler
    kinds = {p.op for p in res.precisions if p.precision == "fp32"}
    assert {"layernorm", "attention (q·kᵀ, softmax, p·v)"} <= kinds
    assert res.coverage.counts() == {"dynamic_linear": 9}
    from gml.ir import library

    in_graph = [library.gml_op_name(n) for n in res.module.graph.nodes]
    assert in_graph.count("dynamic_linear") == 9  # the report describes the module returned
    assert res.accuracy.cosine > 0.999 and res.accuracy.layers  # per-layer SQNR, paired by node name
    from gml.runtime import unavailable_reason

    if unavailable_reason() is None:  # the native engine runs every gml.dynamic_linear (ADR 008)
        assert res.engine is not None, str(res.runtime)
        assert res.executable is res.engine and res.runtime.path == "mixed", str(res.runtime)
        ops = {n.op for n in res.runtime.nodes if n.runs_in == "engine"}
        assert "dynamic_linear" in ops
        assert sum(n.op == "dynamic_linear" and n.runs_in == "engine" for n in res.runtime.nodes) == 9
    with torch.no_grad():
        got, ref = res.module(*inputs), model(*inputs)
        via = res.executable(*inputs)
    assert type(got) is type(ref) and type(via) is type(ref)  # the ModelOutput, as the model returns it
    for key in ("last_hidden_state", "pooler_output"):  # the pooler reads hidden[:, 0], a view with gaps
        torch.testing.assert_close(via[key], got[key], rtol=0, atol=1e-5)


def test_transformer_int8_saves_and_loads_pickle_free(tmp_path) -> None:
    """The INT8 transformer is a graph of gml.dynamic_linear calls with int8 constants: it exports
    (no pickle), loads without transformers' source, onto the engine, for other batch / sequence
    lengths, with the same numbers; a padded batch too."""
    from gml.archive import looks_pickled
    from gml.io import load

    model = _bert()
    ids, mask = _tokens(2, 16)
    mask[1, 11:] = 0  # a padded sentence
    res = gml.quantize(model, 2, example_inputs=(ids, mask), per_layer=False)
    path = tmp_path / "bert-int8.pt2"
    res.save(str(path))
    assert not looks_pickled(path)
    loaded = load(path)  # trust_pickle stays False: nothing in the file is unpickled
    gemms = [n for n in loaded.runtime.nodes if n.op == "dynamic_linear"]
    assert len(gemms) == 9, str(loaded.runtime)
    from gml.runtime import unavailable_reason

    if unavailable_reason() is None:
        assert all(n.runs_in == "engine" for n in gemms), str(loaded.runtime)
    for batch, seq in ((2, 16), (1, 7), (3, 23)):
        x = _tokens(batch, seq) if seq != 16 else (ids, mask)
        with torch.no_grad():
            want, got = res.module(*x), loaded(*x)
        for key in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)


def test_quantize_api_keeps_the_static_scheme_elsewhere_and_validates_the_choice() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    res = gml.quantize(model, 2, example_inputs=(torch.randn(4, 8),))
    assert res.scheme == "static" and "no transformer layers" in res.scheme_reason
    assert transformer_reason(_Encoder().eval()) == "it holds torch.nn.TransformerEncoder ('enc')"
    with pytest.raises(InputError, match="unknown INT8 scheme 'dynamic'"):
        gml.quantize(model, 2, example_inputs=(torch.randn(4, 8),), scheme="dynamic")


def test_bench_int8_variant_takes_the_transformer_scheme(tmp_path) -> None:
    from gml.bench.variants import BuildContext, build_gml_int8

    model, inputs = _bert(), _tokens(1, 16)
    ctx = BuildContext(model, inputs, [_tokens(1, 16)], threads=1, workdir=tmp_path)
    built = build_gml_int8(ctx)
    assert any(n.startswith("scheme: transformer (transformer scheme: 9/9 GEMMs INT8") for n in built.notes)
    with torch.no_grad():
        out = built.output(built.run(built.native(inputs)))
    ref = model(*inputs).last_hidden_state
    assert torch.nn.functional.cosine_similarity(out.last_hidden_state.flatten(), ref.flatten(), 0) > 0.999


# --- 2. tooling bugs of #15 ------------------------------------------------------------------------


def test_generated_calibration_draws_varied_token_ids_and_says_so() -> None:
    ids, mask = _tokens(2, 12)
    mask[1, 8:] = 0
    batches = generate_batches((ids, mask), 3, token_range=(1, 99))
    assert len({tuple(b[0].flatten().tolist()) for b in batches}) == 3  # not 3 copies of one batch
    assert all(int(b[0].min()) >= 1 and int(b[0].max()) <= 99 for b in batches)
    assert all(b[1] is mask for b in batches)  # a 0/1 mask is repeated as given
    label = describe_generated((ids, mask), (1, 99))
    assert "random integer ids uniform in [1, 99] (the model's vocabulary" in label
    assert "input 1: the example's mask, repeated" in label and "N(0" not in label
    # without a vocabulary: the example's own range, said so
    assert "[3, 40] (the example's own range" in describe_generated((torch.tensor([[3, 40, 7]]),))


def test_static_quantize_of_a_token_id_model_calibrates_on_varied_ids() -> None:
    class Bag(nn.Module):  # no attention: the static scheme
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.fc = nn.Linear(16, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(ids).mean(1))

    ids = torch.full((2, 6), 7)
    ids[0, 0] = 30
    res = gml.quantize(Bag().eval(), 8, example_inputs=(ids,))
    assert res.scheme == "static"
    source = res.frontend.calibration.source
    assert "random integer ids uniform in [7, 30] (the example's own range" in source and "N(0" not in source


def test_quantize_leaf_is_honoured_and_opaque_blocks_are_listed(tmp_path, capsys, monkeypatch) -> None:
    x = (torch.randn(2, 10, 8),)
    res = gml.quantize(_Encoder().eval(), 2, example_inputs=x, leaf_modules=["enc"])
    rows = {p.node: p for p in res.precisions}
    assert rows["enc"].op == "opaque block (TransformerEncoder)" and rows["enc"].precision == "fp32"
    assert "its 6 GEMM(s) stay fp32" in rows["enc"].why  # 2 layers x (in_proj, out_proj, 2 MLP) ... as eager
    assert [rows["inp"].precision, rows["out"].precision] == ["int8", "int8"]
    static = gml.quantize(_Encoder().eval(), 2, example_inputs=x, leaf_modules=["enc"], scheme="static")
    assert [(e.nodes, e.op) for e in static.coverage.kept_fp32] == [(["enc"], "TransformerEncoder")]
    # the CLI passes --leaf through, and prints the opaque block in the precision table
    monkeypatch.setenv("COLUMNS", "200")
    src = tmp_path / "enc_model.py"
    src.write_text(
        "from torch import nn\n\n\nclass M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.inp = nn.Linear(8, 32)\n"
        "        self.enc = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)\n"
        "        self.out = nn.Linear(32, 4)\n\n"
        "    def forward(self, x):\n"
        "        return self.out(self.enc(self.inp(x)))\n"
    )
    code = main(["quantize", f"{src}:M", "--input-shape", "2x10x8", "--leaf", "enc", "--no-time", "--calib", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "opaque block (TransformerEncoderLayer)" in out and "kept opaque (a leaf)" in out


def test_capture_returns_an_eval_graph_that_optimize_and_quantize_take() -> None:
    model, inputs = _bert(), _tokens()
    gm = capture(model, inputs)  # the torch.export path
    assert not gm.training and not any(m.training for m in gm.modules())
    assert gml.optimize(gm, inputs, n_check_inputs=1).max_abs_err < 1e-4
    assert gml.quantize(gm, 1, example_inputs=inputs).scheme == "transformer"  # the graph holds gml.attention
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    gm2 = capture(seq, (torch.randn(2, 4),))  # the torch.fx path
    assert not gm2.training
    gml.quantize(gm2, 2, example_inputs=(torch.randn(2, 4),))


def test_a_leaf_returning_a_model_output_keeps_its_attributes() -> None:
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = _bert()
            self.head = nn.Linear(64, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.bert(ids).last_hidden_state[:, 0])

    model, (ids, _) = Classifier().eval(), _tokens()
    gm = capture(model, (ids,), leaf_modules=["bert"])  # was: "Example inputs do not fit" (a dict)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["bert", "head"]
    with torch.no_grad():
        assert torch.equal(gm(ids), model(ids))


def test_an_int_input_that_does_not_fit_is_not_blamed_on_its_dtype() -> None:
    with pytest.raises(InputError) as info:
        capture(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).eval(), (torch.full((2, 3), 12),))
    assert "convert the input" not in (info.value.hint or "")


# --- 3. accuracy-driven fallback and SmoothQuant ---------------------------------------------------


class _Outlier(nn.Module):
    """fc1 writes one channel ~200x larger than the rest in every token (an LLM-style outlier
    channel) whose weight in fc2 is small: fc2's per-token INT8 scale is set by that channel and
    every other channel rounds to a few levels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.fc1.weight[5] *= 200.0
            self.fc1.bias[5] = 300.0
            self.fc2.weight[:, 5] *= 0.005

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(self.fc1(x))))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0))


def test_fallback_keeps_the_outlier_gemm_fp32_and_smoothquant_recovers_it() -> None:
    model = _Outlier().eval()
    x = (torch.randn(2, 24, 32),)
    calib = [(torch.randn(2, 24, 32),) for _ in range(3)]
    held = torch.randn(4, 24, 32)
    with torch.no_grad():
        ref = model(held)

    forced = quantize_transformer(model, x, calib_data=calib, min_sqnr_db=None)
    rows = {p.node: p for p in forced.precisions}
    sq_fc2 = float(rows["fc2"].why.split("SQNR ")[1].split(" dB")[0])
    sq_fc1 = float(rows["fc1"].why.split("SQNR ")[1].split(" dB")[0])
    assert sq_fc2 < 20 < sq_fc1  # the outlier channel costs fc2 its accuracy

    kept = quantize_transformer(model, x, calib_data=calib)  # default min_sqnr_db=20
    rows = {p.node: p for p in kept.precisions}
    assert rows["fc2"].precision == "fp32" and "accuracy fallback: INT8 SQNR" in rows["fc2"].why
    assert type(kept.module.get_submodule("fc2")) is nn.Linear
    assert _gemm(kept.module, "fc1")["weight"].op == "get_attr"  # gml.dynamic_linear with int8 constants
    assert "1 kept fp32" in kept.summary()

    smooth = quantize_transformer(model, x, calib_data=calib, smooth_alpha=0.5)
    rows = {p.node: p for p in smooth.precisions}
    assert rows["fc2"].precision == "int8" and "SmoothQuant α=0.5" in rows["fc2"].why
    assert float(rows["fc2"].why.split("SQNR ")[1].split(" dB")[0]) > 20
    assert _gemm(smooth.module, "fc2")["smooth_inv"] is not None
    with torch.no_grad():
        c_forced, c_kept, c_smooth = (_cos(ref, r.module(held)) for r in (forced, kept, smooth))
    assert c_kept > c_forced and c_smooth > c_forced and c_smooth > 0.999, (c_forced, c_kept, c_smooth)


def _gemm(gm: fx.GraphModule, name: str) -> dict:
    """The arguments of the ``gml.dynamic_linear`` call named ``name``."""
    from gml.ir.library import gml_op_name, op_args

    (node,) = [n for n in gm.graph.nodes if n.name == name]
    assert gml_op_name(node) == "dynamic_linear"
    return op_args(node)


def test_smoothquant_is_exact_before_rounding_and_checks_its_option() -> None:
    lin = nn.Linear(16, 8)
    s = torch.rand(16) + 0.5
    x = torch.randn(3, 16)
    w_smoothed = lin.weight.detach() * s[None, :]
    assert torch.allclose((x / s) @ w_smoothed.T, x @ lin.weight.detach().T, atol=1e-5)
    q = DynamicQuantLinear(lin, s)
    with torch.no_grad():
        assert _cos(lin(x), q(x)) > 0.999
    with pytest.raises(InputError, match=r"smooth_alpha=1\.5 is outside"):
        quantize_transformer(nn.Sequential(lin).eval(), (x,), smooth_alpha=1.5)


def test_calibration_batches_that_do_not_fit_are_refused_clearly() -> None:
    model = _Outlier().eval()
    calib = [(torch.randn(2, 4, 32),), (torch.randn(3, 32).long(),)]
    with pytest.raises(InputError, match=r"calibration batch 1 .* does not look like the example inputs"):
        quantize_transformer(model, (torch.randn(2, 4, 32),), calib_data=calib)
    assert math.isfinite(DynamicQuantLinear(nn.Linear(4, 4))(torch.zeros(1, 4)).sum().item())


def test_cli_min_sqnr_and_smooth_alpha_reach_the_scheme(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    _bert().save_pretrained(tmp_path)
    args = ["quantize", str(tmp_path), "--input-shape", "2x16", "--no-time", "--calib", "2", "--no-per-layer"]
    assert main([*args, "--min-sqnr", "90"]) == 0  # every GEMM is below 90 dB: all kept fp32, said so
    out = capsys.readouterr().out
    assert "0/9 GEMMs INT8" in out and "9 kept fp32" in out and "< 90 dB on calibration data" in out
    assert main([*args, "--smooth-alpha", "0.5", "--min-sqnr", "-1"]) == 0
    out = capsys.readouterr().out
    assert "9/9 GEMMs INT8" in out and "accuracy fallback" not in out
    assert main([*args, "--smooth-alpha", "2"]) == InputError.exit_code
    assert "smooth_alpha=2 is outside (0, 1)" in capsys.readouterr().out
    saved = tmp_path / "int8.pt2"  # --out: the INT8 transformer saved pickle-free (ADR 008)
    assert main([*args, "--smooth-alpha", "0.5", "--out", str(saved)]) == 0
    assert "saved to" in capsys.readouterr().out
    assert main(["inspect", str(saved)]) == 0
    assert "dynamic_linear" in capsys.readouterr().out


class _TimmStyleViT(nn.Module):
    """timm's ViT shape: hand-written attention in a plain module, ``forward(x, attn_mask=None,
    is_causal=False)`` branching on both optional arguments (timm ≥ 1.0.2x)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * self.scale
        if attn_mask is not None or is_causal:
            a = a + (attn_mask if attn_mask is not None else torch.zeros_like(a))
        a = self.drop(a.softmax(dim=-1))
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, n, c))
        return self.head(x.mean(1))


def test_auto_finds_hand_written_attention_in_a_plain_module_and_captures_default_flags() -> None:
    """A plain module whose attention is hand-written (timm's ViTs) gets the transformer scheme: the
    module tree says nothing, so the scheme is chosen from its captured graph; capture fixes omitted
    ``None`` / bool defaults (``if attn_mask is not None or is_causal:``) instead of tracing them."""
    model, x = _TimmStyleViT().eval(), torch.randn(1, 9, 32)
    assert transformer_reason(model) is None  # nothing to see without the graph
    found = transformer_reason(model, (x,))
    assert found == "its graph holds 1 attention op(s) (gml.attention / scaled_dot_product_attention)"
    res = gml.quantize(model, 2, example_inputs=(x,))
    assert res.scheme == "transformer" and found in res.scheme_reason
    with torch.no_grad():
        assert torch.nn.functional.cosine_similarity(res.module(x).flatten(), model(x).flatten(), 0) > 0.99
    # a CNN still gets the static scheme, with inputs given
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    assert gml.api.choose_scheme(cnn, inputs=(torch.randn(1, 3, 8, 8),))[0] == "static"


def test_transformer_scheme_whole_model_guard_returns_gml_fp32_when_int8_cannot_pay(monkeypatch) -> None:
    """The transformer scheme had no whole-model guard: timm hybrids (CoAtNet, EfficientFormer,
    MobileViT: convs fp32 between a few INT8 GEMMs) came back INT8 and 1.2-1.4x slower than GML fp32.
    Now the static scheme's guard applies (patched timer: deterministic)."""
    import gml.quant.cost_policy as cp
    from gml.ir import library

    torch.manual_seed(0)
    model, x = _Encoder().eval(), torch.randn(1, 10, 8)
    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (3.0, 1.0))
    q = gml.quantize(model, 2, example_inputs=(x,), cost_policy="measure", per_layer=False)
    assert q.scheme == "transformer" and q.precision == "fp32" and q.cost.all_fp32
    assert "gml.optimize's model is returned" in str(q.cost)
    assert not any(library.gml_op_name(n) == "dynamic_linear" for n in q.module.graph.nodes)
    assert q.coverage.kept_fp32 and all("whole-model guard" in e.reason for e in q.coverage.kept_fp32)
    with torch.no_grad():
        torch.testing.assert_close(q.executable(x), model(x), atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: (1.0, 2.0))
    q = gml.quantize(model, 2, example_inputs=(x,), cost_policy="measure", per_layer=False)
    assert q.precision == "int8" and not q.cost.all_fp32 and q.cost.whole == (1.0, 2.0)
    assert sum(library.gml_op_name(n) == "dynamic_linear" for n in q.module.graph.nodes) >= 4


def test_a_transformers_cnn_gets_the_static_scheme_and_one_with_attention_the_transformer_scheme() -> None:
    """An HF ResNet / MobileNet / ConvNeXt is a CNN: the transformer scheme left its convs fp32 and
    its "INT8" ran at fp32's speed (the whole-model guard then returned fp32). A transformers model
    with convolutions gets the transformer scheme only when its graph holds attention."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cnn = transformers.ResNetModel(transformers.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8))
    x = torch.randn(1, 3, 32, 32)
    assert transformer_reason(cnn.eval()) == "it is a transformers ResNetModel"  # nothing to look at
    assert transformer_reason(cnn, (x,)) is None
    res = gml.quantize(cnn, 2, example_inputs=(x,), cost_policy="off", keep_broken=True)
    assert res.scheme == "static" and res.precision == "int8"
    assert "qconv" in res.coverage.summary()
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    vit = transformers.ViTModel(config).eval()
    found = transformer_reason(vit, (x,))
    assert found is not None and found.startswith("it is a transformers ViTModel; its graph holds")
    # an audio transformer's conv front-end holds most of its multiply-adds: still the transformer
    # scheme (WavLM's attention reads integer position buckets the static scheme refused, raw)
    config = transformers.WavLMConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    wavlm = transformers.WavLMModel(config).eval()
    found = transformer_reason(wavlm, (torch.randn(1, 1600),))
    assert found is not None and found.startswith("it is a transformers WavLMModel; it holds 1 WavLMAttention"), found


class _BotNetStyle(nn.Module):
    """timm botnet26t's shape: a conv network with one hand-written attention over its last map."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.qkv, self.head = nn.Conv2d(c, 3 * c, 1), nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.convs(x)
        b, c, h, w = y.shape
        q, k, v = self.qkv(y).reshape(b, 3, c, h * w).unbind(1)
        a = (q.transpose(-2, -1) @ k * c**-0.5).softmax(dim=-1)
        return self.head((v @ a.transpose(-2, -1)).mean(-1))


def test_attention_in_a_conv_network_keeps_the_static_scheme_with_the_reason() -> None:
    """Convolutions holding >= 90% of the multiply-adds make a model a CNN for ``scheme="auto"``:
    the transformer scheme quantizes GEMMs only, and its INT8 ran at fp32's speed on timm botnet26t,
    shvit_s1 and efficientformerv2_s0 (the static scheme's took 0.41-0.71x)."""
    from gml.quant.transformer import CONV_DOMINATED, auto_scheme

    torch.manual_seed(0)
    model, x = _BotNetStyle().eval(), torch.randn(1, 3, 16, 16)
    found, static_why = auto_scheme(model, (x,))
    assert found is None and static_why is not None
    assert static_why.startswith("its graph holds 1 hand-written attention block(s)"), static_why
    share = float(static_why.split("convolutions hold ")[1].split("%")[0]) / 100
    assert share >= CONV_DOMINATED, static_why
    scheme, why = gml.api.choose_scheme(model, inputs=(x,))
    assert scheme == "static" and "multiply-adds" in why
    # the ViT-shaped module (GEMMs only) keeps the transformer scheme
    assert auto_scheme(_TimmStyleViT().eval(), (torch.randn(1, 9, 32),))[0] is not None
