"""The base classes of the INT8 plan values (qparams as buffers, the op call they emit), the edges of an
INT8 region (:class:`Quantize`, :class:`Dequantize`) and :func:`extract_qparams`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from gml.ir.qdq import DECOMPOSED_DQ, is_dequantize, is_quantize, quantize_args
from gml.ir.values import QParams
from gml.kernels.backend import Int8Backend
from gml.kernels.registry import get_backend

BackendArg = str | Int8Backend | None


@dataclass(frozen=True)
class OpCall:
    """What the lowering emits for a module: a call of ``target`` (a ``torch.ops.gml`` op name, a
    torch function, or ``".method"``) on ``args`` (tensors among them become graph constants),
    then ``[item]`` and a ``gml.requantize`` when ``requantize=(in, out)`` qparams differ."""

    target: Any
    args: tuple[Any, ...]
    item: int | None = None
    requantize: tuple[QParams, QParams] | None = None


def _qp(qp: QParams) -> tuple[float, int]:
    return float(qp.scale), int(qp.zero_point)


def _out(qp: QParams | None) -> tuple[float, int, torch.dtype]:
    """``(out_scale, out_zero_point, out_dtype)``: an fp32 output is requested as (1.0, 0, float32)."""
    return (1.0, 0, torch.float32) if qp is None else (float(qp.scale), int(qp.zero_point), torch.uint8)


def _scalar_buffer(value: float | int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _register_qparams(module: nn.Module, prefix: str, qp: QParams) -> None:
    """``<prefix>_scale`` (float64) and ``<prefix>_zp`` (int64) buffers: the state_dict form of qparams."""
    module.register_buffer(f"{prefix}_scale", _scalar_buffer(qp.scale, torch.float64))
    module.register_buffer(f"{prefix}_zp", _scalar_buffer(qp.zero_point, torch.int64))


def _buffered_qparams(module: nn.Module, prefix: str) -> QParams:
    """The qparams the ``<prefix>_scale`` / ``<prefix>_zp`` buffers hold now."""
    return QParams(float(getattr(module, f"{prefix}_scale")), int(getattr(module, f"{prefix}_zp")))


def _refresh_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    # A named function, not a lambda: hooks are pickled with the module by torch.save.
    module.refresh()  # type: ignore[operator]


#: the qparams a module may hold, by buffer prefix: (the attribute caching them, their name in reprs)
_HELD = {"input": ("_in_qp", "in"), "other": ("_other_qp", "other"), "output": ("_out_qp", "out")}


class _HoldsQParams(nn.Module):
    """A module whose qparams live in buffers (``<prefix>_scale`` / ``<prefix>_zp``, the state_dict
    form) with a Python-float copy cached for the hot path; :meth:`refresh` (called after
    ``load_state_dict``) re-reads every copy from its buffers."""

    def __init__(self, backend: BackendArg) -> None:
        super().__init__()
        self.backend = get_backend(backend)
        self._held: tuple[str, ...] = ()
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def _hold(self, prefix: str, qp: QParams | None) -> None:
        """Register ``qp`` as the ``prefix`` buffers and cache it (``None``, an fp32 output: buffers
        (1.0, 0), cached ``None``). Reprs list the qparams held last first."""
        _register_qparams(self, prefix, qp or QParams(1.0, 0))
        setattr(self, _HELD[prefix][0], qp)
        self._held = (prefix, *self._held)

    def refresh(self) -> None:
        """Re-read cached values from the buffers (after they were loaded or edited)."""
        for prefix in self._held:
            if getattr(self, _HELD[prefix][0]) is not None:  # an fp32 output stays None
                setattr(self, _HELD[prefix][0], _buffered_qparams(self, prefix))

    def _qp_repr(self) -> str:
        def text(qp: QParams | None) -> str:
            return "fp32" if qp is None else f"({qp.scale:.4g}, {qp.zero_point})"

        return ", ".join(f"{_HELD[p][1]}={text(getattr(self, _HELD[p][0]))}" for p in self._held)

    def extra_repr(self) -> str:
        return self._qp_repr()  # a module with more attributes puts them first


class GMLQuantModuleBase(_HoldsQParams, ABC):
    """An INT8 op whose output is a uint8 tensor with the qparams in ``output_scale``/``output_zp``.

    Subclasses call ``super().__init__(output_qparams, backend)`` first, register their own
    buffers, and implement :meth:`forward`. Python-float copies of the buffers are cached for the hot
    path and refreshed by :meth:`refresh` (called after ``load_state_dict``); a subclass that derives
    state from buffers (a prepacked weight) extends :meth:`refresh`.

    ``output_qparams=None`` is allowed for the weighted ops only (:class:`QConv2d`,
    :class:`QLinear`): their kernels can write fp32 directly, which is how a model's last layer
    avoids rounding its logits. Such a module has ``output_dtype == torch.float32``, buffers
    (1.0, 0), and :attr:`output_qparams` is ``None``.
    """

    #: The output shares memory with the first input (a view): the lowering must not let a kernel
    #: write into it while the input is still read.
    is_view: bool = False
    _out_qp: QParams | None

    def __init__(self, output_qparams: QParams | None, backend: BackendArg = None) -> None:
        super().__init__(backend)
        self.output_dtype = torch.uint8 if output_qparams is not None else torch.float32
        self._hold("output", output_qparams)

    @property
    def output_qparams(self) -> QParams | None:
        """qparams of the uint8 output; ``None`` when the module writes fp32."""
        return self._out_qp

    @abstractmethod
    def forward(self, *args: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        """The ``torch.ops.gml`` call computing this module on ``inputs`` (what the lowering emits)."""


class UnaryOpsBase(GMLQuantModuleBase):
    """One uint8 input with qparams ``input_scale``/``input_zp``."""

    _in_qp: QParams

    def __init__(self, input_qparams: QParams, output_qparams: QParams, backend: BackendArg = None) -> None:
        super().__init__(output_qparams, backend)
        self._hold("input", input_qparams)

    @property
    def input_qparams(self) -> QParams:
        return self._in_qp


class BinaryOpsBase(UnaryOpsBase):
    """Two uint8 inputs: ``input_*`` for the first, ``other_*`` for the second."""

    _other_qp: QParams

    def __init__(
        self,
        input_qparams: QParams,
        other_qparams: QParams,
        output_qparams: QParams,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        self._hold("other", other_qparams)

    @property
    def other_qparams(self) -> QParams:
        return self._other_qp


class Quantize(GMLQuantModuleBase):
    """fp32 → uint8 where the INT8 region starts (model input, or after an op kept in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quantize(x, self._out_qp)

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("quantize", (inputs[0], *_qp(self._out_qp)))


class Dequantize(_HoldsQParams):
    """uint8 → fp32 where the INT8 region ends. Not a :class:`GMLQuantModuleBase`: its output
    carries no qparams, so :func:`extract_qparams` correctly finds none on it."""

    _in_qp: QParams

    def __init__(self, input_qparams: QParams, *, backend: BackendArg = None) -> None:
        super().__init__(backend)
        self._hold("input", input_qparams)

    @property
    def input_qparams(self) -> QParams:
        return self._in_qp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.dequantize(x, self._in_qp)

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        return OpCall("dequantize", (inputs[0], *_qp(self._in_qp)))


# ---------------------------------------------------------------- reading qparams off the graph
def extract_qparams(node: fx.Node, gm: fx.GraphModule) -> QParams | None:
    """The qparams of the uint8 value ``node`` produces, or ``None`` if it produces no quantized value.

    Polymorphic over what the node is: a torch quantize op (read its scale/zero point arguments), a
    dequantize op (the qparams of the value it reads), or an already-lowered GML module (its
    ``output_scale``/``output_zp`` buffers). The last case is what lets a pattern whose operand was
    lowered earlier, such as a residual add, be lowered without knowing which module produced it.
    Unsupported quantize ops (per-channel activations, int8) raise ``ValueError`` with the reason.
    """
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return mod.output_qparams if isinstance(mod, GMLQuantModuleBase) else None
    if is_quantize(node):
        return quantize_args(node, gm)[0]
    if is_dequantize(node):
        if node.target in DECOMPOSED_DQ:
            return quantize_args(node, gm)[0]
        src = node.args[0]
        return extract_qparams(src, gm) if isinstance(src, fx.Node) else None
    return None
