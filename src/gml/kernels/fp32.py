"""FP32 fused kernels: oneDNN convolution / linear with a fused post-op and prepacked weights.

Each module here runs **one** oneDNN primitive per call, with the element-wise tail computed by
the primitive's post-op chain while the output tile is still in registers:

====================  ======================================================  ==========================
module                kernel                                                  math
====================  ======================================================  ==========================
:class:`FusedConv`    ``mkldnn._convolution_pointwise``                       ``act(conv(x, W) + b)``
:class:`FusedConvAdd` ``mkldnn._convolution_pointwise.binary`` (or the        ``[relu](conv(x, W) + b
                      in-place ``_convolution_pointwise_.binary``)            + other)``
:class:`FusedLinear`  ``mkldnn._linear_pointwise`` (or MKL's packed GEMM      ``act(x W^T + b)``
                      ``mkl._mkl_linear`` when it measured faster)
:class:`AddReLU`      ``aten._add_relu``                                      ``relu(a + b)``
====================  ======================================================  ==========================

``act`` is any post-op oneDNN's attr table knows (``relu``, ``sigmoid``, ``tanh``, ``swish`` (SiLU),
``hardswish``, ``hardsigmoid``, ``leaky_relu(slope)``, ``hardtanh(lo, hi)`` (ReLU6 is
``hardtanh(0, 6)``), ``gelu`` with erf or tanh approximation); see :func:`post_op_of`. After a
binary add oneDNN's PyTorch binding fuses ``relu`` only.

**Weights.** The modules keep the dense fp32 ``weight``/``bias`` as parameters (so ``state_dict()``
saves and restores a model) and cache a copy reordered once into the blocked layout the primitive
wants (``_reorder_convolution_weight`` / ``_reorder_linear_weight``), packed for the input shape seen
at fusion time. The cache is rebuilt lazily after ``load_state_dict``/``.to()``/``deepcopy``/pickle,
never saved (opaque oneDNN tensors have no storage to save). Under ``torch.export`` /
``torch.compile`` tracing the modules call the same op with the dense weight, which is what
:mod:`gml.io` saves.

**Layout.** With a prepacked weight oneDNN computes in channels-last (NHWC): the first conv reorders
its NCHW input once, every conv output is channels-last, and pools/adds between convs keep that
layout, so no reorder happens between layers.

**Conv1d** has no prepacked path in oneDNN's PyTorch binding (``_reorder_convolution_weight`` takes 2-D
and 3-D convs), so :class:`FusedConv` runs a 1-D conv as a 2-D conv over a height-1 image: the
weight gains a unit kernel row, the input a unit height (free views).

**Fallback.** If oneDNN is missing (:func:`kernel_unavailable_reason`), the modules compute the same
math with the unfused ATen ops and the fusion passes say so in their notes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.ir.library import channels_last_format
from gml.ir.ops import OPS
from gml.ir.values import NO_POST_OP, UNARY_ATTRS, PostOp

# --------------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------------

_CONV_OPS = ("_convolution_pointwise", "_reorder_convolution_weight")
_LINEAR_OPS = ("_linear_pointwise", "_reorder_linear_weight")


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Why the oneDNN fp32 kernels cannot run here, or ``None`` if they can (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return "oneDNN (torch.backends.mkldnn) is not available in this torch build"
    for name in (*_CONV_OPS, *_LINEAR_OPS):
        if not _has_op("mkldnn", name):
            return f"torch.ops.mkldnn.{name} is missing in torch {torch.__version__}"
    try:  # a build can list the ops and still fail at run time (e.g. no AVX2): probe one call
        w = torch.ops.mkldnn._reorder_convolution_weight(torch.ones(2, 1, 1, 1), [0, 0], [1, 1], [1, 1], 1)
        torch.ops.mkldnn._convolution_pointwise(
            torch.ones(1, 1, 2, 2), w, None, [0, 0], [1, 1], [1, 1], 1, "relu", [None], ""
        )
    except Exception as e:  # pragma: no cover - depends on the build
        return f"oneDNN convolution failed on this machine: {type(e).__name__}: {e}"
    return None


def kernels_available() -> bool:
    return kernel_unavailable_reason() is None


def mkl_linear_available() -> bool:
    return torch._C.has_mkl and _has_op("mkl", "_mkl_linear") and _has_op("mkl", "_mkl_reorder_linear_weight")


@functools.cache
def register_export_support() -> None:
    """Give ``_convolution_pointwise.binary`` the fake (shape-only) kernel ``torch.export`` needs.

    PyTorch registers meta kernels for the unary conv and the linear ops but not for the binary conv;
    without one, export cannot trace :class:`FusedConvAdd`. The output has ``other``'s shape, in the
    channels-last layout the kernel writes. Called by :mod:`gml.io`, not at import.
    """
    if not _has_op("mkldnn", "_convolution_pointwise"):
        return
    qualname = "mkldnn::_convolution_pointwise.binary"
    if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
        return

    @torch.library.register_fake(qualname)
    def _binary_fake(x, other, w, b, padding, stride, dilation, groups, binary_attr, alpha, unary, scalars, algo):
        return torch.empty_like(other, memory_format=channels_last_format(other))


# --------------------------------------------------------------------------------------------------
# Post-ops
# --------------------------------------------------------------------------------------------------

# PostOp / NO_POST_OP / UNARY_ATTRS are IR value types (gml.ir.values), imported above.

#: Post-ops whose fused oneDNN form does not propagate NaN/Inf as ATen does: ``relu`` and the clamps
#: (``hardtanh``, ``hardsigmoid``) map NaN to 0 or to a bound, ``gelu`` returns Inf where ATen gives
#: NaN (measured on this build; tests/test_reliability.py pins it). ``aten._add_relu`` maps NaN
#: to 0 and Inf to the largest float. Inputs holding NaN/Inf take the unfused ATen path instead.
NONFINITE_UNSAFE_POST_OPS = frozenset({"relu", "hardtanh", "hardsigmoid", "gelu"})


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no tensor holds a NaN or an Inf: one read of each (a sum, no allocation), so cheap
    next to the conv/linear it guards; only a tensor whose sum is not finite is read again element by
    element. A finite tensor can overflow its sum: an additive attention mask of ``torch.finfo.min``
    (transformers' eager and T5 masks) read as non-finite, and every padded call sent the engine
    segments it feeds to the Python executor (a T5 encoder: 2 of 5 segments)."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors)


def no_nan(*tensors: torch.Tensor) -> bool:
    """Whether no tensor holds a NaN (an Inf is allowed: an attention mask's ``-inf``): one sum each,
    NaN only for a NaN or for Infs of both signs; only then read again element by element."""
    return all(not bool(torch.isnan(t.sum())) or not bool(torch.isnan(t).any()) for t in tensors)


# Activations that are one oneDNN post-op with no arguments to read, in every spelling: the op
# table's ``post_op`` field (gml.ir.ops), not a list of its own.
_SIMPLE_MODULES: dict[type[nn.Module], str] = {m: o.post_op for o in OPS if o.post_op for m in o.modules}
_SIMPLE_FUNCTIONS: dict[Any, str] = {f: o.post_op for o in OPS if o.post_op for f in o.functions}
_SIMPLE_METHODS: dict[str, str] = {m: o.post_op for o in OPS if o.post_op for m in o.methods}


def post_op_of_module(mod: nn.Module) -> PostOp | str:
    """The oneDNN post-op an activation module computes, or why it has none (a message)."""
    kind = _SIMPLE_MODULES.get(type(mod))
    if kind is not None:
        return PostOp(kind)
    if type(mod) in (nn.ReLU6, nn.Hardtanh):  # ReLU6 is Hardtanh(0, 6)
        return PostOp("hardtanh", (float(mod.min_val), float(mod.max_val)))
    if type(mod) is nn.LeakyReLU:
        return PostOp("leaky_relu", (float(mod.negative_slope),))
    if type(mod) is nn.GELU:
        if mod.approximate not in ("none", "tanh"):
            return f"gelu(approximate={mod.approximate!r}) has no oneDNN post-op"
        return PostOp("gelu", (), mod.approximate)
    return f"{type(mod).__name__} has no oneDNN post-op (supported: {', '.join(UNARY_ATTRS)})"


def _bound(fn: Any, node: fx.Node) -> dict[str, Any] | None:
    try:
        b = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    b.apply_defaults()
    return dict(b.arguments)


def _post_op_of_function(node: fx.Node) -> PostOp | str:
    fn = node.target
    if node.op == "call_method":
        kind = _SIMPLE_METHODS.get(str(fn))
        return PostOp(kind) if kind else f".{fn}() has no oneDNN post-op"
    kind = _SIMPLE_FUNCTIONS.get(fn)
    if kind is not None:
        return PostOp(kind)
    name = getattr(fn, "__name__", str(fn))
    if fn is F.gelu:  # a C builtin: no Python signature to bind
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approx not in ("none", "tanh"):
            return f"gelu(approximate={approx!r}) has no oneDNN post-op"
        return PostOp("gelu", (), approx)
    args = _bound(fn, node) if fn in (F.relu6, F.hardtanh, F.hardtanh_, F.leaky_relu, F.leaky_relu_) else None
    if args is None:
        return f"{name} has no oneDNN post-op (supported: {', '.join(UNARY_ATTRS)})"
    consts = {k: v for k, v in args.items() if k not in ("input", "inplace")}
    if any(isinstance(v, fx.Node) for v in consts.values()):
        return f"{name} has an argument computed at run time"
    if fn is F.relu6:
        return PostOp("hardtanh", (0.0, 6.0))
    if fn in (F.hardtanh, F.hardtanh_):
        return PostOp("hardtanh", (float(consts["min_val"]), float(consts["max_val"])))
    return PostOp("leaky_relu", (float(consts["negative_slope"]),))


def post_op_of(node: fx.Node, modules: dict[str, nn.Module]) -> PostOp | str:
    """The fused post-op computing ``node`` (an activation in any spelling), or why there is none."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if mod is None:
            return f"module {node.target} not found"
        return post_op_of_module(mod)
    if node.op in ("call_function", "call_method"):
        if any(isinstance(a, fx.Node) for a in node.args[1:]):
            return f"{node.name} has a tensor argument besides its input"
        return _post_op_of_function(node)
    return f"{node.name} is not an op"


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach(), requires_grad=False)


class _Prepacked(nn.Module):
    """Dense fp32 ``weight``/``bias`` parameters plus a lazily built, never-saved packed copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.float32:
            raise ValueError(f"fp32 kernels take float32 weights, got {weight.dtype}")
        self.weight = _frozen(weight)
        self.bias = _frozen(bias)
        self._packed: Any = None
        #: False when oneDNN is unavailable and forward computes with unfused ATen ops.
        self.fused = kernels_available()

    def _pack(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def packed(self) -> Any:
        if self._packed is None:
            self._packed = self._pack()
        return self._packed

    # The packed copy follows the dense weight: drop it whenever the weight may have changed or the
    # module is copied (oneDNN tensors cannot be deep-copied or pickled).
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._packed = None

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self._packed = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_packed"] = None
        return state


def _tuple(v: int | Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, Sequence) else (int(v),) * n


def conv_padding(conv: nn.Module) -> tuple[int, ...] | str:
    """Explicit symmetric padding of a ``nn.ConvNd``, or why it has none ('same' with even kernels)."""
    n = conv.weight.dim() - 2
    if conv.padding == "valid":
        return (0,) * n
    if conv.padding == "same":
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation):
            total = d * (k - 1)
            if total % 2:
                return "padding='same' with an even effective kernel is asymmetric"
            pads.append(total // 2)
        return tuple(pads)
    return _tuple(conv.padding, n)


def conv_geometry(conv: nn.Module) -> dict[str, Any]:
    """The window of a ``nn.ConvNd`` as the fused convs' constructor arguments (``ValueError`` if
    its padding has no explicit symmetric form, see :func:`conv_padding`)."""
    padding = conv_padding(conv)
    if isinstance(padding, str):
        raise ValueError(padding)
    return {"stride": conv.stride, "padding": padding, "dilation": conv.dilation, "groups": conv.groups}


class _PrepackedConv(_Prepacked):
    """A convolution's window (``stride``, ``padding``, ``dilation``, ``groups``; ``input_size``, the
    example input's, for the weight's layout) and its weight prepacked for it; a 1-D conv runs as
    2-D with an ``[O, I, 1, k]`` weight."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        groups: int = 1,
        input_size: Sequence[int] | None = None,
    ) -> None:
        super().__init__(weight, bias)
        n = self.dim = weight.dim() - 2
        self.stride, self.padding, self.dilation = _tuple(stride, n), _tuple(padding, n), _tuple(dilation, n)
        self.groups = int(groups)
        self.input_size = tuple(input_size) if input_size is not None else None
        # Hot-path arguments prebuilt once (lists, as the op schema wants). Conv1d runs as 2-D.
        lift = (lambda t, v: [v, *t]) if n == 1 else (lambda t, v: list(t))
        self._args = (lift(self.padding, 0), lift(self.stride, 1), lift(self.dilation, 1))

    def _pack(self) -> torch.Tensor:
        w = self.weight.detach()
        size = list(self.input_size) if self.input_size is not None else None
        if self.dim == 1:
            w = w.unsqueeze(2)
            size = [size[0], size[1], 1, size[2]] if size is not None else None
        pad, stride, dil = self._args
        return torch.ops.mkldnn._reorder_convolution_weight(w, pad, stride, dil, self.groups, size)

    def window(self) -> dict[str, Any]:
        """The constructor arguments that place this conv's window."""
        return {"stride": self.stride, "padding": self.padding, "dilation": self.dilation, "groups": self.groups,
                "input_size": self.input_size}  # fmt: skip

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The convolution alone, unfused (ATen), for the reference paths."""
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dim - 1]
        return conv(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def _window_repr(self) -> str:
        o, i = self.weight.shape[:2]
        k = "x".join(str(s) for s in self.weight.shape[2:])
        s = f"{i * self.groups}->{o}, k={k}, stride={self.stride}, padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        return s


class FusedConv(_PrepackedConv):
    """``post_op(conv{1,2,3}d(x, W) + b)`` in one oneDNN primitive with a prepacked weight.

    ``window``: ``stride``, ``padding``, ``dilation``, ``groups``, ``input_size`` (:class:`_PrepackedConv`).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, post_op: PostOp = NO_POST_OP, **window: Any
    ) -> None:
        super().__init__(weight, bias, **window)
        if self.dim not in (1, 2, 3):
            raise ValueError(f"conv weight must be 3-, 4- or 5-D, got {weight.dim()}-D")
        self.post_op = post_op
        self._attr = (post_op.attr, post_op.op_scalars, post_op.algorithm)

    @classmethod
    def from_conv(
        cls, conv: nn.Module, post_op: PostOp = NO_POST_OP, input_size: Sequence[int] | None = None
    ) -> FusedConv:
        return cls(conv.weight, conv.bias, **conv_geometry(conv), post_op=post_op, input_size=input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self._reference(x)
        if torch.compiler.is_compiling():  # export / compile trace: the dense weight goes in the graph
            if self.dim == 1:  # as 2-D, as it runs (the op takes no 3-D tensor: torch.export refused it)
                y = torch.ops.mkldnn._convolution_pointwise(
                    x.unsqueeze(2), self.weight.unsqueeze(2), self.bias, *self._args, self.groups, *self._attr
                )
                return y.squeeze(2)
            pad, stride, dil = (list(self.padding), list(self.stride), list(self.dilation))
            return torch.ops.mkldnn._convolution_pointwise(
                x, self.weight, self.bias, pad, stride, dil, self.groups, *self._attr
            )
        if self.post_op.attr in NONFINITE_UNSAFE_POST_OPS and not all_finite(
            x
        ):  # NaN/Inf propagate exactly as in eager
            return self._reference(x)
        w = self._packed if self._packed is not None else self.packed()
        if self.dim == 1:
            y = torch.ops.mkldnn._convolution_pointwise(
                x.unsqueeze(2), w, self.bias, *self._args, self.groups, *self._attr
            )
            return y.squeeze(2)
        return torch.ops.mkldnn._convolution_pointwise(x, w, self.bias, *self._args, self.groups, *self._attr)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_op.apply(self._conv(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return self._window_repr() + f", post_op={self.post_op}" + ("" if self.fused else ", UNFUSED fallback")


class FusedConvAdd(_PrepackedConv):
    """``[relu](conv2d/3d(x, W) + b + other)`` in one oneDNN primitive (binary-add post-op).

    With ``inplace=True`` the sum is accumulated into ``other``'s memory
    (``_convolution_pointwise_.binary``, oneDNN's ``sum`` post-op: no output allocation); the fusion
    pass sets it only when nothing reads ``other`` afterwards and ``other`` is a fresh tensor.
    ``window``: as :class:`FusedConv`'s.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        relu: bool = False,
        inplace: bool = False,
        **window: Any,
    ) -> None:
        super().__init__(weight, bias, **window)
        if self.dim not in (2, 3):
            raise ValueError("conv+add fusion needs a 2-D or 3-D convolution")
        self.relu = bool(relu)
        self.inplace = bool(inplace)
        self._unary = "relu" if relu else None

    @classmethod
    def from_conv(
        cls, conv: nn.Module, *, relu: bool, inplace: bool, input_size: Sequence[int] | None = None
    ) -> FusedConvAdd:
        return cls(conv.weight, conv.bias, **conv_geometry(conv), relu=relu, inplace=inplace, input_size=input_size)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return self._reference(x, other)
        if torch.compiler.is_compiling():  # export has no fake kernel for the in-place form; same value
            return torch.ops.mkldnn._convolution_pointwise.binary(
                x, other, self.weight, self.bias, *self._args, self.groups, "add", None, self._unary, [None], ""
            )
        if self.relu and not all_finite(x, other):  # the fused relu maps NaN to 0
            return self._reference(x, other)
        w = self._packed if self._packed is not None else self.packed()
        if self.inplace:
            return torch.ops.mkldnn._convolution_pointwise_.binary(
                other, x, w, self.bias, *self._args, self.groups, "add", None, self._unary, [None], ""
            )
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, w, self.bias, *self._args, self.groups, "add", None, self._unary, [None], ""
        )

    def _reference(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        y = self._conv(x, self.weight, self.bias) + other
        return torch.relu(y) if self.relu else y

    def extra_repr(self) -> str:
        s = self._window_repr() + ", post_op=add" + ("+relu" if self.relu else "")
        if self.inplace:
            s += ", inplace"
        return s + ("" if self.fused else ", UNFUSED fallback")


# Measured on the development machine (Zen 5, AVX-512; single-thread CPU time, docs/fp32-kernels.md):
# oneDNN's prepacked inner product runs at 130-235 GF/s from 2 rows up, about 2x MKL's F.linear
# (which takes a slow path on AMD), but costs ~10 us per call, so tiny layers stay on ATen; for one
# row (a GEMV) MKL's packed GEMM is the fastest once the weight is large.
ONEDNN_MIN_ROWS = 2
ONEDNN_MIN_MACS = 1 << 20  # rows*K*N below this, oneDNN's fixed cost beats its speed
MKL_MIN_WEIGHT = 1 << 18  # K*N from which MKL's packed GEMV beats F.linear at one row


def choose_linear_backend(rows: int | None, in_features: int, out_features: int) -> str:
    """Fastest backend for a ``rows x K`` by ``K x N`` linear here: ``"onednn"``, ``"mkl"`` or ``"aten"``.

    ``rows`` is the product of the input's leading dims (``None``: unknown, assume a batch).
    Only ``"onednn"`` can fuse a post-op; see docs/fp32-kernels.md for the measurements.
    """
    if not kernels_available():
        return "aten"
    if rows is None:
        return "onednn"
    weight = in_features * out_features
    if rows >= ONEDNN_MIN_ROWS and rows * weight >= ONEDNN_MIN_MACS:
        return "onednn"
    if rows == 1 and weight >= MKL_MIN_WEIGHT and mkl_linear_available():
        return "mkl"
    return "aten"


class FusedLinear(_Prepacked):
    """``post_op(x @ W^T + b)``: oneDNN inner product with the post-op fused and a prepacked weight.

    ``backend="mkl"`` runs MKL's packed GEMM (``mkl._mkl_linear``) instead, for plain linears (no
    post-op: MKL has no epilogue) of the shapes where it measured faster; ``"auto"`` picks by
    :func:`choose_linear_backend` from ``rows`` (the product of the input's leading dims). A post-op
    always runs on oneDNN, fused; ``"aten"`` (``F.linear``) is the fallback without oneDNN.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        post_op: PostOp = NO_POST_OP,
        rows: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(weight, bias)
        if weight.dim() != 2:
            raise ValueError("linear weight must be 2-D")
        self.post_op = post_op
        self.rows = rows
        if backend == "auto":
            backend = choose_linear_backend(rows, weight.shape[1], weight.shape[0])
        if backend not in ("onednn", "mkl", "aten"):
            raise ValueError(f"unknown linear backend {backend!r}")
        if post_op.attr != "none" or (backend == "mkl" and not mkl_linear_available()):
            backend = "onednn"  # a post-op is fused by oneDNN only
        if not self.fused:
            backend = "aten"
        self.backend = backend
        self._attr = (post_op.attr, post_op.op_scalars, post_op.algorithm)
        self._mkl_rows = int(rows) if rows else 1

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, post_op: PostOp = NO_POST_OP, rows: int | None = None, backend: str = "auto"
    ) -> FusedLinear:
        return cls(linear.weight, linear.bias, post_op=post_op, rows=rows, backend=backend)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def _pack(self) -> torch.Tensor:
        w = self.weight.detach()
        if self.backend == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(w, self._mkl_rows)
        return torch.ops.mkldnn._reorder_linear_weight(w, self.rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "aten":
            return self.post_op.apply(F.linear(x, self.weight, self.bias))
        if torch.compiler.is_compiling():
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, *self._attr)
        if self.post_op.attr in NONFINITE_UNSAFE_POST_OPS and not all_finite(
            x
        ):  # NaN/Inf propagate exactly as in eager
            return self.post_op.apply(F.linear(x, self.weight, self.bias))
        w = self._packed if self._packed is not None else self.packed()
        if self.backend == "mkl":
            return torch.ops.mkl._mkl_linear(x, w, self.weight, self.bias, self._mkl_rows)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, *self._attr)

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}->{self.out_features}, bias={self.bias is not None}, "
            f"post_op={self.post_op}, backend={self.backend}"
        )


class AddReLU(nn.Module):
    """``relu(a + b)`` in one pass over memory (ATen's fused ``_add_relu`` kernel)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype != torch.float32 or b.dtype != torch.float32 or not all_finite(a, b):
            # _add_relu maps NaN to 0 and Inf to the largest float; it has no bf16 kernel (a bf16 graph)
            return torch.relu(a + b)
        return torch.ops.aten._add_relu(a, b)


def fused_matmul_add_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``relu(x @ w + b)`` as one oneDNN inner product with a fused ReLU (``w`` is ``K x N``).

    Used by :class:`~gml.passes.fuse_matmul.FuseMatmulAddRelu` when ``w`` is computed at run time
    (a constant ``w`` becomes a :class:`FusedLinear` with a prepacked weight instead).
    """
    if not kernels_available() or x.dtype != torch.float32 or not all_finite(x, w, b):
        return torch.relu(torch.matmul(x, w) + b)
    return torch.ops.mkldnn._linear_pointwise(x, w.t().contiguous(), b, "relu", [None], "")


torch.fx.wrap("fused_matmul_add_relu")


def fp32_kernel_modules() -> tuple[type[nn.Module], ...]:
    """Module types whose output is a freshly allocated tensor (never a view of an input)."""
    return (FusedConv, FusedConvAdd, FusedLinear, AddReLU)


def describe_kernels() -> str:
    """One line for reports: which fp32 kernels run here."""
    why = kernel_unavailable_reason()
    if why is not None:
        return f"fp32 kernels: unfused ATen fallback ({why})"
    mkl = "MKL packed GEMV for large single-row linears" if mkl_linear_available() else "no MKL packed GEMM"
    return f"fp32 kernels: oneDNN fused conv/linear with prepacked weights; {mkl}"


__all__ = [
    "NONFINITE_UNSAFE_POST_OPS",
    "NO_POST_OP",
    "UNARY_ATTRS",
    "AddReLU",
    "FusedConv",
    "FusedConvAdd",
    "FusedLinear",
    "PostOp",
    "all_finite",
    "choose_linear_backend",
    "conv_geometry",
    "conv_padding",
    "describe_kernels",
    "fused_matmul_add_relu",
    "kernel_unavailable_reason",
    "kernels_available",
    "post_op_of",
    "post_op_of_module",
    "register_export_support",
]
