"""GML-Lab's own torch.ao ``BackendConfig``: which patterns become one INT8 op, and how to observe them.

The config is small because it runs on the *normalized* IR (ADR 001): the
:class:`~gml.passes.normalize.Normalize` pass has already turned every spelling of relu into
``nn.ReLU``, of add into :class:`gml.nn.Add`, of flatten into ``nn.Flatten`` and of the pools into
their modules, and BatchNorm is folded into the convs before ``prepare`` (only a BN with no conv
before it, as in DenseNet's BN → ReLU → conv, is left to quantize on its own). So each op appears under
one module type and needs one pattern, where torch's own x86/onednn configs list every
function/method spelling (and BN variants).

Patterns (output dtype quint8 unless noted; the INT8 kernels take u8 activations, s8 weights):

=========================================  =================================  =====================
pattern                                    fused module                       lowers to (oneDNN)
=========================================  =================================  =====================
Conv2d                                     -                                  qconv2d_pointwise
Conv2d → ReLU                              ``nni.ConvReLU2d``                 qconv2d + relu
Conv2d → ReLU6 / Hardtanh / Hardswish /    :class:`ConvAct2d`                 qconv2d + hardtanh /
SiLU                                                                          hardswish / swish
Add(Conv2d(x), y)                          ``nni.ConvAdd2d``                  qconv2d.binary sum
… → ReLU                                   ``nni.ConvAddReLU2d``              qconv2d.binary sum+relu
Linear / Linear → ReLU                     - / ``nni.LinearReLU``             qlinear_pointwise
Linear → ReLU6 / Hardtanh / Hardswish /    :class:`LinearAct`                 qlinear + post-op
SiLU / GELU (GELU: oneDNN only)
Add / Add → ReLU, Mul                      - (observed as a pair) / -         quantized add / mul
Hardswish                                  -                                  quantized hardswish
Sigmoid, Hardsigmoid                       - (fixed qparams 1/256, 0)         quantized sigmoid
BatchNorm2d / BatchNorm2d → ReLU           - / ``nni.BNReLU2d``               quantized batch_norm2d
(a BN no conv before it absorbed)                                             (_relu)
ReLU, ReLU6, Hardtanh, MaxPool2d,          - (output shares the input's       integer clamp,
AvgPool2d, AdaptiveAvgPool2d, mean,        observer: same scale/zero point)   quantized tensor ops,
Flatten,
torch.cat, view/reshape/transpose/                                            data movement on the
permute/contiguous/(un)squeeze                                                integers
=========================================  =================================  =====================

The activation fusions follow the kernels: oneDNN's INT8 conv/linear take ``hardtanh`` (ReLU6),
``hardswish`` and ``swish`` (SiLU) post-ops, FBGEMM's take none of them, but a clamp on the uint8
result is exact (see :func:`gml.kernels.backend.clamp_bounds`), so for fbgemm only the
ReLU6/Hardtanh fusions are listed; Hardswish then gets its own observer and INT8 op, SiLU stays
fp32 (no quantized kernel).

Observer of a fused ReLU6 output: the ordinary activation observer, not a fixed ``[0, 6]`` range.
The clamp guarantees the observed range lies inside ``[0, 6]``, so min/max is never wider than the
fixed range and is finer when the layer never reaches 6 (often, away from trained saturation).
Fixed qparams are used where the *kernel* requires them: PyTorch's quantized sigmoid / hardsigmoid
write scale 1/256, zero point 0 (torch.ao's ``default_fixed_qparams_range_0to1_observer``).

The conv+add patterns use torch.ao's "complex" (reversed, nested) pattern format, the only one
that can say "the other operand is anything" (``MatchAllNode``); torch's onednn config does the
same. Only ``Add(conv, y)`` is listed: the frontend first swaps ``Add(y, conv)`` (alpha 1, where
``+`` commutes bit for bit), because torch.ao picks a fuser by the matched module *types* and
could not tell the two orders apart when both operands are convs.

Observers: activations per-tensor affine quint8 (the full 0..255 range for oneDNN; 0..127,
torch's "reduce_range", for fbgemm), weights per-channel symmetric qint8 (or per-tensor symmetric)
over the range the target's INT8 arithmetic allows (:attr:`gml.ir.target.Target.int8`: 8 bits
with VNNI/AMX, 7 bits ``[-64, 64]`` without, where u8×s8 int16 pairs would saturate; ADR 011).
Activation observer choices:

* ``minmax``: running min/max, the default; on ResNet18 (random init, N(0,1) inputs) it is as
  good as the histogram search and 3x cheaper.
* ``moving_average``: exponential moving average of per-batch min/max (robust to one odd batch).
* ``histogram``: torch's HistogramObserver (L2-error search over a 2048-bin histogram).
* ``percentile``: :class:`PercentileObserver`, which clips the range to the given percentile of
  the same histogram (torch has no percentile observer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.ao.nn.intrinsic as nni
import torch.ao.nn.quantized.reference as nnqr

# BackendConfig.set_backend_pattern_config calls torch.ao.quantization.backend_config.utils
# without importing it (torch 2.14); outside a process that imported quantize_fx first,
# get_backend_config() would raise AttributeError.
import torch.ao.quantization.backend_config.utils
from torch import nn
from torch.ao.quantization import QConfig, QConfigMapping
from torch.ao.quantization.backend_config import (
    BackendConfig,
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
)
from torch.ao.quantization.fuser_method_mappings import _sequential_wrapper2
from torch.ao.quantization.observer import (
    FixedQParamsObserver,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)
from torch.ao.quantization.utils import MatchAllNode

from gml import nn as gnn
from gml.errors import InputError
from gml.ir.target import Int8Arithmetic, Target

#: The INT8 arithmetic of a VNNI / AMX target (8-bit weights, full u8 activations).
VNNI_INT8 = Target("avx512_core_vnni").int8


def target_arithmetic(arithmetic: Int8Arithmetic | None) -> Int8Arithmetic:
    """``arithmetic``, or this process's target's (``detect_target().int8``) when None: the
    default of every function here, so a caller that names no target gets kernels that are exact
    on the CPU it runs on (``gml.quantize`` passes its own Target's)."""
    if arithmetic is not None:
        return arithmetic
    from gml.runtime.target import detect_target

    return detect_target().int8

BACKENDS = ("onednn", "fbgemm")
OBSERVERS = ("minmax", "moving_average", "histogram", "percentile")

# The module classes of the normalized IR that are not ``torch.nn`` modules. torch.ao's tracer
# inlines any module outside ``torch.nn`` (``Add`` would become ``operator.add`` again), so the
# frontend marks these as non-traceable: they stay ``call_module`` nodes that patterns can match.
NORMALIZED_MODULES: tuple[type[nn.Module], ...] = (gnn.Add, gnn.AddScalar, gnn.Mul, gnn.MulScalar)

# u8 activations, s8 weights, fp32 bias: what qconv2d_pointwise / qlinear_pointwise take.
WEIGHTED_INT8 = DTypeConfig(
    input_dtype=torch.quint8, output_dtype=torch.quint8, weight_dtype=torch.qint8, bias_dtype=torch.float
)
ACTIVATION_U8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8)
# Output in [0, 1] at PyTorch's fixed qparams for its quantized sigmoid kernels.
FIXED_0TO1 = FixedQParamsObserver.with_args(
    scale=1.0 / 256.0, zero_point=0, dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=255
)
ACTIVATION_U8_0TO1 = DTypeConfig(
    input_dtype=torch.quint8,
    output_dtype=DTypeWithConstraints(dtype=torch.quint8, scale_exact_match=1.0 / 256.0, zero_point_exact_match=0),
)

_OWN_OBSERVER = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
_SHARED_OBSERVER = ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT


class PercentileObserver(HistogramObserver):
    """Histogram observer whose range is the ``[100-p, p]`` percentile interval of what it saw.

    Clipping rare outliers buys resolution for the bulk of the values; ``p=100`` is min/max.
    The histogram (and its merging across batches) is torch's; only the range choice differs.
    """

    def __init__(self, percentile: float = 99.99, **kwargs: Any) -> None:
        if not 50.0 < percentile <= 100.0:
            raise InputError(f"percentile must be in (50, 100], got {percentile}.", hint="e.g. 99.99")
        super().__init__(**kwargs)
        self.percentile = percentile

    def _non_linear_param_search(self) -> tuple[torch.Tensor, torch.Tensor]:
        hist = self.histogram
        cdf = torch.cumsum(hist, 0) / hist.sum().clamp_min(1e-12)
        tail = 1.0 - self.percentile / 100.0
        lo = int(torch.searchsorted(cdf, torch.tensor(tail, dtype=cdf.dtype)))
        hi = int(torch.searchsorted(cdf, torch.tensor(1.0 - tail, dtype=cdf.dtype)))
        hi = min(max(hi, lo), self.bins - 1)
        width = (self.max_val - self.min_val) / self.bins
        return self.min_val + width * lo, self.min_val + width * (hi + 1)

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, " + super().extra_repr()


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise InputError(f"unknown {what} {value!r}.", hint=f"choose one of: {', '.join(choices)}.")


def activation_observer(
    observer: str = "minmax",
    *,
    backend: str = "onednn",
    percentile: float = 99.99,
    arithmetic: Int8Arithmetic | None = None,
):
    """Observer constructor for activations: per-tensor affine quint8 over ``arithmetic``'s
    activation range (``fbgemm``: at most 0..127, torch's reduce_range; default: this target's)."""
    arithmetic = target_arithmetic(arithmetic)
    _check_choice(observer, OBSERVERS, "observer")
    _check_choice(backend, BACKENDS, "backend")
    kw: dict[str, Any] = {"dtype": torch.quint8, "qscheme": torch.per_tensor_affine}
    qmax = min(arithmetic.act_qmax, 127) if backend == "fbgemm" else arithmetic.act_qmax
    if (arithmetic.act_qmin, qmax) != (0, 255):  # 7-bit activations (reduce_range, the non-deprecated way)
        kw.update(quant_min=arithmetic.act_qmin, quant_max=qmax)
    if observer == "minmax":
        return MinMaxObserver.with_args(**kw)
    if observer == "moving_average":
        return MovingAverageMinMaxObserver.with_args(averaging_constant=0.01, **kw)
    if observer == "histogram":
        return HistogramObserver.with_args(**kw)
    return PercentileObserver.with_args(percentile=percentile, **kw)


def weight_observer(per_channel: bool = True, arithmetic: Int8Arithmetic | None = None):
    """Observer constructor for weights: symmetric qint8 over ``arithmetic``'s weight range (8 bits
    with VNNI/AMX; 7 bits, ``[-64, 64]`` at twice the scale, where int16 pairs would saturate;
    default: this target's), per output channel or per tensor."""
    arithmetic = target_arithmetic(arithmetic)
    kw: dict[str, Any] = {"dtype": torch.qint8}
    if (arithmetic.weight_qmin, arithmetic.weight_qmax) != (-128, 127):
        kw.update(quant_min=arithmetic.weight_qmin, quant_max=arithmetic.weight_qmax)
    if per_channel:
        return PerChannelMinMaxObserver.with_args(qscheme=torch.per_channel_symmetric, **kw)
    return MinMaxObserver.with_args(qscheme=torch.per_tensor_symmetric, **kw)


FIXED_QPARAMS_OPS: tuple[type[nn.Module], ...] = (nn.Sigmoid, nn.Hardsigmoid)


def qconfig_mapping(
    observer: str = "minmax",
    *,
    per_channel: bool = True,
    backend: str = "onednn",
    percentile: float = 99.99,
    arithmetic: Int8Arithmetic | None = None,
    exact_linears: tuple[str, ...] | list[str] = (),
) -> QConfigMapping:
    """One global QConfig (the BackendConfig decides which ops actually get quantized), plus the
    fixed [0, 1] output observer of the sigmoids; ranges from ``arithmetic`` (the Target's). The
    fbgemm backend's 7-bit activations (0..127) keep 8-bit weights: ``127·128·2`` fits in int16.
    ``exact_linears``: the linear modules (:func:`exact_linear_names`) that take
    ``arithmetic.linear_weight_range`` where it has an exact linear kernel."""
    arithmetic = target_arithmetic(arithmetic)
    if backend == "fbgemm":
        arithmetic = dataclasses.replace(
            arithmetic, weight_qmin=-128, weight_qmax=127, act_qmax=127, exact_linear=False
        )
    act = activation_observer(observer, backend=backend, percentile=percentile, arithmetic=arithmetic)
    weight = weight_observer(per_channel, arithmetic)
    mapping = QConfigMapping().set_global(QConfig(activation=act, weight=weight))
    for op in FIXED_QPARAMS_OPS:
        mapping.set_object_type(op, QConfig(activation=FIXED_0TO1, weight=weight))
    if arithmetic.exact_linear and exact_linears:
        # these linears run on GML's exact kernel with 8-bit weights in [-127, 127] (ADR 011); set by
        # module name: an nn.Linear object type would also have to be every fused module's (torch.ao
        # refuses a LinearReLU whose ReLU has another qconfig)
        lo, hi = arithmetic.linear_weight_range
        wide = weight_observer(per_channel, dataclasses.replace(arithmetic, weight_qmin=lo, weight_qmax=hi))
        for name in exact_linears:
            mapping.set_module_name(name, QConfig(activation=act, weight=wide))
    return mapping


#: functions that would fuse into a linear as a post-op the exact kernel lacks (the normalized IR
#: spells activations as modules; these are the spellings it may leave)
_NON_RELU_ACTIVATION_FUNCTIONS = (
    torch.nn.functional.gelu, torch.nn.functional.silu, torch.nn.functional.hardswish,
    torch.nn.functional.relu6, torch.nn.functional.hardtanh,
)  # fmt: skip


def _input_rank(node: torch.fx.Node) -> int | None:
    arg = node.args[0] if node.args else None
    meta = arg.meta.get("tensor_meta") if isinstance(arg, torch.fx.Node) else None
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def exact_linear_names(gm: torch.fx.GraphModule) -> list[str]:
    """The ``nn.Linear`` modules of ``gm`` that take GML's exact INT8 linear (8-bit weights) where the
    target has it (ADR 011, 2026-11-29): a linear over ``[batch, features]`` rows (a classifier head,
    an MLP on vectors), not followed by an activation that would fuse as a post-op other than ReLU
    (GELU, SiLU, ...: the exact kernel's epilogue has ReLU only).

    A linear over token or pixel rows (an input of rank 3 or more: a ViT / Mixer block, ConvNeXt's
    pointwise MLP) keeps the convs' 7-bit weights on oneDNN's GEMM: there GML's exact kernel took
    1.4-2.0x oneDNN's time (197 tokens, 768 → 768 / 3072, Zen 4 capped to AVX2, 1 thread), while for a
    head (1-8 rows) it is 0.7-1.25x."""
    modules = dict(gm.named_modules())
    names = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or type(modules.get(str(node.target))) is not nn.Linear:
            continue
        rank = _input_rank(node)
        if rank is not None and rank > 2:
            continue
        fused_act = False
        for user in node.users:
            if user.op == "call_module":
                fused_act |= isinstance(modules.get(str(user.target)), FUSED_LINEAR_ACTIVATIONS["onednn"])
            elif user.op == "call_function":
                fused_act |= user.target in _NON_RELU_ACTIVATION_FUNCTIONS
        if not fused_act:
            names.append(str(node.target))
    return names


# ---------------------------------------------------------------- conv / linear + activation
class ConvAct2d(nni._FusedModule):
    """``act(conv(x))`` for an activation other than ReLU (torch.ao has ``ConvReLU2d`` only): one
    observed op whose reference form keeps the activation module, read by the INT8 lowering as
    the kernel's eltwise post-op."""

    def __init__(self, conv: nn.Conv2d, act: nn.Module) -> None:
        super().__init__(conv, act)


class LinearAct(nni._FusedModule):
    """``act(linear(x))`` for an activation other than ReLU (see :class:`ConvAct2d`)."""

    def __init__(self, linear: nn.Linear, act: nn.Module) -> None:
        super().__init__(linear, act)


#: Activations fused after a conv/linear, per backend (the INT8 kernels' eltwise post-ops).
FUSED_ACTIVATIONS: dict[str, tuple[type[nn.Module], ...]] = {
    "onednn": (nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.SiLU),
    "fbgemm": (nn.ReLU6, nn.Hardtanh),  # a clamp of the uint8 result; no hardswish/SiLU epilogue
}
#: After a linear: the same, plus GELU on oneDNN, whose INT8 inner product (not its conv) has a gelu
#: post-op (erf and tanh forms): the Linear → GELU of every transformer MLP.
FUSED_LINEAR_ACTIVATIONS: dict[str, tuple[type[nn.Module], ...]] = {
    "onednn": (*FUSED_ACTIVATIONS["onednn"], nn.GELU),
    "fbgemm": FUSED_ACTIVATIONS["fbgemm"],
}


# ---------------------------------------------------------------- conv + add (+ relu)
# Complex-format patterns are reversed and nested: (Add, Conv2d, MatchAllNode) is Add(Conv2d(x), y).
# Only the conv-first operand order is listed: torch.ao looks fuser methods up by the *types* it
# matched, so with a conv on both sides, (Add, Conv2d, *) and (Add, *, Conv2d) are
# indistinguishable and the fuser could pick the wrong conv. The frontend puts the fusable conv
# first instead (:func:`gml.quant.reference_rewrites.conv_operand_first`).
def _fuse_conv_add(is_qat: bool, add: nn.Module, conv: nn.Conv2d, other: Any) -> nn.Module:
    return nni.ConvAdd2d(conv, add)


def _fuse_conv_add_relu(is_qat: bool, relu: nn.Module, add_pattern: tuple[Any, ...]) -> nn.Module:
    add, conv, _ = add_pattern
    return nni.ConvAddReLU2d(conv, add, relu)


def _conv_add_configs() -> list[BackendPatternConfig]:
    add_pattern = (gnn.Add, nn.Conv2d, MatchAllNode)
    return [
        BackendPatternConfig()
        ._set_pattern_complex_format(add_pattern)
        .set_observation_type(_OWN_OBSERVER)
        .set_dtype_configs([WEIGHTED_INT8])
        .set_fuser_method(_fuse_conv_add)
        ._set_root_node_getter(lambda p: p[1])
        ._set_extra_inputs_getter(lambda p: [p[2]])
        .set_fused_module(nni.ConvAdd2d),
        BackendPatternConfig()
        ._set_pattern_complex_format((nn.ReLU, add_pattern))
        .set_observation_type(_OWN_OBSERVER)
        .set_dtype_configs([WEIGHTED_INT8])
        .set_fuser_method(_fuse_conv_add_relu)
        ._set_root_node_getter(lambda p: p[1][1])
        ._set_extra_inputs_getter(lambda p: [p[1][2]])
        .set_fused_module(nni.ConvAddReLU2d),
    ]


def _weighted(pattern: Any, root: type[nn.Module], reference: type[nn.Module]) -> BackendPatternConfig:
    """Config of a (fused) weighted module: observed as one op, converted to a reference module."""
    return (
        BackendPatternConfig(pattern)
        .set_observation_type(_OWN_OBSERVER)
        .set_dtype_configs([WEIGHTED_INT8])
        .set_root_module(root)
        .set_reference_quantized_module(reference)
    )


def _fusion(pattern: tuple[type, ...], fused: type[nn.Module]) -> BackendPatternConfig:
    return (
        BackendPatternConfig(pattern)
        .set_dtype_configs([WEIGHTED_INT8])
        .set_fuser_method(_sequential_wrapper2(fused))
        .set_fused_module(fused)
    )


def _shared(op: Any) -> BackendPatternConfig:
    """An op whose INT8 output keeps its input's scale/zero point (order-preserving or data-moving)."""
    return BackendPatternConfig(op).set_observation_type(_SHARED_OBSERVER).set_dtype_configs([ACTIVATION_U8])


# mean: the average of values lies within their range, so the input's scale covers it (torch.ao
# shares it too); the lowering runs mean over H, W as a global average pool.
SHARED_QPARAM_OPS: tuple[Any, ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.Hardtanh,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AvgPool2d,
    nn.Flatten,
    torch.cat,
    torch.mean,
    "mean",
    # data movement (ShuffleNet's channel shuffle): the values do not change
    *("view", "reshape", "transpose", "permute", "contiguous", "squeeze", "unsqueeze"),
    *(torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze),
)


def _own(op: Any, dtype_config: DTypeConfig = ACTIVATION_U8) -> BackendPatternConfig:
    """An unweighted op whose output gets its own observer."""
    return BackendPatternConfig(op).set_observation_type(_OWN_OBSERVER).set_dtype_configs([dtype_config])


def _with_relu(layer: type, with_relu: type, reference: type) -> list[BackendPatternConfig]:
    """A weighted ``layer`` (its reference form ``reference``), the fusion of ``layer → ReLU`` into
    torch.ao's ``with_relu`` container, and that container as a weighted module."""
    return [
        _weighted(layer, layer, reference),
        _fusion((layer, nn.ReLU), with_relu),
        _weighted(with_relu, layer, reference),
    ]


def get_backend_config(backend: str = "onednn") -> BackendConfig:
    """The GML-Lab BackendConfig (oneDNN adds the conv+add(+relu) residual fusions; observers differ).

    Fused modules convert to themselves with the root conv/linear swapped for torch.ao's reference
    module (weights quantize→dequantize inside), which is what the INT8 lowering matches.
    """
    _check_choice(backend, BACKENDS, "backend")
    configs: list[BackendPatternConfig] = [
        *_with_relu(nn.Conv2d, nni.ConvReLU2d, nnqr.Conv2d),
        # conv+add(+relu) only where a fused residual kernel exists (oneDNN's sum post-op); with
        # fbgemm the add stays a separate INT8 add instead of falling back to fp32.
        *(
            [
                *_conv_add_configs(),
                _weighted(nni.ConvAdd2d, nn.Conv2d, nnqr.Conv2d),
                _weighted(nni.ConvAddReLU2d, nn.Conv2d, nnqr.Conv2d),
            ]
            if backend == "onednn"
            else []
        ),
        # Conv1d runs on the 2-D kernel as a conv of height 1 (gml.quant.modules.QConv1d)
        *_with_relu(nn.Conv1d, nni.ConvReLU1d, nnqr.Conv1d),
        # video models: oneDNN has a 5-D INT8 conv (ReLU by saturation, see gml.quant.modules.QConv3d)
        *(_with_relu(nn.Conv3d, nni.ConvReLU3d, nnqr.Conv3d) if backend == "onednn" else []),
        *_with_relu(nn.Linear, nni.LinearReLU, nnqr.Linear),
        *(_fusion((nn.Conv2d, act), ConvAct2d) for act in FUSED_ACTIVATIONS[backend]),
        _weighted(ConvAct2d, nn.Conv2d, nnqr.Conv2d),
        *(_fusion((nn.Linear, act), LinearAct) for act in FUSED_LINEAR_ACTIVATIONS[backend]),
        _weighted(LinearAct, nn.Linear, nnqr.Linear),
        _own(gnn.Add),
        _own((gnn.Add, nn.ReLU)),
        _own(gnn.Mul),
        # a BN no conv absorbed (pre-activation blocks), alone or with its ReLU: one observed op
        _own(nn.BatchNorm2d),
        _fusion((nn.BatchNorm2d, nn.ReLU), nni.BNReLU2d),
        _own(nni.BNReLU2d),
        _own(nn.Hardswish),
        *(_own(op, ACTIVATION_U8_0TO1) for op in FIXED_QPARAMS_OPS),
        *(_shared(op) for op in SHARED_QPARAM_OPS),
    ]
    return BackendConfig(f"gml_{backend}").set_backend_pattern_configs(configs)


def _pattern_ops(pattern: Any) -> list[Any]:
    if isinstance(pattern, tuple):
        return [op for p in pattern for op in _pattern_ops(p)]
    return [] if pattern is MatchAllNode else [pattern]


def int8_ops(config: BackendConfig | None = None) -> tuple[tuple[type[nn.Module], ...], tuple[Any, ...]]:
    """``(module types, functions)`` that appear in ``config``'s patterns: the ops that run INT8.

    Reference modules subclass their float module (``nnqr.Conv2d`` is an ``nn.Conv2d``), so an
    ``isinstance`` test on these types also recognises converted graphs. The parts of a fusion
    pattern do not count: they only run INT8 fused (GELU after a Linear, not after a conv); the
    fused module's own pattern does.
    """
    config = config if config is not None else get_backend_config()
    types: list[type[nn.Module]] = []
    fns: list[Any] = []
    for c in config.configs:
        if c.fuser_method is not None:
            continue
        pattern = c.pattern if c.pattern is not None else c._pattern_complex_format
        for op in _pattern_ops(pattern):
            bucket: list[Any] = types if isinstance(op, type) and issubclass(op, nn.Module) else fns
            if op not in bucket:
                bucket.append(op)
    return tuple(types), tuple(fns)


def describe_patterns(config: BackendConfig) -> list[str]:
    """Readable names of the patterns in ``config`` (for reports and docs)."""

    def name(p: Any) -> str:
        if isinstance(p, tuple):
            return "(" + ", ".join(name(x) for x in p) + ")"
        if p is MatchAllNode:
            return "*"
        return getattr(p, "__name__", str(p))

    out = []
    for c in config.configs:
        out.append(name(c.pattern if c.pattern is not None else c._pattern_complex_format))
    return out


__all__ = [
    "ACTIVATION_U8",
    "BACKENDS",
    "FUSED_ACTIVATIONS",
    "FUSED_LINEAR_ACTIVATIONS",
    "NORMALIZED_MODULES",
    "OBSERVERS",
    "WEIGHTED_INT8",
    "ConvAct2d",
    "LinearAct",
    "PercentileObserver",
    "activation_observer",
    "get_backend_config",
    "int8_ops",
    "qconfig_mapping",
    "weight_observer",
]
