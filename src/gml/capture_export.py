"""The second capture path: ``torch.export`` (non-strict) for what ``torch.fx.symbolic_trace`` cannot take.

``symbolic_trace`` runs ``forward`` on proxies, so Python that reads or writes tensor values fails
(HF's ``BertModel`` assigns into a proxy while building its mask; ``nn.TransformerEncoder`` checks
dtypes and takes a fast path on values), and the ``torch.nn`` layers it keeps as opaque leaves hide
what is inside them (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``). ``torch.export``
runs ``forward`` on fake tensors with real Python, records ATen ops, and keeps ``ModelOutput`` /
dict outputs through pytree specs. :func:`export_capture` turns that into the graph the GML passes
read:

1. ``torch.export.export(model, inputs, strict=False)`` with every input dimension marked
   ``Dim.AUTO`` (dynamic where the model allows it: batch, sequence length); a batch of 1 is exported
   as a batch of 2 (export specialises sizes 0 and 1), so the graph serves any batch, and the
   example's own batch is checked against eager. Dims export had to fix are listed in
   :class:`CaptureInfo` (``static 224``), never silently assumed.
2. ``ep.module()`` re-homed in a plain ``fx.GraphModule`` (the exported class refuses ``.eval()``),
   keeping its input/output pytree specs and its shape guards (``_guards_fn``: a call with a batch or
   sequence length outside the exported range is refused with the guard that failed).
3. :class:`~gml.passes.raise_aten.RaiseATen`: ATen calls become module calls and torch-level calls,
   one node kind per op (ADR 001), bit-exact.
4. The result is checked against eager on the example inputs.

:func:`choose_export` says when :func:`gml.capture.capture` takes this path instead of fx, and why.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.errors import TraceFailure, first_few

#: ``torch.nn`` layers fx keeps as opaque leaves although GML rewrites what is inside them.
OPAQUE_TO_FX: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)

CAPTURE_META = "gml_capture"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# torch's own tracing machinery: a failure's line is the first frame *outside* these
_MACHINERY = (
    *(
        _TORCH_DIR + d
        for d in (
            "_export",
            "export",
            "fx",
            "_dynamo",
            "_subclasses",
            "_functorch",
            "_guards.py",
            "_ops.py",
            "_library",
            "_higher_order_ops",
            "_prims",
            "_refs",
            "_decomp",
            "utils",
            "_tensor.py",
            "overrides.py",
            "_C",
            "__init__.py",
            "_meta_registrations.py",
            "_compile.py",
            "_logging",
            "_jit_internal.py",
            "nn/modules/module.py",
        )
    ),
    os.path.dirname(__file__) + os.sep,
)


@dataclass
class CaptureInfo:
    """Which capture path made a graph, why, and what its input dimensions may be."""

    path: str  # "torch.fx" or "torch.export"
    reason: str
    #: input name -> list of per-dim descriptions ("dynamic 1..1024", "static 16")
    dims: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shapes = "; ".join(f"{name}: [{', '.join(d)}]" for name, d in self.dims.items())
        return f"captured with {self.path} ({self.reason})" + (f"; inputs {shapes}" if shapes else "")


def capture_info(gm: nn.Module) -> CaptureInfo | None:
    """The :class:`CaptureInfo` :func:`gml.capture.capture` left on ``gm``, if any."""
    meta = getattr(gm, "meta", None)
    return meta.get(CAPTURE_META) if isinstance(meta, dict) else None


def opaque_leaves(gm: fx.GraphModule) -> list[str]:
    """``"layers.0 (TransformerEncoderLayer)"`` for each call of an :data:`OPAQUE_TO_FX` module."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            m = gm.get_submodule(str(node.target))
            if isinstance(m, OPAQUE_TO_FX):
                found.append(f"{node.target} ({type(m).__name__})")
    return found


def choose_export(gm: fx.GraphModule, model: nn.Module | None = None, inputs: Sequence[Any] = ()) -> str | None:
    """Why an fx graph should be re-captured with ``torch.export`` (``None``: keep it): attention
    left as opaque leaves, or (given the model and its inputs) an output type fx lost."""
    hidden = opaque_leaves(gm)
    if hidden:
        return f"torch.fx keeps {first_few(hidden)} as opaque leaves; torch.export traces into them"
    return _lost_output_type(gm, model, inputs) if model is not None else None


def _lost_output_type(gm: fx.GraphModule, model: nn.Module, inputs: Sequence[Any]) -> str | None:
    """fx writes any dict a traced forward returns as a plain ``dict``: a ``ModelOutput`` (HF MPNet,
    whose forward fx traces) would lose its type and attributes (``out.last_hidden_state``).
    torch.export keeps the model's output structure (pytree specs)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not isinstance(out.args[0], dict):
        return None
    with torch.no_grad():
        ref = copy.deepcopy(model)(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    if not isinstance(ref, dict) or type(ref) is dict:
        return None
    return f"the torch.fx graph returns a plain dict where {type(model).__name__} returns a {type(ref).__name__}"


def _failing_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame outside torch's tracing machinery: the model's (or transformers') line."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not f.filename.startswith(_MACHINERY)]
    return outside[-1] if outside else (frames[-1] if frames else None)


def _where(exc: BaseException) -> str:
    frame = _failing_frame(exc)
    if frame is None:
        return ""
    path = frame.filename
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f" at {path}:{frame.lineno} in {frame.name}(){code}"


def _dense(x: Any) -> Any:
    """A tensor the example gives as a view with gaps (``x[:, :6]``) as a dense copy: exported on it,
    torch.export kept a guard that the input is *not* dense (``memory.stride()[0] != memory.size(1) *
    memory.size(2)``: an ``nn.TransformerDecoder``'s memory), so the graph refused every dense input
    (its own check on a copy of the example too, and the decoder stayed one opaque torch node). The
    graph does not depend on the example's strides; the engine reads each call's own."""
    if isinstance(x, torch.Tensor) and not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last):
        return x.contiguous()
    return x


def _batch2(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
        return torch.cat([x, x])
    return x


def _dynamic_shapes(inputs: Sequence[Any]) -> tuple[Any, ...]:
    from torch.export import Dim

    spec: list[Any] = []
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            spec.append(None)
            continue
        # AUTO: dynamic where the model allows it, specialised (not an error) where it does not
        spec.append(dict.fromkeys(range(x.dim()), Dim.AUTO))
    return tuple(spec)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's export warnings (specialised dims, guard dumps): a CLI user sees our one
    paragraph, and what export decided is reported in :class:`CaptureInfo`."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:  # export also prints the graph it was building when a guard fails
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(before)


def _export(model: nn.Module, inputs: tuple, dynamic: bool) -> torch.export.ExportedProgram:
    shapes = _dynamic_shapes(inputs) if dynamic else None
    with _quiet(), _masks_as_given():
        return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)


def _as_given(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    return is_causal is True


@contextlib.contextmanager
def _masks_as_given() -> Iterator[None]:
    """``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` given a mask and no ``is_causal`` compare
    the mask's values with a causal mask (``_detect_is_causal_mask``: ``bool((mask == causal).all())``)
    to pass SDPA its ``is_causal`` hint instead: a branch on data that torch.export cannot trace, so
    the whole encoder stayed one opaque torch node (slower than eager). The hint selects how the same
    mask is applied, not what it computes: during the export the mask is taken as given (the flag is
    the caller's ``is_causal``), and the graph adds it as it is."""
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:  # another torch: nothing to do
        yield
        return
    transformer._detect_is_causal_mask = _as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


def _serves(ep: torch.export.ExportedProgram, inputs: tuple) -> str | None:
    """Why ``ep`` cannot run the example (``None``: it can). A graph exported on a doubled batch may
    have specialised the batch to 2 (a loop over the batch unrolls), or kept a guard that ties the
    batch to other dims and fails at batch 1 (HF MobileViT / Swin / SigLIP: ``4 * N != h * w`` where a
    reshape folds the batch into the patches); the example itself is then exported."""
    user = torch.export.graph_signature.InputKind.USER_INPUT
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == user]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    for name, x in zip(names, inputs):
        val = vals.get(name)
        if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor):
            continue
        for d, size in zip(val.shape, x.shape):
            if not isinstance(d, torch.SymInt) and int(d) != size:
                return "the batch dimension is specialised (forward() depends on its size)"
    try:
        with torch.no_grad():
            ep.module()(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    except Exception as exc:  # a guard of the doubled batch's graph (or any failure on the example)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"the graph exported on a doubled batch refuses the example ({first[:160]})"
    return None


def _bound(value: Any) -> str:
    """A range bound as text; export's unbounded upper end (``int_oo``) is ``∞``."""
    if value is None or "oo" in str(value):
        return "∞"
    return str(int(value))


def _describe_dims(
    ep: torch.export.ExportedProgram, names: list[str], sizes: dict[str, tuple[int, ...]]
) -> dict[str, list[str]]:
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    out: dict[str, list[str]] = {}
    user = torch.export.graph_signature.InputKind.USER_INPUT
    user_inputs = [s for s in ep.graph_signature.input_specs if s.kind == user]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for spec, name in zip(user_inputs, names):
        node = placeholders.get(spec.arg.name)
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor):
            continue
        dims = []
        for i, d in enumerate(val.shape):
            r = ranges.get(str(d)) if isinstance(d, torch.SymInt) else None
            if r is not None:
                dims.append(f"dynamic {_bound(r.lower)}..{_bound(r.upper)}")
            else:  # a symbol export replaced by a constant is as static as a plain int
                dims.append(f"static {int(d) if not isinstance(d, torch.SymInt) else sizes[name][i]}")
        out[name] = dims
    return out


def export_capture(model: nn.Module, example_inputs: Sequence[Any], *, reason: str) -> fx.GraphModule:
    """Capture ``model`` with ``torch.export`` and raise its graph to GML's vocabulary (module docstring).

    Raises :class:`TraceFailure` naming the line that failed (in the model, transformers or torch.nn).
    """
    from gml.passes.raise_aten import RaiseATen

    inputs = tuple(_dense(x) for x in example_inputs)
    name = type(model).__name__
    notes: list[str] = []
    ep = None
    first_error: BaseException | None = None
    attempts = [(tuple(_batch2(x) for x in inputs), True), (inputs, True), (inputs, False)]
    if not any(isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1 for x in inputs):
        attempts = attempts[1:]
    for args, dynamic in attempts:
        try:
            candidate = _export(model, args, dynamic)
        except Exception as exc:  # the next attempt fixes more; the first error is the one to show
            first_error = first_error or exc
            continue
        refused = None if args is inputs else _serves(candidate, inputs)
        if refused is None:
            ep = candidate
            break
        notes.append(f"{refused}; exported on the example itself")  # the next attempt
    if ep is None:
        assert first_error is not None
        text = str(first_error).strip().splitlines()[0] if str(first_error).strip() else ""
        raise TraceFailure(
            f"Cannot capture {name} with torch.export either: {type(first_error).__name__}: {text[:300]}"
            f"{_where(first_error)}.",
            hint="torch.export needs forward() to run on example inputs of the right shape and dtype without "
            "Python side effects on tensor values; see the line above. Marking the failing part as a leaf "
            "(--leaf NAME) keeps the fx path.",
        ) from None
    if first_error is not None:
        notes.append(f"dynamic export failed first ({type(first_error).__name__}); shapes are specialised")
    exported = ep.module()
    gm = fx.GraphModule(exported, exported.graph, name)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(exported, attr):
            setattr(gm, attr, getattr(exported, attr))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    result = RaiseATen()(gm)
    gm = result.graph_module
    gm.train(False)
    notes += result.notes + [str(s) for s in result.skips]
    sizes = {n: tuple(x.shape) for n, x in zip(names, inputs) if isinstance(x, torch.Tensor)}
    info = CaptureInfo("torch.export", reason, _describe_dims(ep, names, sizes), notes)
    gm.meta[CAPTURE_META] = info
    _check_against_eager(model, gm, inputs)
    return gm


def _check_against_eager(model: nn.Module, gm: fx.GraphModule, inputs: tuple) -> None:
    from gml.outputs import same_outputs

    with torch.no_grad():
        ref = model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        try:
            got = gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        except Exception as exc:
            raise TraceFailure(
                f"The torch.export graph of {type(model).__name__} does not run on the example inputs: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                hint="report this with the model; --leaf keeps the torch.fx path.",
            ) from None
    same, worst = same_outputs(ref, got)
    scale = max(
        (
            float(t.abs().max())
            for t in torch.utils._pytree.tree_leaves(ref)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
        ),
        default=1.0,
    )
    if not same and worst > 1e-5 + 1e-4 * scale:
        raise TraceFailure(
            f"The torch.export graph of {type(model).__name__} differs from eager by {worst:.3g} on the example "
            "inputs (forward() has behaviour export did not record).",
            hint="report this with the model; --leaf keeps the torch.fx path.",
        )
