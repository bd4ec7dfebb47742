"""Save and load optimized models without the user's model source (ADR 004).

:func:`save` writes a ``torch.export`` program (``.pt2``): the optimized graph as ATen and oneDNN
ops, with the **dense** fp32 weights. Opaque prepacked oneDNN tensors have no storage and cannot be
serialized, so the fused modules emit their op with the dense weight while being exported
(``torch.compiler.is_compiling()``). The batch dimension is exported as dynamic when the graph
allows it.

:func:`load` reads it back through torch.export's deserializer after :mod:`gml.program_check` has
checked every field of the program (no pickle, and no name, expression or target that would make
torch.fx or sympy run code: ADR 004's 2026-11-27 amendment), takes the program's ``GraphModule``
and *lifts* every fused-kernel call whose weights are constants back into its GML module
(``_convolution_pointwise`` → :class:`~gml.kernels.fp32.FusedConv`, ...), which prepacks the
weights again for this machine on first call. Loading needs ``gml`` and ``torch``, never the
original model's Python code.

INT8 models (ADR 005) are graphs of ``torch.ops.gml.*`` calls with dense int8 weights as constants:
they export as they are (the ops have schemas and fake kernels) and need no lifting after loading,
because the ops' Python implementations prepack their weights on first call
(:mod:`gml.kernels.int8_ops`).

By default :func:`load` then compiles the graph for the native engine on this machine
(:func:`attach_loaded_runtime`; the file never holds a plan): see ADR 004's 2026-11-24 amendment
for what the archive holds and why nothing in it is pickled.

A pickled ``GraphModule`` (``format="pickle"``) is the escape hatch for graphs ``torch.export``
cannot take. Unpickling runs code from the file, so :func:`load` refuses it unless the caller passes
``trust_pickle=True``.
"""

from __future__ import annotations

import functools
import io
import json
import math
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from gml import archive
from gml.errors import GMLError, InputError, ModelLoadError
from gml.files import check_writable, write_atomically
from gml.inference import refuse_autograd, refuse_nonfinite
from gml.ir.library import SCHEMAS as INT8_SCHEMAS
from gml.ir.library import gml_op_name, schema_args
from gml.ir.target import Target
from gml.kernels import fp32 as k32
from gml.kernels.int8_ops import register as register_int8_ops
from gml.memory import MappedFile, returns_memory
from gml.nn import InputGuard, install_input_guard
from gml.passes.utils import replace_module
from gml.runtime.options import EngineOptions, resolve_options
from gml.runtime.rules.attention import mask_only_inputs

# v2: sealed (every member's SHA-256 in the manifest, gml.archive) and no pickled sample inputs.
FORMAT_EXPORT = "gml-export-v2"
FORMAT_PICKLE = "gml-pickle-v2"
_LEGACY_FORMATS = ("gml-export-v1", "gml-pickle-v1")

#: ``lifter(gm, node) -> nn.Module | None``: the module that computes ``node`` (a call of a kernel op
#: with constant weights) with its arguments ``node.args[0:k]`` (see :class:`Lift`), or ``None``.
Lifter = Callable[[fx.GraphModule, fx.Node], "Lift | None"]


class Lift:
    """A lifted node: ``module`` replaces the call, taking ``inputs`` (graph values) as arguments."""

    def __init__(self, module: nn.Module, inputs: Sequence[fx.Node], weight_target: str | None) -> None:
        self.module = module
        self.inputs = tuple(inputs)
        self.weight_target = weight_target


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


#: The most input elements a graph's declared shapes may add up to (512 MB of fp32): what the load
#: check and ``gml inspect`` allocate and run on. A hostile file declaring a width of 33,554,440 made
#: the load check allocate and convolve 1.6 G elements.
MAX_DECLARED_ELEMENTS = 1 << 27


def _taken_as_none(node: fx.Node) -> bool:
    """An input no node reads — traced as a constant (None, or an omitted ``flag=True``) and left
    without its ``val`` by the INT8 lowering, its guard gone with dead code: a graph that never
    reads an input runs alike on None — or one only capture's guard reads
    (gml.capture.input_is_none) with no shape to give it."""
    from gml.capture import input_is_none

    if not node.users:
        return True
    if "val" in node.meta or "tensor_meta" in node.meta:
        return False
    return all(u.op == "call_function" and u.target is input_is_none for u in node.users)


def placeholder_inputs(gm: fx.GraphModule, *, seed: int | None = None) -> tuple[torch.Tensor | None, ...]:
    """Inputs shaped like ``gm``'s placeholders: ``meta["val"]`` (a ``torch.export`` program, where a
    dynamic dimension is symbolic and becomes 1) or ``meta["tensor_meta"]`` (a captured graph).

    Zeros, or with ``seed`` standard-normal floats (integers stay zero): what a load-time check of
    the engine against the Python executor runs on. Raises :class:`GMLError` for a placeholder
    without shape metadata, :class:`ModelLoadError` for shapes of more than
    :data:`MAX_DECLARED_ELEMENTS` elements in all.
    """
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    metas: list[tuple[Any, tuple[int, ...]] | None] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if ("val" in node.meta and node.meta["val"] is None) or _taken_as_none(node):
            metas.append(None)  # an input the graph takes as None
            continue
        meta = node.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            meta = node.meta.get("tensor_meta")
        if meta is None:
            raise GMLError(
                f"input {node.name!r} has no shape metadata",
                hint="pass example_inputs=(x,) to gml.io.save, or capture the model with gml.capture(model, (x,))",
            )
        metas.append((meta, tuple(d if isinstance(d, int) else 1 for d in meta.shape)))
    tensors = [m for m in metas if m is not None]
    total = sum(math.prod(shape) for _, shape in tensors)
    if total > MAX_DECLARED_ELEMENTS:  # before a byte is allocated: a file's shapes are the author's to choose
        shapes = ", ".join(str(shape) for _, shape in tensors)
        raise ModelLoadError(
            f"the graph declares inputs of shape {shapes}: {total:,} elements, more than the "
            f"{MAX_DECLARED_ELEMENTS:,} a saved model may declare",
            hint="gml.io.save writes the example inputs' shapes: save the model again with a smaller example",
        )
    args: list[torch.Tensor | None] = []
    for spec in metas:
        if spec is None:
            args.append(None)
            continue
        meta, shape = spec
        if gen is not None and meta.dtype.is_floating_point:
            args.append(torch.randn(shape, generator=gen).to(meta.dtype))
        else:
            args.append(torch.zeros(shape, dtype=meta.dtype))
    return tuple(args)


def _input_specs(gm: nn.Module, example_inputs: Sequence[torch.Tensor] | None) -> list[dict[str, Any]] | None:
    """``[{"shape": [...], "dtype": "float32"}, ...]`` of the inputs, or None when unknown."""
    try:
        inputs = tuple(example_inputs) if example_inputs is not None else placeholder_inputs(gm)  # type: ignore[arg-type]
    except GMLError:
        return None
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        return None
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in inputs]


#: Integer example inputs of at most this many elements are recorded in the header (token ids and
#: attention masks; more is not needed to check a plan, and the header stays small).
CHECK_VALUES_MAX = 1 << 16
_CHECK_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "bfloat16": torch.bfloat16}
#: where a loaded graph keeps the inputs its load check runs on (``GraphModule.meta``)
CHECK_INPUTS_META = "gml_check_inputs"


def _check_inputs_json(example_inputs: Sequence[Any] | None) -> list[dict[str, Any] | None] | None:
    """The example inputs as the header records them for the load check: each input's shape and dtype,
    and an integer input's values (token ids, attention masks). The load check ran on seeded random
    floats and integer zeros before — an attention mask of zeros masks every key, a case the model
    never meets, and a loaded MiniLM was refused the engine for it (the engine and torch differ there)."""
    if example_inputs is None or not all(t is None or isinstance(t, torch.Tensor) for t in example_inputs):
        return None
    out: list[dict[str, Any] | None] = []
    for t in example_inputs:
        if t is None:  # a skipped positional parameter (an HF decoder's cache): null in the header
            out.append(None)
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _CHECK_DTYPES:
            return None
        entry: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype}
        if not t.dtype.is_floating_point:
            if t.numel() > CHECK_VALUES_MAX:
                return None
            entry["values"] = t.flatten().tolist()
        out.append(entry)
    return out


def _check_inputs_from_json(data: Any, gm: fx.GraphModule) -> tuple[torch.Tensor | None, ...]:
    """The load check's inputs from the header (:func:`_check_inputs_json`). The header is untrusted:
    ValueError names the first field that is not what save writes (count, keys, dtypes and ranks
    against the graph's inputs, static dims, sizes, the values' count, type and range)."""
    metas = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(data, list) or len(data) != len(metas):
        raise ValueError(f"check_inputs is not a list of {len(metas)} input(s)")
    gen = torch.Generator().manual_seed(0)
    total, out = 0, []
    for i, (entry, meta) in enumerate(zip(data, metas)):
        if entry is None or meta is None:  # an input the graph takes as None, and only such an input
            if entry is not None or meta is not None:
                raise ValueError(f"check_inputs[{i}] is None for a tensor input, or a tensor for a None one")
            out.append(None)
            continue
        if not isinstance(entry, dict) or not {"shape", "dtype"} <= set(entry) <= {"shape", "dtype", "values"}:
            raise ValueError(f"check_inputs[{i}] is not {{'shape', 'dtype'[, 'values']}}")
        shape, dtype = entry["shape"], _CHECK_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if not isinstance(meta, torch.Tensor) or dtype != meta.dtype:
            raise ValueError(f"check_inputs[{i}] has dtype {str(entry['dtype'])[:40]!r}, not the graph's input's")
        if (
            not isinstance(shape, list)
            or len(shape) != meta.dim()
            or not all(type(d) is int and 0 <= d < 1 << 31 for d in shape)
            or any(isinstance(m, int) and m != d for m, d in zip(meta.shape, shape))
        ):
            raise ValueError(f"check_inputs[{i}]'s shape is not one the graph's input {tuple(meta.shape)} takes")
        total += math.prod(shape)
        if total > MAX_DECLARED_ELEMENTS:
            raise ValueError(f"check_inputs add up to more than {MAX_DECLARED_ELEMENTS:,} elements")
        values = entry.get("values")
        if dtype.is_floating_point:
            if values is not None:
                raise ValueError(f"check_inputs[{i}] records values for a floating-point input")
            out.append(torch.randn(shape, generator=gen).to(dtype))
            continue
        info = torch.iinfo(dtype)
        if (
            not isinstance(values, list)
            or len(values) != math.prod(shape)
            or not all(type(v) is int and info.min <= v <= info.max for v in values)
        ):
            raise ValueError(f"check_inputs[{i}]'s values are not {math.prod(shape)} {entry['dtype']} integers")
        out.append(torch.tensor(values, dtype=dtype).reshape(shape))
    return tuple(out)


def _set_input_meta(gm: nn.Module, specs: Any) -> None:
    """Give a pickled graph's placeholders the input shapes its manifest records (meta tensors)."""
    if not isinstance(gm, fx.GraphModule) or not isinstance(specs, list):
        return
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(nodes) != len(specs):
        return
    for node, spec in zip(nodes, specs):
        dtype = getattr(torch, str(spec.get("dtype")), None) if isinstance(spec, dict) else None
        if isinstance(dtype, torch.dtype) and "val" not in node.meta and "tensor_meta" not in node.meta:
            node.meta["val"] = torch.empty([int(d) for d in spec["shape"]], dtype=dtype, device="meta")


def _export(gm: nn.Module, args: tuple, dynamic_batch: bool, all_dims: bool = False) -> tuple[Any, bool]:
    if all_dims and all(isinstance(a, torch.Tensor) for a in args):
        # every dim Dim.AUTO (a transformer: batch and sequence length): export keeps dynamic what the
        # graph allows and specializes the rest without failing
        auto = tuple({i: torch.export.Dim.AUTO for i in range(a.dim())} for a in args)
        # export specializes a dim whose example size is 1: a batch of 1 is traced as the example
        # twice (the example's own values, so a mask or ids stay valid), else the saved model would
        # run on batch 1 only
        wide = tuple(torch.cat([a, a]) if a.dim() > 0 and a.shape[0] == 1 else a for a in args)
        try:
            return torch.export.export(gm, wide, dynamic_shapes=auto, strict=False), True
        except Exception:  # fall back to the batch-only / static export below
            pass
    if dynamic_batch and all(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
        batch = torch.export.Dim("batch", min=1, max=4096)
        # export specializes a dimension whose example size is 1, so trace the dynamic one at 2
        wide = tuple(a.new_zeros((2, *a.shape[1:])) for a in args)
        try:
            return torch.export.export(gm, wide, dynamic_shapes=tuple({0: batch} for _ in args), strict=False), True
        except Exception:  # the graph specializes the batch (e.g. a reshape to a fixed size): go static
            pass
    return torch.export.export(gm, args, strict=False), False


def save(
    gm: nn.Module,
    path: str | Path,
    example_inputs: Sequence[torch.Tensor] | None = None,
    *,
    dynamic_batch: bool = True,
    format: str = "export",
    dynamic_dims: str = "batch",
) -> Path:
    """Save an optimized module so :func:`load` can rebuild it without the original source.

    ``format="export"`` (default) writes a ``torch.export`` program; ``"pickle"`` pickles the
    ``GraphModule`` (loading it then needs ``trust_pickle=True``). ``dynamic_dims="all"`` exports
    every input dim as ``Dim.AUTO`` (a transformer's batch *and* sequence length; where the graph
    specializes a dim it stays static) instead of the batch alone. Returns the path written.
    """
    if dynamic_dims not in ("batch", "all"):
        raise GMLError(f"unknown dynamic_dims {dynamic_dims!r}", hint="use 'batch' or 'all'")
    path = Path(path)
    check_writable(path)  # before the export: a place that cannot take the file fails now, not after it
    if format == "pickle":
        header: dict[str, Any] = {"format": FORMAT_PICKLE, "torch": torch.__version__}
        specs = _input_specs(gm, example_inputs)
        if specs is not None:  # JSON, so load can compile the engine's plan for the graph's inputs
            header["inputs"] = specs
        _write_sealed(path, lambda f: torch.save({"gml_format": FORMAT_PICKLE, "module": gm}, f), header)
        return path
    if format != "export":
        raise GMLError(f"unknown save format {format!r}", hint="use format='export' or format='pickle'")
    given = example_inputs
    if example_inputs is None:
        if not isinstance(gm, fx.GraphModule):
            raise GMLError("cannot save: no example inputs", hint="pass example_inputs=(x,)")
        example_inputs = placeholder_inputs(gm)
    args = tuple(example_inputs)
    k32.register_export_support()
    register_int8_ops()  # the torch.ops.gml schemas (INT8 graphs) export through their fake kernels
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            ep, dynamic = _export(gm, args, dynamic_batch, all_dims=dynamic_dims == "all")
    except Exception as e:
        raise GMLError(
            f"torch.export could not capture the optimized model: {type(e).__name__}: {str(e).splitlines()[0]}",
            hint="save(..., format='pickle') writes a pickled GraphModule instead (loading it needs trust_pickle=True)",
        ) from e
    finally:
        gm.train(was_training)
    # torch pickles the example inputs into the archive; a loader could not tell them from a payload
    ep._example_inputs = None
    header = {"format": FORMAT_EXPORT, "torch": torch.__version__, "dynamic_batch": dynamic}
    # the export traces through the capture's InputGuard (Python, no graph op): the shapes the graph
    # is specialised to go in the header, and load() puts the guard back
    guard = next((m for m in gm.modules() if isinstance(m, InputGuard)), None)
    if guard is not None:
        header["input_guard"] = guard.to_json()
    check = _check_inputs_json(given)  # the caller's example only: placeholders hold zeros
    if check is not None:  # what load's check of the engine runs on: the example, not zeros
        header["check_inputs"] = check
    _write_sealed(path, lambda f: torch.export.save(ep, f), header)
    return path


def _write_sealed(path: Path, serialize: Callable[[Any], None], header: dict[str, Any]) -> None:
    """``serialize(file object)``, sealed with ``header``, written to ``path`` atomically. torch's zip
    writer is given an in-memory buffer: on a full disk it aborts the process (SIGABRT, issue #24)
    instead of raising, so the bytes reach the disk through Python's file I/O, which raises, and
    :func:`gml.files.write_atomically` leaves no partial file."""
    buffer = io.BytesIO()
    serialize(buffer)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
        archive.seal(tmp, header)

    write_atomically(path, write, what="saved model")


# --------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------


def _const(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    if node is None:
        return None
    if (  # a Conv1d's weight as its 2-D call takes it (FusedConv's export form): W.unsqueeze(2)
        isinstance(node, fx.Node)
        and node.target is torch.ops.aten.unsqueeze.default
        and len(node.args) == 2
        and node.args[1] == 2
        and not node.kwargs
    ):
        weight = _const(gm, node.args[0])
        if weight is None or weight.dim() != 3:
            raise _NotConst
        return weight.unsqueeze(2)
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return value if isinstance(value, torch.Tensor) else None
    raise _NotConst


def _weight_target(node: fx.Node) -> str:
    """The attribute a kernel call's weight comes from (through a Conv1d's ``unsqueeze``)."""
    if node.target is torch.ops.aten.unsqueeze.default and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return str(node.target)


class _NotConst(Exception):
    pass


def _static_shape(node: fx.Node) -> list[int] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return [s if isinstance(s, int) else 1 for s in val.shape]  # symbolic batch: pack for one row


def _post_op(attr: str, scalars: Sequence[Any], algorithm: str | None) -> k32.PostOp:
    return k32.PostOp(attr, tuple(float(s) for s in scalars if s is not None), algorithm or "")


def _twin(cls: type, weight: torch.Tensor) -> Any:
    """The module class for a kernel's weight: the bf16 twin (gml.kernels.bf16) for a bf16 weight."""
    if weight.dtype == torch.bfloat16:
        from gml.kernels import bf16 as kb

        return kb.BF16_TWINS[cls]
    return cls


def _conv_window(x: fx.Node, pad: Any, stride: Any, dil: Any, groups: Any) -> dict[str, Any]:
    """A oneDNN fp32 conv call's geometry arguments (and its input's static shape) as the fused conv
    modules' constructor arguments."""
    return {"stride": stride, "padding": pad, "dilation": dil, "groups": groups, "input_size": _static_shape(x)}


def lift_fp32(gm: fx.GraphModule, node: fx.Node) -> Lift | None:
    """Lifter for the oneDNN fp32 ops :mod:`gml.kernels.fp32` emits."""
    mk = torch.ops.mkldnn
    lifted = (mk._convolution_pointwise.default, mk._convolution_pointwise.binary, mk._linear_pointwise.default)
    if node.target not in lifted:
        return None
    args = tuple(schema_args(node).values())  # positional or keyword, as the file passed them
    try:
        if node.target == mk._convolution_pointwise.default:
            x, w, b, pad, stride, dil, groups, attr, scalars, algo = args
            weight, bias = _const(gm, w), _const(gm, b)
            if weight is None:
                return None
            mod = _twin(k32.FusedConv, weight)(
                weight, bias, post_op=_post_op(attr, scalars, algo), **_conv_window(x, pad, stride, dil, groups)
            )
            return Lift(mod, (x,), _weight_target(w))
        if node.target == mk._convolution_pointwise.binary:
            x, other, w, b, pad, stride, dil, groups, binary, alpha, unary, _, _ = args
            weight, bias = _const(gm, w), _const(gm, b)
            if weight is None or binary != "add" or alpha not in (None, 1) or unary not in (None, "relu"):
                return None
            mod = _twin(k32.FusedConvAdd, weight)(
                weight, bias, relu=unary == "relu", **_conv_window(x, pad, stride, dil, groups)
            )
            return Lift(mod, (x, other), _weight_target(w))
        if node.target == mk._linear_pointwise.default:
            x, w, b, attr, scalars, algo = args
            weight, bias = _const(gm, w), _const(gm, b)
            if weight is None:
                return None
            shape = _static_shape(x)
            rows = int(torch.tensor(shape[:-1]).prod()) if shape else None
            mod = _twin(k32.FusedLinear, weight)(weight, bias, post_op=_post_op(attr, scalars, algo), rows=rows)
            return Lift(mod, (x,), _weight_target(w))
    except _NotConst:
        return None
    return None


DEFAULT_LIFTERS: tuple[Lifter, ...] = (lift_fp32,)


def _owner_path(weight_target: str | None) -> str | None:
    if weight_target is None or not weight_target.endswith(".weight"):
        return None
    return weight_target[: -len(".weight")]


def _delete_attr(gm: fx.GraphModule, target: str) -> None:
    parent_name, _, attr = target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    if hasattr(parent, attr):
        delattr(parent, attr)


def lift_kernels(gm: fx.GraphModule, lifters: Sequence[Lifter] = DEFAULT_LIFTERS) -> int:
    """Replace kernel-op calls with constant weights by their GML modules; returns how many.

    The new module takes the dotted path of the weight's owner when that path is free after the
    old constants are dropped (so ``state_dict`` keys survive a save/load round trip).
    """
    lifted = 0
    dead_attrs: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        lift = next((r for r in (f(gm, node) for f in lifters) if r is not None), None)
        if lift is None:
            continue
        consts = [a for a in node.all_input_nodes if a.op == "get_attr"]
        views = [a for a in node.all_input_nodes if a.target is torch.ops.aten.unsqueeze.default]  # a Conv1d's W
        name = _owner_path(lift.weight_target) or f"lifted_{lifted}"
        placeholder = f"_gml_lift_{lifted}"
        gm.add_submodule(placeholder, lift.module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(placeholder, lift.inputs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for v in views:
            if not v.users:
                consts += [a for a in v.all_input_nodes if a.op == "get_attr"]
                gm.graph.erase_node(v)
        for c in consts:
            if not c.users:
                dead_attrs.add(str(c.target))
                gm.graph.erase_node(c)
        new._gml_name = name  # type: ignore[attr-defined]
        lifted += 1
    for target in dead_attrs:
        _delete_attr(gm, target)
    # Move each lifted module to its owner's path when that container is now empty.
    for node in gm.graph.nodes:
        name = getattr(node, "_gml_name", None)
        if name is None:
            continue
        mod = gm.get_submodule(str(node.target))
        try:
            old = gm.get_submodule(name)
        except AttributeError:
            old = None
        if old is not None and _is_empty(old):
            replace_module(gm, name, mod)
            delattr(gm, str(node.target))
            node.target = name
        del node._gml_name
    _set_inplace_residuals(gm)
    gm.graph.lint()
    gm.recompile()
    return lifted


def _is_empty(mod: nn.Module) -> bool:
    return (
        not any(True for _ in mod.children())
        and not any(True for _ in mod.parameters())
        and not any(True for _ in mod.buffers())
    )


def _set_inplace_residuals(gm: fx.GraphModule) -> None:
    """Re-enable in-place residual accumulation where it is safe (the rule of FuseConvAdd)."""
    from gml.ir.alias import may_alias
    from gml.passes.fuse_common import fresh_output_types, graph_order

    order = graph_order(gm)
    modules = dict(gm.named_modules())
    fresh = fresh_output_types()
    aten = torch.ops.aten
    fresh_ops = {aten.max_pool2d.default, aten.avg_pool2d.default, aten.add.Tensor, aten._add_relu.Tensor}
    for node in gm.graph.nodes:
        mod = modules.get(str(node.target)) if node.op == "call_module" else None
        if not isinstance(mod, k32.FusedConvAdd):
            continue
        other = node.args[1]
        if not isinstance(other, fx.Node):
            continue
        made_fresh = (other.op == "call_module" and isinstance(modules.get(str(other.target)), fresh)) or (
            other.op == "call_function" and other.target in fresh_ops
        )
        if not made_fresh or may_alias(node.args[0], other, modules):
            continue
        if all(u is node or order[u] < order[node] for u in other.users):
            mod.inplace = True


@returns_memory
def load(
    path: str | Path,
    *,
    runtime: str = "engine",
    trust_pickle: bool = False,
    lift: bool = True,
    lifters: Sequence[Lifter] = DEFAULT_LIFTERS,
    target: Target | None = None,
    options: EngineOptions | None = None,
    graph: bool = False,
) -> Any:
    """Load a module written by :func:`save` and rebuild it for this machine (``target``: the
    :class:`~gml.ir.target.Target` to plan for; default: this process's, detected once here;
    ``options``: the engine's switches, :class:`~gml.runtime.options.EngineOptions`; default: the
    ``GML_*`` variables', read here).

    Before anything is deserialized the archive is checked (:mod:`gml.archive`): every member
    against its recorded SHA-256 (a damaged file is refused), and a ``torch.export`` file member by
    member (anything torch would unpickle is refused). ``trust_pickle=True`` is required for
    ``format="pickle"`` files and for files of older gml versions: unpickling runs code from the
    file. ``lift=False`` keeps the exported program's fp32 oneDNN calls as they are (dense
    weights, slower); with ``lift=True`` they become GML's fused modules again.

    ``runtime="engine"`` (default) compiles the graph for the native engine (:mod:`gml.runtime`) on
    this machine — oneDNN primitives and weight layouts for this CPU, a plan for the file's input
    shape now and for other shapes on their first call — and checks its outputs against the
    Python executor's on seeded random inputs, as :func:`gml.quantize` does; the result is then an
    :class:`~gml.runtime.EngineModule`. Where the engine is unavailable, covers no node or
    disagrees, and with ``runtime="torch"``, the result is the ``GraphModule`` (the Python
    executor). Either way ``result.runtime`` is the report saying which path runs each node.

    A file ``lm.save`` wrote (a decoder LLM, :mod:`gml.llm.store`) loads as a
    :class:`gml.llm.api.LLM` with its kernels chosen for ``target``; ``graph=True`` (callers that need a
    graph: ``gml inspect`` / ``bench`` / ``run``) refuses it with a message naming ``gml generate``.
    """
    from gml.runtime.select import check_runtime

    check_runtime(runtime)
    options = resolve_options(options)
    gm, mapped = _load_module(Path(path), trust_pickle, lift, lifters, target)
    if not isinstance(gm, nn.Module):  # an LLM file (lm.save): gml.llm's LLM, which has no graph to plan
        if graph:
            raise ModelLoadError(
                f"{path} is a decoder LLM saved by lm.save: it has no graph for this command",
                hint=f"generate with it: gml generate {path} --prompt-ids 1,2,3 (in Python: gml.load(path))",
            )
        return gm
    try:
        module = attach_loaded_runtime(gm, runtime, target, options)
    except GMLError:
        raise
    except Exception as e:  # the graph fails on the input shapes it declares itself
        raise ModelLoadError(
            f"{path} does not run on the input shapes it declares: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            hint="the file is inconsistent (altered, or written by another tool): save the model again with gml",
        ) from e
    if mapped is not None and module is not gm:
        # the engine runs the graph on its own reordered copy of the weights: the graph's (pages of the
        # mapped file, read by the engine's build and check) are read again only if the Python executor runs
        mapped.page_out()
    return module


def attach_loaded_runtime(
    gm: nn.Module, runtime: str = "engine", target: Target | None = None, options: EngineOptions | None = None
) -> nn.Module:
    """``gm`` run by the native engine where it covers the graph and agrees (see :func:`load`), else
    ``gm``; the module returned carries the :class:`~gml.runtime.RuntimeReport` as ``.runtime``."""
    from gml.runtime.compile import RuntimeReport
    from gml.runtime.select import attach_runtime
    from gml.runtime.target import resolve

    target = resolve(target)
    if not isinstance(gm, fx.GraphModule):
        report = RuntimeReport(
            "torch", note=f"a pickled {type(gm).__name__}, not a graph: torch runs it", target=target
        )
        gm.runtime = report
        return gm
    from gml.quant.retarget import retarget_weights

    # INT8 weights saved on a VNNI/AMX machine are requantized where this target's kernels could
    # saturate (gml.quant.retarget): the Python executor and the engine then both compute exactly
    changes = retarget_weights(gm, target)
    if changes:
        gm.recompile()
    try:  # the example save recorded (gml.io._check_inputs_json), else the declared shapes
        inputs = gm.meta.get(CHECK_INPUTS_META) or placeholder_inputs(gm, seed=0)
    except ModelLoadError:  # shapes no model is saved with
        raise
    except GMLError as e:  # a pickled graph saved without example inputs: nothing to compile a plan for
        note = f"no input shapes to compile the engine for ({e.message}; save with example_inputs=(x,))"
        engine, report = None, RuntimeReport("torch", note=note, target=target)
    else:
        fp32 = _float_proxy(gm)
        engine, report = attach_runtime(gm, inputs, runtime, target=target, options=options, fp32_model=fp32)
    report.changes = changes
    if engine is None and gm.meta.get(CHECK_INPUTS_META):
        _runs_on_its_example(gm, gm.meta[CHECK_INPUTS_META])
    module: nn.Module = engine if engine is not None else gm
    refuse_autograd(gm)  # the engine applies the same rule itself (gml.inference)
    if any(gml_op_name(n) in INT8_SCHEMAS for n in gm.graph.nodes):  # an INT8 graph: no NaN / Inf inputs
        masks = mask_only_inputs(gm)  # (an attention mask's -inf is a value)
        refuse_nonfinite(gm, masks)
        if engine is not None:
            refuse_nonfinite(engine, masks)
    module.runtime = report
    return module


def _runs_on_its_example(gm: fx.GraphModule, example: Sequence[Any]) -> None:
    """:class:`ModelLoadError` unless the loaded program runs on the example it was saved with (the
    header's shapes and integer values, seeded floats). ``save`` exported it on that example, so a
    failure there means the file was edited (a conv's padding changed, the example's shapes
    rewritten) with the manifest re-sealed: before, such a file loaded on the torch path and the
    first call raised torch's own error (``The size of tensor a (8) must match ...``). Checked where
    no engine was built: the engine's build runs the program on the same inputs."""
    from gml.ir.values import cloned
    from gml.runtime.compile import run_first_call

    try:
        with torch.no_grad():
            run_first_call(gm, cloned(example))
    except InputError as e:
        raise ModelLoadError(
            f"the saved program does not run on the inputs it was saved with: {e.message}",
            hint="gml.io.save exports the program on those inputs: the file was altered after saving; "
            "save the model again",
        ) from e


def _float_proxy(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` with every INT8 op in float (:mod:`gml.kernels.float_int8`: weights dequantized, no
    activation rounding), or None where it has none. ``gml.quantize`` lets the engine differ from
    the Python executor beyond INT8 rounding when it is as close to the fp32 model (rounding flips
    after float ops that round differently); a file has no fp32 model, and without one the load
    check refused the engine for a real MiniLM (pooler output 0.016 of 0.19 apart) and for a timm
    efficientnet_b1 (0.09 of the range): this graph stands in for it."""
    from gml.kernels.float_int8 import FLOAT
    from gml.runtime.compile import copy_graph

    if not any(gml_op_name(n) in FLOAT for n in gm.graph.nodes):
        return None
    graph = copy_graph(gm.graph)
    for node in graph.nodes:
        name = gml_op_name(node)
        if name in FLOAT:
            node.target = FLOAT[name]
    return fx.GraphModule(gm, graph)


def is_saved_model(spec: str | Path) -> bool:
    """Whether ``spec`` names a file for :func:`load`: a ``.pt2`` file, or any zip archive sealed by
    :func:`save` (the CLI's MODEL argument: ``gml inspect model.pt2``, ``gml bench model.pt2``)."""
    p = Path(spec)
    if not p.is_file():
        return False
    if p.suffix == ".pt2":
        return True
    try:
        with zipfile.ZipFile(p) as z:
            return any(n.endswith("/" + archive.MANIFEST) for n in z.namelist())
    except archive.ZIP_ERRORS:
        return False


def _load_module(
    path: Path, trust_pickle: bool, lift: bool, lifters: Sequence[Lifter], target: Target | None = None
) -> tuple[Any, MappedFile | None]:
    """The module a file holds, and the file mapping its weights are views of (an export file's)."""
    if not path.exists():
        raise ModelLoadError(f"no such file: {path}", hint="check the path given to gml.io.load")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a saved model", hint="give the .pt2 file gml.io.save wrote")
    sealed = archive.open_sealed(path)
    fmt = sealed.header.get("format") if sealed is not None else None
    if fmt == FORMAT_EXPORT:
        return _load_export(path, sealed, lift, lifters)
    from gml.llm.api import load_llm
    from gml.llm.store import FORMAT as FORMAT_LLM

    if fmt == FORMAT_LLM:  # lm.save: a decoder LLM's spec and weights, no graph
        return load_llm(path, sealed=sealed, target=target), None
    if fmt not in (FORMAT_PICKLE, None):
        raise ModelLoadError(
            f"{path} has gml format {fmt!r}, which this gml does not read",
            hint=f"this gml reads {FORMAT_EXPORT} and {FORMAT_PICKLE}; save the model again with this version",
        )
    # A pickled gml model, or a file without a manifest (older gml, or not gml at all).
    if not trust_pickle:
        what = "a pickled model" if fmt == FORMAT_PICKLE or archive.looks_pickled(path) else "not sealed by gml.io.save"
        raise ModelLoadError(
            f"{path} was refused: it is {what}, and unpickling runs code from the file",
            hint="if you wrote it with gml.io.save(..., format='pickle') (or an older gml) and trust it, "
            "call gml.io.load(path, trust_pickle=True)",
        )
    gm = _load_trusted(path, lift, lifters)
    _set_input_meta(gm, sealed.header.get("inputs") if sealed is not None else None)
    return gm, None


def _load_export(
    path: Path, sealed: archive.Sealed, lift: bool, lifters: Sequence[Lifter]
) -> tuple[fx.GraphModule, MappedFile]:
    from gml.ir.checks import graph_problems

    k32.register_export_support()
    register_int8_ops()  # an INT8 program calls torch.ops.gml.*: define them and their kernels
    try:
        # every field checked (the gml ops it names are defined, a transformers ModelOutput's module
        # imported by its fixed name: gml.program_check) before torch builds anything from it (gml.program_check)
        ep, mapped = archive.read_export_program(sealed)
        gm = ep.module()
    except GMLError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"could not read the exported program {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            hint=f"it was written with torch {sealed.header.get('torch')}; load it with the same torch version",
        ) from e
    problems = graph_problems(gm)
    if problems:
        raise ModelLoadError(
            f"{path} was refused: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
            hint="gml.io.save never writes such an argument: the file was not written by gml, or was altered",
        )
    _plain_output_containers(gm)
    check = sealed.header.get("check_inputs")
    if check is not None:
        try:
            gm.meta[CHECK_INPUTS_META] = _check_inputs_from_json(check, gm)
        except ValueError as e:
            raise ModelLoadError(
                f"{path} was refused: {e}", hint="gml.io.save never writes such a header: the file was altered"
            ) from e
    _check_inputs_first(gm)
    guard = sealed.header.get("input_guard")
    if guard is not None:  # the shapes the graph is specialised to (save): other shapes are refused again
        try:
            install_input_guard(gm, InputGuard.from_json(guard, sum(n.op == "placeholder" for n in gm.graph.nodes)))
        except ValueError as e:
            raise ModelLoadError(
                f"{path} was refused: {e}", hint="gml.io.save never writes such a header: the file was altered"
            ) from e
    if lift:
        try:
            lift_kernels(gm, lifters)
        except (ValueError, TypeError, RuntimeError) as e:  # a fused call whose arguments its kernel refuses
            raise ModelLoadError(
                f"{path} was refused: a fused kernel call does not build: {type(e).__name__}: {str(e)[:200]}",
                hint="gml.io.save never writes such a call: the file was not written by gml, or was altered",
            ) from e
        try:
            raise_exported_ops(gm)
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise ModelLoadError(  # a call with other arguments than its op takes: written by hand
                f"{path} was refused: a call does not read as the op it names: {type(e).__name__}: {str(e)[:200]}",
                hint="gml.io.save never writes such a call: the file was not written by gml, or was altered",
            ) from e
    return gm, mapped


def raise_exported_ops(gm: fx.GraphModule) -> None:
    """The vocabulary the engine's rules read, back in ``gm`` (in place): ``torch.export`` wrote the
    optimized graph's modules as ATen calls (an ``nn.Linear`` the fusions left, ``nn.LayerNorm``,
    ``gml.nn.Add``, ``nn.GELU``, views as ``aten.view``), which the engine would leave to torch — a
    loaded BERT ran in 4 engine segments with 58 torch nodes instead of one plan. The two capture
    passes that made that vocabulary from an exported program (:class:`RaiseATen`, then
    :class:`Normalize`) do it again; each replacement runs the very op it replaces (bit-exact)."""
    from gml.passes.normalize import Normalize
    from gml.passes.raise_aten import RaiseATen

    _raise_bf16_casts(gm)
    for graph_pass in (RaiseATen(), Normalize()):
        graph_pass(gm)


def _raise_bf16_casts(gm: fx.GraphModule) -> None:
    """``aten.to.dtype(x, bfloat16)`` of an fp32 ``x`` (and back) → the bf16 pass's casts
    (:func:`gml.kernels.bf16.to_bf16` / ``to_fp32``, one reorder step each in the engine). A bf16 file
    holds them as ATen calls: a loaded BERT bf16 ran as 6 engine segments instead of 1."""
    from gml.kernels import bf16

    casts = {(torch.float32, torch.bfloat16): bf16.to_bf16, (torch.bfloat16, torch.float32): bf16.to_fp32}
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.to.dtype or node.kwargs or len(node.args) != 2:
            continue
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        cast = casts.get((getattr(src, "dtype", None), node.args[1]))
        if cast is not None:
            node.target, node.args = cast, (node.args[0],)
    gm.recompile()


def _check_inputs_first(gm: fx.GraphModule) -> None:
    """Wrong inputs to a loaded program are an :class:`InputError` on the torch path too: torch.export's
    input-constraint pre-hook (a ``RuntimeError`` / ``ValueError`` naming ``*args[0].shape[2]``) is
    replaced, in place, by one that checks the inputs as the engine does first
    (:func:`~gml.runtime.compile.check_inputs`) and names the shapes when a constraint fails."""
    from torch.export._unlift import _check_input_constraints_pre_hook

    from gml.runtime.compile import placeholder_expectations

    hooks = gm._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if hook is _check_input_constraints_pre_hook:
            hooks[key] = functools.partial(_checked_constraints, placeholder_expectations(gm), hook)


def _checked_constraints(expect: Any, hook: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    from gml.runtime.compile import RUN_ERRORS, cannot_run, check_inputs

    if expect is not None and not kwargs:
        check_inputs(expect, args)
    try:
        return hook(module, args, kwargs)
    except RUN_ERRORS as e:
        guard = getattr(module, "input_guard", None)
        if isinstance(guard, InputGuard):  # the capture's own words for shapes it specialised to
            guard(*args)
        raise cannot_run(args, e) from e


def _plain(value: Any) -> Any:
    if isinstance(value, dict):  # fx's immutable_dict / immutable_list subclass dict / list
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value


def _plain_output_containers(gm: fx.GraphModule) -> None:
    """Outputs come back as the containers the model returned, not fx's immutable ones.

    Exporting a GraphModule records its output structure with fx's ``immutable_dict`` /
    ``immutable_list`` types, so ``ep.module()`` would hand the caller containers that refuse
    assignment; rebuild the output spec from plain dicts and lists.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.out_spec is None:
        return
    sample = pytree.tree_unflatten(list(range(info.out_spec.num_leaves)), info.out_spec)
    gm.graph._codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(_plain(sample)))
    gm.recompile()  # GraphModule.recompile copies the spec into ``_out_spec``, which the code reads


def _load_trusted(path: Path, lift: bool, lifters: Sequence[Lifter]) -> fx.GraphModule:
    """The opted-in path: a pickled gml model, or an export file of an older gml (its sample inputs are pickled)."""
    try:
        with zipfile.ZipFile(path) as z:
            legacy = next((n for n in z.namelist() if n.endswith("extra/gml.json")), None)
            legacy_info = json.loads(z.read(legacy)) if legacy else None
    except archive.ZIP_ERRORS as e:
        raise ModelLoadError(f"{path} is damaged: the zip archive does not parse ({e})") from e
    if legacy_info is not None and legacy_info.get("format") == _LEGACY_FORMATS[0]:
        k32.register_export_support()
        register_int8_ops()
        try:
            gm = torch.export.load(path).module()  # trusted by the caller: not checked field by field
        except Exception as e:
            raise ModelLoadError(f"could not read the exported program {path}: {type(e).__name__}: {e}") from e
        _plain_output_containers(gm)
        if lift:
            lift_kernels(gm, lifters)
        return gm
    try:
        blob = torch.load(path, weights_only=False)
    except Exception as e:
        raise ModelLoadError(f"could not read {path}: {type(e).__name__}: {e}") from e
    if not (isinstance(blob, dict) and blob.get("gml_format") in (FORMAT_PICKLE, _LEGACY_FORMATS[1])):
        raise ModelLoadError(f"{path} is not a file written by gml.io.save", hint="re-save it with gml.io.save")
    return blob["module"]


__all__ = [
    "DEFAULT_LIFTERS",
    "FORMAT_EXPORT",
    "FORMAT_PICKLE",
    "Lift",
    "Lifter",
    "attach_loaded_runtime",
    "is_saved_model",
    "lift_fp32",
    "lift_kernels",
    "load",
    "placeholder_inputs",
    "save",
]
