"""Data-movement plan values on uint8 values: views, permutes and pieces (:class:`QMove`), pad and cat.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gml.ir.values import QParams
from gml.quant.modules.base import (
    BackendArg,
    GMLQuantModuleBase,
    OpCall,
    UnaryOpsBase,
    _qp,
)


class RuntimeArg:
    """Marks an argument of :class:`QMove` that is passed to ``forward`` (e.g. a size read at run
    time, as in ShuffleNet's ``x.view(n, groups, c // groups, h, w)``)."""

    def __repr__(self) -> str:
        return "?"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuntimeArg)

    def __hash__(self) -> int:
        return hash(RuntimeArg)


#: Tensor methods :class:`QMove` replays on uint8 (``view`` runs as ``reshape``, see there).
MOVE_METHODS = ("view", "reshape", "transpose", "permute", "contiguous", "squeeze", "unsqueeze", "chunk", "split")
#: the methods that return pieces: QMove takes one of them (``item``)
PIECE_METHODS = ("chunk", "split")


class QMove(UnaryOpsBase):
    """A data-movement op (``view``, ``reshape``, ``transpose``, ``permute``, ``contiguous``,
    ``squeeze``, ``unsqueeze``, or one piece of ``chunk`` / ``split``) applied to the integers.

    Moving values does not change them, so the op commutes with (de)quantization:
    ``Q(move(DQ(u))) = move(u)`` when the output shares the input's qparams (the BackendConfig
    shares them), else a requantize. ``view`` runs as ``reshape``: uint8 activations are
    channels-last, where a ``view`` valid for the contiguous fp32 tensor can fail; ``reshape``
    gives the same values and copies only then.
    """

    is_view = True  # may alias its input (the lowering's overwrite protection must know)

    def __init__(
        self,
        method: str,
        args: Sequence[Any],
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        item: int | None = None,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        if method not in MOVE_METHODS:
            raise ValueError(f"unknown data-movement method {method!r}; known: {', '.join(MOVE_METHODS)}")
        if (method in PIECE_METHODS) != (item is not None):
            raise ValueError("chunk / split need the index of the piece (item), other methods none")
        self.method, self.args, self.item = method, tuple(args), item
        self._call = "reshape" if method == "view" else method

    def forward(self, x: torch.Tensor, *runtime: Any) -> torch.Tensor:
        values = iter(runtime)
        args = [next(values) if isinstance(a, RuntimeArg) else a for a in self.args]
        y = getattr(x, self._call)(*args)
        if self.item is not None:
            y = y[self.item]
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.method}({args}){item}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        values = iter(inputs[1:])
        args = [next(values) if isinstance(a, RuntimeArg) else a for a in self.args]
        return OpCall("." + self._call, (inputs[0], *args), item=self.item, requantize=(self._in_qp, self._out_qp))


class QPad(UnaryOpsBase):
    """A constant zero pad on the integers: ``Q(pad(DQ(u), 0)) = pad(u, zero_point)``.

    Real 0 is the integer ``zero_point`` (``(zp - zp) * s = 0``), always representable, so padding
    with it is exact; then a requantize where the output's qparams differ (as every move op).
    """

    is_view = False

    def __init__(
        self,
        pads: Sequence[int | RuntimeArg],
        input_qparams: QParams,
        output_qparams: QParams,
        *,
        backend: BackendArg = None,
    ) -> None:
        super().__init__(input_qparams, output_qparams, backend)
        # sizes computed at run time (timm's "same" padding from x.shape) are RuntimeArg slots,
        # filled from the extra inputs in order
        self.pads = tuple(p if isinstance(p, RuntimeArg) else int(p) for p in pads)

    def _sizes(self, runtime: Sequence[Any]) -> list[Any]:
        values = iter(runtime)
        return [next(values) if isinstance(p, RuntimeArg) else p for p in self.pads]

    def forward(self, x: torch.Tensor, *runtime: int) -> torch.Tensor:
        y = torch.constant_pad_nd(x, [int(p) for p in self._sizes(runtime)], float(self._in_qp.zero_point))
        return self.backend.requantize(y, self._in_qp, self._out_qp)

    def extra_repr(self) -> str:
        return f"pads={list(self.pads)}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        args = (inputs[0], self._sizes(inputs[1:]), float(self._in_qp.zero_point))
        return OpCall(torch.constant_pad_nd, args, requantize=(self._in_qp, self._out_qp))


class QCat(GMLQuantModuleBase):
    """``torch.cat`` of uint8 tensors, each requantized to the output qparams (exact when equal)."""

    def __init__(
        self, dim: int, input_qparams: Sequence[QParams], output_qparams: QParams, *, backend: BackendArg = None
    ) -> None:
        super().__init__(output_qparams, backend)
        if not input_qparams:
            raise ValueError("QCat needs at least one input")
        self.dim = dim
        self.register_buffer("input_scales", torch.tensor([q.scale for q in input_qparams], dtype=torch.float64))
        self.register_buffer("input_zps", torch.tensor([q.zero_point for q in input_qparams], dtype=torch.int64))
        self._in_qps = tuple(input_qparams)

    def refresh(self) -> None:
        super().refresh()
        self._in_qps = tuple(QParams(float(s), int(z)) for s, z in zip(self.input_scales, self.input_zps))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.backend.cat(xs, self._in_qps, self.dim, self._out_qp)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, inputs={len(self._in_qps)}, {self._qp_repr()}"

    def op_call(self, inputs: Sequence[Any]) -> OpCall:
        scales = [q.scale for q in self._in_qps]
        zps = [q.zero_point for q in self._in_qps]
        return OpCall("qcat", (list(inputs), scales, zps, self.dim, *_qp(self._out_qp), self.backend.name))
