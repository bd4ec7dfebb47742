"""No engine plan runs a oneDNN reference kernel (issue #23, item 6).

oneDNN falls back to its reference implementation (``ref:any``: plain C++ loops, 10-1000x slower than
its jitted kernels) for a layout or post-op it has no jitted kernel for on the running ISA; nothing
fails, the model just gets slow (HF ViT's attention 0.8 s per call, Whisper's first Conv1d 39 s
under AVX2). Building a plan records every step's implementation, and a reference one is listed in
the runtime report as a bug (``RuntimeReport.reference_steps``). These tests build small models of
the kinds that hit it and assert the list is empty — on whatever ISA they run (``make test`` also runs
them with ``ONEDNN_MAX_CPU_ISA=AVX2``, where the cases above were found).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gml
from gml.runtime import unavailable_reason
from gml.runtime.compile import RuntimeReport, is_reference_impl

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def assert_no_reference_steps(result) -> None:
    report = result.runtime
    assert report.path != "torch", str(report)
    assert result.engine is not None and result.engine.step_impls()
    assert report.reference_steps == {}, str(report)
    assert not [s for s in result.engine.step_impls() if is_reference_impl(s[1])]


def test_the_report_lists_a_reference_step_as_a_bug():
    assert is_reference_impl("ref:any") and is_reference_impl("gml:int8_gemm_avx2+ref:any")
    assert not is_reference_impl("gemm:jit:f32") and not is_reference_impl("gml:winograd_f2x3+brg:avx2")
    text = str(RuntimeReport("engine", reference_steps={"conv1": "ref:any"}))
    assert "BUG: 1 engine step(s) run oneDNN's reference kernel" in text and "conv1 (ref:any)" in text
    assert "BUG" not in str(RuntimeReport("engine"))


class _Conv1dStem(nn.Module):
    """Whisper's encoder stem: Conv1d -> GELU -> Conv1d (stride 2) -> GELU, then time-major."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(8, 16, 3, padding=1)
        self.conv2 = nn.Conv1d(16, 16, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv2(nn.functional.gelu(self.conv1(x))))
        return x.permute(0, 2, 1)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_conv1d_stem(precision):
    torch.manual_seed(0)
    model, x = _Conv1dStem().eval(), torch.randn(1, 8, 40)
    r = gml.optimize(model, x) if precision == "fp32" else gml.quantize(model, 8, example_inputs=x)
    assert_no_reference_steps(r)


class _SmallCNN(nn.Module):
    """The conv kinds of the README's CNNs at a small size: a strided stem, a residual block, an
    inverted-residual (pointwise / depthwise) block, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        conv3 = lambda c, groups=1: nn.Conv2d(c, c, 3, padding=1, groups=groups)  # noqa: E731
        self.res = nn.Sequential(conv3(16), nn.BatchNorm2d(16), nn.ReLU(), conv3(16))
        self.inv = nn.Sequential(nn.Conv2d(16, 32, 1), nn.ReLU6(), conv3(32, 32), nn.ReLU6(), nn.Conv2d(32, 16, 1))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.res(x))
        x = x + self.inv(x)
        x = nn.functional.max_pool2d(x, 2)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_cnn(precision):
    torch.manual_seed(0)
    model, x = _SmallCNN().eval(), torch.randn(1, 3, 32, 32)
    r = gml.optimize(model, x) if precision == "fp32" else gml.quantize(model, 8, example_inputs=x)
    assert_no_reference_steps(r)


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "vit":  # 17 tokens; its all-true mask [B, 1, L, L] is an expand along the keys
        config = transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
            patch_size=8,
        )  # fmt: skip
        return transformers.ViTModel(config).eval(), (torch.randn(1, 3, 32, 32),)
    if kind == "whisper_encoder":
        config = transformers.WhisperConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        )  # fmt: skip
        return transformers.WhisperModel(config).encoder.eval(), (torch.randn(1, 8, 32),)
    config = transformers.BertConfig(
        vocab_size=500, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    ids = torch.randint(1, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    return transformers.BertModel(config).eval(), (ids, torch.ones_like(ids))


@pytest.mark.parametrize("kind", ["vit", "whisper_encoder", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_transformers(kind, precision):
    model, x = _hf(kind)
    r = gml.optimize(model, x) if precision == "fp32" else gml.quantize(model, 8, example_inputs=x)
    assert_no_reference_steps(r)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_classifier_head_on_the_class_tokens_of_a_batch(precision):
    """A ViT head reads ``x[:, 0]``: at batch 2 its rows are strided (one token of each image), for
    which oneDNN 3.2 has only its reference inner product (fp32 and bf16): copied dense first."""
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.VisionTransformer(32, 8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    with torch.no_grad():
        m.heads.head.weight.normal_()  # zero-initialised: the output would be 0
    x = torch.randn(2, 3, 32, 32)
    if precision == "fp32":
        r = gml.optimize(m, x, runtime="engine")
    else:
        r = gml.quantize(m, 8, example_inputs=x, runtime="engine", cost_policy="off")
    assert_no_reference_steps(r)
    assert "heads_head" in {name for name, _ in r.engine.step_impls()}
    with torch.no_grad():
        ref, got = m(x), r.executable(x)
    tol = 1e-4 if precision == "fp32" else 0.1
    assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())


def _rel_logits_1d(q: torch.Tensor, rel_k: torch.Tensor, permute_mask: tuple[int, ...]) -> torch.Tensor:
    """timm's relative-position logits (bottleneck_attn.rel_logits_1d): a padded, sliced and expanded
    view of ``q @ rel_k^T``, permuted."""
    b, h, w, _ = q.shape
    rel_size = rel_k.shape[0]
    win = (rel_size + 1) // 2
    x = (q @ rel_k.transpose(-1, -2)).reshape(-1, w, rel_size)
    x = nn.functional.pad(nn.functional.pad(x, [0, 1]).flatten(1), [0, rel_size - w]).reshape(-1, w + 1, rel_size)
    x = x[:, :w, win - 1 :].reshape(b, h, 1, w, win).expand(-1, -1, win, -1, -1)
    return x.permute(permute_mask)


class _RelPosAttention(nn.Module):
    """BotNet's attention logits (timm botnet26t: PosEmbedRel), between two convs: the add of two
    permuted views with a broadcast, for which oneDNN has only its reference binary under AVX2
    (16 ms per call at 16x16 in botnet26t_256; GML's strided loop runs it, native/strided.h)."""

    def __init__(self, c: int = 16, size: int = 8) -> None:
        super().__init__()
        self.size = size
        self.conv_in = nn.Conv2d(c, c, 1)
        self.height_rel = nn.Parameter(torch.randn(2 * size - 1, c) * 0.1)
        self.width_rel = nn.Parameter(torch.randn(2 * size - 1, c) * 0.1)
        self.conv_out = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q = self.conv_in(x).permute(0, 2, 3, 1)  # [B, H, W, C]
        logits_w = _rel_logits_1d(q, self.width_rel, (0, 1, 3, 2, 4))
        logits_h = _rel_logits_1d(q.transpose(1, 2), self.height_rel, (0, 3, 1, 4, 2))
        logits = (logits_h + logits_w).reshape(b, 1, h * w, h * w)
        return self.conv_out(logits)


def test_relative_position_logits_of_permuted_views():
    torch.manual_seed(0)
    model, x = _RelPosAttention().eval(), torch.randn(2, 16, 8, 8)
    r = gml.optimize(model, x)
    assert_no_reference_steps(r)
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), model(x), rtol=1e-4, atol=1e-4)


class _BroadcastBinaries(nn.Module):
    """fp32 adds (subs, muls) whose second operand is a broadcast slice of the first (along channels,
    along the innermost dim, of strided rows): oneDNN 3.2 has only its reference binary for these on
    every ISA tried (AVX2, AVX-512); GML's strided loop runs them (native/strided.h)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.c1, self.c2 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}[self.op]
        z = self.c1(x)
        a = f(z, z[:, :1])
        b = f(a, a[..., :1])
        c = f(b[:, :, ::2], b[:, :1, 1::2])
        return self.c2(c)


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_binaries_of_broadcast_slices(op):
    torch.manual_seed(0)
    model, x = _BroadcastBinaries(op).eval(), torch.randn(2, 4, 6, 6)
    r = gml.optimize(model, x, runtime="engine")  # a model this small would otherwise stay in torch
    assert_no_reference_steps(r)
    assert f"gml:strided_{op}" in {impl for _, impl in r.engine.step_impls()}
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _SqueezeExcite(nn.Module):
    """An inverted-residual block with timm's squeeze-excite: a spatial mean, a reduce conv with its
    activation in place, an expand conv, a sigmoid gate multiplied into the block's activations."""

    def __init__(self) -> None:
        super().__init__()
        self.pw, self.dw = nn.Conv2d(8, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.reduce, self.act = nn.Conv2d(32, 8, 1), nn.SiLU(inplace=True)
        self.expand, self.proj = nn.Conv2d(8, 32, 1), nn.Conv2d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.silu(self.dw(torch.nn.functional.silu(self.pw(x))))
        gate = self.expand(self.act(self.reduce(y.mean((2, 3), keepdim=True)))).sigmoid()
        return x + self.proj(y * gate)


def test_squeeze_excite_is_one_engine_segment():
    """The mean, the reduce conv and the gate's product used to stay in torch (a stale in-place
    record, no module form for the mean, no engine mul of two computed values): timm's
    EfficientNet-B0 ran as 17 engine segments with 33 torch nodes between them, now as one."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_SqueezeExcite(), _SqueezeExcite()).eval(), torch.randn(2, 8, 12, 12)
    r = gml.optimize(model, x, runtime="engine")
    assert_no_reference_steps(r)
    assert r.runtime.segments == 1 and r.runtime.torch_nodes == [], str(r.runtime)
    with torch.no_grad():
        for shape in ((2, 8, 12, 12), (1, 8, 7, 9)):
            x = torch.randn(shape)
            torch.testing.assert_close(r.executable(x), model(x), rtol=1e-4, atol=1e-4)


class _ECA(nn.Module):
    """ECA channel attention (timm's ecaresnet): a Conv1d(1, 1, k) over the pooled channels, for which
    oneDNN 3.2 has only its reference kernel on every ISA: it stays in torch, with the reason."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv = nn.Conv1d(1, 1, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c1(x)
        y = self.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
        return x * y.view(x.shape[0], -1, 1, 1).sigmoid()


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_eca_channel_conv_stays_in_torch(precision):
    torch.manual_seed(0)
    model, x = _ECA().eval(), torch.randn(2, 8, 8, 8)
    if precision == "fp32":
        r = gml.optimize(model, x, runtime="engine")
    else:
        r = gml.quantize(model, 8, example_inputs=x, runtime="engine")
    assert_no_reference_steps(r)
    reasons = [n.reason for n in r.runtime.torch_nodes]
    assert any("one input and one output channel" in why for why in reasons), str(r.runtime)
    if precision == "fp32":
        with torch.no_grad():
            torch.testing.assert_close(r.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _ShuffleBlocks(nn.Module):
    """ShuffleNetV2's stride-1 units (torchvision's ``InvertedResidual``): ``cat(x1, branch(x2))``
    then the channel shuffle (``view → transpose → contiguous → view``) and ``chunk``. The shuffle's
    copy is NCHW, so the next unit concatenates an NCHW half with the branch conv's NHWC output: a
    mix oneDNN 3.2's concat runs only on its reference kernel (``ref:any``), INT8 and on every ISA.
    GML reorders each source into its slice of the output instead."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models.shufflenetv2 import InvertedResidual

        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.units = nn.Sequential(*(InvertedResidual(32, 32, 1) for _ in range(3)))
        self.head = nn.Conv2d(32, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.units(self.stem(x)))


def test_concat_of_mixed_layouts():
    torch.manual_seed(0)
    model, x = _ShuffleBlocks().eval(), torch.randn(1, 3, 16, 16)
    for m in model.modules():  # BN statistics away from identity, so the fold is exercised
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    r = gml.quantize(model, 8, example_inputs=x, runtime="engine", cost_policy="off")
    assert r.precision == "int8", r.precision_reason
    assert_no_reference_steps(r)
    cats = [impl for name, impl in r.engine.step_impls() if name.startswith("qcat")]
    assert len(cats) >= 3, r.engine.step_impls()
    with torch.no_grad():
        got, want = r.executable(x), model(x)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


class _RawAudioStem(nn.Module):
    """Wav2Vec2 / HuBERT's feature-extractor stem: a Conv1d over one channel of raw audio, then a
    GroupNorm (torch) and GELU. Torch strides the ``(1, 1, T)`` input as NCW; the conv's output is
    NWC; oneDNN read the size-1 channel's stride as given and found only its reference kernel for
    the mix (57 ms instead of 0.5 ms under AVX2): the source is viewed NWC (the same bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 16, 10, stride=5, bias=False)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.conv(x)))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_conv1d_over_one_channel_of_raw_audio(precision):
    torch.manual_seed(0)
    model, x = _RawAudioStem().eval(), torch.randn(1, 1, 800)
    if precision == "fp32":
        r = gml.optimize(model, x, runtime="engine")
    else:
        r = gml.quantize(model, 8, example_inputs=x, runtime="engine", cost_policy="off")
    assert_no_reference_steps(r)
    with torch.no_grad():
        got, want = r.executable(x), model(x)
    if precision == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999


class _BiasedWindowAttention(nn.Module):
    """MaxViT's / Swin's window attention: a relative-position bias [heads, N, N] added to the scores
    of every window (a float mask that broadcasts over the batch of windows), and the other mask
    shapes. oneDNN 3.2's f32 matmul takes such a mask as a binary post-op with a jitted kernel for
    some broadcasts only (rules/attention.py ``_mask_post_op_ok``); the others made the matmul ref:any
    (maxvit_rmlp_nano under the AVX2 cap: 100 ms per attention; a causal [L, S] mask on AVX-512)."""

    def __init__(self, mask: tuple[int, ...], dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(mask))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.proj(a.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize(
    "mask",
    [(2, 9, 9), (1, 1, 9, 9), (9, 9), (4, 2, 9, 9), (4, 1, 1, 9), (4, 2, 1, 9), (1, 2, 1, 9), (9,)],
    ids=lambda m: "x".join(map(str, m)),
)
def test_attention_masks_of_every_broadcast(mask):
    torch.manual_seed(0)
    model, x = _BiasedWindowAttention(mask).eval(), torch.randn(4, 9, 16)  # 4 windows of 3 x 3 tokens
    r = gml.optimize(model, x, runtime="engine")
    assert "attention" in {n.op for n in r.runtime.nodes if n.runs_in == "engine"}, str(r.runtime)
    assert_no_reference_steps(r)
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), model(x), rtol=1e-5, atol=1e-5)


class _PooledTokens(nn.Module):
    """timm botnet26t's attention tail: tokens ``[B, HW, C]`` viewed back as an NCHW map (a plain,
    not channels-last, INT8 value) and pooled 2 x 2 (avg, and max for good measure). oneDNN 3.2
    runs INT8 pools of that layout on ``ref:any``; the plan reorders to NHWC first."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 16)
        self.avg, self.max = nn.AvgPool2d(2, 2), nn.MaxPool2d(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        b, c, h, w = y.shape
        t = self.lin(y.flatten(2).transpose(1, 2))  # [B, HW, C]
        m = t.transpose(1, 2).reshape(b, c, h, w)
        return self.avg(m) + self.max(m)


def test_int8_pools_of_a_plain_layout():
    torch.manual_seed(0)
    model, x = _PooledTokens().eval(), torch.randn(1, 3, 8, 8)
    r = gml.quantize(model, 8, example_inputs=(x,), scheme="static", cost_policy="off", keep_broken=True)
    assert r.precision == "int8" and r.engine is not None
    assert {"qavg_pool2d", "qmax_pool"} <= set(r.coverage.summary().replace(",", " ").split()), r.coverage.summary()
    assert_no_reference_steps(r)
    with torch.no_grad():
        torch.testing.assert_close(r.executable(x), r.module(x), rtol=0, atol=1e-5)


class _SplitAttention(nn.Module):
    """SKNet / ResNeSt split attention: a softmax over the radix dim (1) of ``[B, radix, C, ...]``."""

    def __init__(self, radix: int, spelling: str) -> None:
        super().__init__()
        self.radix, self.spelling = radix, spelling
        self.conv = nn.Conv2d(8, 8 * radix, 1)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(x).mean((2, 3), keepdim=True)  # [B, radix * C, 1, 1]
        a = a.view(x.shape[0], self.radix, 8, 1, 1) if self.spelling != "3d" else a.view(x.shape[0], self.radix, 8)
        return self.softmax(a) if self.spelling == "module" else a.softmax(dim=1)


@pytest.mark.parametrize("spelling", ["module", "method", "3d"])
@pytest.mark.parametrize("radix", [2, 4])
def test_a_softmax_over_a_dim_other_than_the_last(radix, spelling):
    """oneDNN 3.2's softmax over an axis that is not innermost in memory is ``ref:any`` on every ISA:
    the engine makes the axis innermost first (skresnet18 / resnest14d under AVX2)."""
    torch.manual_seed(0)
    model, x = _SplitAttention(radix, spelling).eval(), torch.randn(2, 8, 5, 5)
    res = gml.optimize(model, x, runtime="engine")
    assert_no_reference_steps(res)
    assert not res.runtime.shape_fallbacks, str(res.runtime)
    with torch.no_grad():
        torch.testing.assert_close(res.executable(x), model(x), rtol=1e-5, atol=1e-6)
