"""RaiseATen: turn a ``torch.export`` graph of ATen ops into the graph the GML passes read (ADR 001).

``torch.export`` records every op as an ATen overload (``aten.linear.default``) reading its weights
through ``get_attr``. The GML passes match module types (``nn.Linear``) and the torch-level spellings
:mod:`gml.passes.oplib` knows (``torch.relu``, ``x.view(...)``). This pass raises the ATen graph to
that vocabulary, one node kind per op, so the same pipeline serves both capture paths.

Before → after (``W``, ``b``, ... are ``get_attr`` constants; the module is installed under the name
of the module that made the call, taken from export's ``nn_module_stack``, e.g.
``encoder.layer.0.attention.self.query``)::

    aten.linear(x, W, b)                                  →  nn.Linear(x)        (sharing W, b)
    aten.addmm(b, x, W) (HF GPT-2's Conv1D: W is [in, out]) →  nn.Linear(x)        (weight Wᵀ, a view)
    aten.conv{1,2,3}d(x, W, b, stride, pad, dil, groups)  →  nn.Conv{1,2,3}d(x)
    aten.layer_norm(x, shape, W, b, eps)                  →  nn.LayerNorm(x)
    aten.embedding(W, ids, padding_idx)                   →  nn.Embedding(ids)
    aten.batch_norm(x, W, b, mean, var, False, m, eps)    →  nn.BatchNorm{1,2,3}d(x)  (running statistics)
    aten.relu / gelu / tanh / sigmoid / silu / hardswish / hardtanh / leaky_relu  →  torch.relu / F.gelu / ...
                                                             (Normalize makes modules)
    aten.pad(x, pads, mode, value)                         →  F.pad (FoldPad folds a constant zero pad into a conv)
    aten.add.Tensor / mul / sub / div / matmul / bmm / softmax / dropout / flatten / mean.dim / SDPA  →  torch.* / F.*
    aten.max_pool2d / avg_pool2d / adaptive_avg_pool2d                →  torch.max_pool2d / F.avg_pool2d / ...
    aten.view / reshape / permute / transpose / unsqueeze / expand / contiguous  →  x.view(...) etc.
    aten.add_ / sub_ / mul_ (Tensor), aten.relu_           →  x.add_(y) etc. (Normalize makes them out of place)
    aten.alias(x)                                         →  x (the same tensor: a view with x's sizes and strides)
    aten.to.dtype(x, d) / type_as(x, y), x already of d / y's dtype  →  x (torch returns x itself)
    div(x, expand_as(clamp_min(linalg_vector_norm(x, p, [d], True), eps), x))  →  F.normalize(x, p, d, eps)
                                                             (F.normalize as export writes it out: the
                                                             very ops F.normalize runs; XCiT, EdgeNeXt,
                                                             embedding heads)
    aten._assert_tensor_metadata(...)                     →  removed (a check with no result; it would
                                                             count as a reader of its input and block fusions)
    pure calls whose result nobody reads                  →  removed (export keeps nn.MultiheadAttention's
                                                             averaged weights when the caller drops them)

Every replacement runs the very ATen op it replaces (``nn.Linear.forward`` is ``F.linear``, which is
``aten.linear``), so the rewrite is bit-exact (tolerance 0).

Skipped, with the reason: a weight-carrying op whose weight or bias is computed at run time (not a
``get_attr`` constant: "weight or bias is computed, not a constant"), batch norm with batch
statistics, an embedding with training options. Ops with no entry here (``aten.slice``,
``aten.gather``, transposed convs, ...) stay ATen calls, counted in the notes; they run as they are.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from gml.passes.base import GraphPass, PassResult, Skip, Tolerance
from gml.passes.utils import modules_of

aten = torch.ops.aten

#: ATen overload → the torch-level function with the same positional signature.
FUNCTIONS: dict[Any, Callable] = {
    aten.relu.default: torch.relu,
    aten.gelu.default: F.gelu,
    aten.tanh.default: torch.tanh,
    aten.sigmoid.default: torch.sigmoid,
    aten.silu.default: F.silu,
    aten.hardswish.default: F.hardswish,
    aten.hardsigmoid.default: F.hardsigmoid,
    aten.hardtanh.default: F.hardtanh,  # ReLU6 (HF MobileNetV2): a conv's post-op once Normalize made it a module
    aten.leaky_relu.default: F.leaky_relu,
    aten.neg.default: torch.neg,  # rotary embeddings' rotate_half (Llama, Qwen2, ...): Normalize makes it MulScalar(-1)
    aten.pad.default: F.pad,  # HF's tf_padding, fixed by export: FoldPad makes it the conv's padding
    aten.add.Tensor: torch.add,
    aten.sub.Tensor: torch.sub,
    aten.mul.Tensor: torch.mul,
    aten.div.Tensor: torch.div,
    aten.matmul.default: torch.matmul,
    aten.bmm.default: torch.bmm,
    aten.softmax.int: torch.softmax,
    aten.dropout.default: torch.dropout,
    aten.flatten.using_ints: torch.flatten,
    aten.cat.default: torch.cat,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    aten.adaptive_avg_pool2d.default: F.adaptive_avg_pool2d,
    aten.mean.dim: torch.mean,  # squeeze-excite's spatial mean: Normalize makes it a pool
    aten.max_pool2d.default: torch.max_pool2d,
    aten.avg_pool2d.default: F.avg_pool2d,  # DenseNet's transitions (a loaded file ran them in torch)
}

#: ATen view/shape overload → the tensor method of the same signature.
METHODS: dict[Any, str] = {
    aten.view.default: "view",
    aten.reshape.default: "reshape",
    aten.permute.default: "permute",
    aten.transpose.int: "transpose",
    aten.unsqueeze.default: "unsqueeze",
    aten.squeeze.dim: "squeeze",
    aten.expand.default: "expand",
    aten.contiguous.default: "contiguous",
    # in-place arithmetic (HF ResNet's ``hidden_state += residual`` in an export graph): Normalize
    # makes it out of place where it can prove no one else sees the write
    aten.add_.Tensor: "add_",
    aten.sub_.Tensor: "sub_",
    aten.mul_.Tensor: "mul_",
    aten.relu_.default: "relu_",
}

_CHECKS = (aten._assert_tensor_metadata.default,)
#: a view with the input's own sizes and strides (export writes one for ``x[:]`` / an identity
#: slice: a loaded GhostNet ran 32 of them in torch, splitting its plan into 33 segments)
_ALIASES = (aten.alias.default,)
_CONVS = {
    aten.conv1d.default: nn.Conv1d,
    aten.conv2d.default: nn.Conv2d,
    aten.conv3d.default: nn.Conv3d,
    aten.conv1d.padding: nn.Conv1d,
    aten.conv2d.padding: nn.Conv2d,
    aten.conv3d.padding: nn.Conv3d,
}


def _const(gm: fx.GraphModule, node: Any) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, or a piece of one a split or a slice takes (a view of
    it: ``nn.MultiheadAttention``'s cross-attention splits its packed ``in_proj_weight`` into the query
    and key / value weights); ``None`` for anything computed (or ``None`` itself)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target in _SPLITS:
            whole = _const(gm, src.args[0])
            if whole is None or any(isinstance(a, fx.Node) for a in (*src.args[1:], *src.kwargs.values())):
                return None
            pieces = src.target(whole, *src.args[1:], **src.kwargs)
            return pieces[node.args[1]] if -len(pieces) <= node.args[1] < len(pieces) else None
        return None
    if node.op == "call_function" and node.target is aten.slice.Tensor:
        whole = _const(gm, node.args[0])
        if whole is None or any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        return node.target(whole, *node.args[1:], **node.kwargs)
    if node.op != "get_attr":
        return None
    value = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


#: ATen splits whose pieces are views of their input
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default, aten.unbind.int)


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def _owner(node: fx.Node, expected: type[nn.Module]) -> str | None:
    """The dotted name of the module that made this call, if export recorded it and it has this type."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, type_name = list(stack.values())[-1]
    cls = expected.__module__ + "." + expected.__qualname__
    return path if path and type_name == cls else None


def _build(gm: fx.GraphModule, node: fx.Node) -> tuple[nn.Module, fx.Node] | str:
    """The module that computes ``node`` and its tensor input, or why there is none."""
    target = node.target
    if target is aten.linear.default:
        x, w_node = node.args[0], node.args[1]
        b_node = _arg(node, 2, "bias", None)
        w, b = _const(gm, w_node), _const(gm, b_node)
        if w is None or (b_node is not None and b is None):
            return "weight or bias is computed, not a constant"
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        lin.weight = _param(w)
        if b is not None:
            lin.bias = _param(b)
        return lin, x
    if target is aten.addmm.default:
        # nn.Linear's forward on a 2-D input is addmm(b, x, weight.t()): with weight = Wᵀ (a view of
        # W, not a copy) it makes this very call, bit for bit
        b_node, x, w_node = node.args[:3]
        if _arg(node, 3, "beta", 1) != 1 or _arg(node, 4, "alpha", 1) != 1:
            return "addmm with alpha or beta other than 1"
        w, b = _const(gm, w_node), _const(gm, b_node)
        if w is None or b is None:
            return "weight or bias is computed, not a constant"
        if w.dim() != 2 or b.dim() != 1 or b.shape[0] != w.shape[1]:
            return f"addmm of a {tuple(b.shape)} bias and a {tuple(w.shape)} weight is not a linear layer"
        lin = nn.Linear(w.shape[0], w.shape[1])
        lin.weight, lin.bias = _param(w.t()), _param(b)
        return lin, x
    if target is aten.layer_norm.default:
        x, shape = node.args[0], node.args[1]
        w_node, b_node = _arg(node, 2, "weight", None), _arg(node, 3, "bias", None)
        eps = _arg(node, 4, "eps", 1e-5)
        w, b = _const(gm, w_node), _const(gm, b_node)
        if (w_node is not None and w is None) or (b_node is not None and b is None):
            return "weight or bias is computed, not a constant"
        ln = nn.LayerNorm(list(shape), eps=eps, elementwise_affine=w is not None, bias=b is not None)
        if w is not None:
            ln.weight = _param(w)
        if b is not None:
            ln.bias = _param(b)
        return ln, x
    if target is aten.embedding.default:
        w_node, ids = node.args[0], node.args[1]
        padding_idx = _arg(node, 2, "padding_idx", -1)
        if _arg(node, 3, "scale_grad_by_freq", False) or _arg(node, 4, "sparse", False):
            return "scale_grad_by_freq/sparse embedding (training options)"
        w = _const(gm, w_node)
        if w is None:
            return "weight is computed, not a constant"
        emb = nn.Embedding(w.shape[0], w.shape[1], padding_idx=None if padding_idx < 0 else padding_idx)
        emb.weight = _param(w)
        return emb, ids
    if target in _CONVS:
        cls = _CONVS[target]
        x, w_node = node.args[0], node.args[1]
        b_node = _arg(node, 2, "bias", None)
        stride, padding = _arg(node, 3, "stride", 1), _arg(node, 4, "padding", 0)
        dilation, groups = _arg(node, 5, "dilation", 1), _arg(node, 6, "groups", 1)
        w, b = _const(gm, w_node), _const(gm, b_node)
        if w is None or (b_node is not None and b is None):
            return "weight or bias is computed, not a constant"
        conv = cls(
            w.shape[1] * groups,
            w.shape[0],
            tuple(w.shape[2:]),
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=b is not None,
        )
        conv.weight = _param(w)
        if b is not None:
            conv.bias = _param(b)
        return conv, x
    if target is aten.batch_norm.default:
        x = node.args[0]
        w_node, b_node, rm_node, rv_node = node.args[1:5]
        training, momentum, eps = node.args[5:8]
        tensors = [_const(gm, n) for n in (w_node, b_node, rm_node, rv_node)]
        if training or any(t is None for t in tensors[2:]):
            return "batch statistics (training mode or no running statistics)"
        if any(n is not None and t is None for n, t in zip((w_node, b_node), tensors[:2])):
            return "weight or bias is computed, not a constant"
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(
            val.dim() if isinstance(val, torch.Tensor) else -1
        )
        if cls is None:
            return "input rank unknown"
        w, b, rm, rv = tensors
        bn = cls(rm.shape[0], eps=eps, momentum=momentum, affine=w is not None)
        if w is not None:
            bn.weight, bn.bias = _param(w), _param(b)
        bn.running_mean, bn.running_var = rm, rv
        bn.num_batches_tracked = None
        return bn, x
    return "not a weight-carrying op"


_MODULE_OPS = (
    aten.linear.default,
    aten.addmm.default,
    aten.layer_norm.default,
    aten.embedding.default,
    aten.batch_norm.default,
    *_CONVS,
)


def _install(gm: fx.GraphModule, node: fx.Node, module: nn.Module, taken: set[str]) -> str:
    """Register ``module`` under the caller's original name when free, else a fresh one."""
    owner = _owner(node, type(module))
    if owner and owner not in taken:
        parent_name, _, attr = owner.rpartition(".")
        try:
            parent = gm.get_submodule(parent_name) if parent_name else gm
        except AttributeError:
            parent = None
        existing = getattr(parent, attr, None) if parent is not None else None
        # export leaves a plain nn.Module holding the parameters at that path: replace it only if it
        # holds nothing but the parameters this module takes over
        own = {k for k, _ in module.named_parameters(recurse=False)}
        if parent is not None and isinstance(existing, nn.Module) and type(existing) is nn.Module:
            held = {k for k, _ in existing.named_parameters()} | {k for k, _ in existing.named_buffers()}
            if held <= own and not dict(existing.named_children()):
                setattr(parent, attr, module)
                taken.add(owner)
                return owner
    base = (owner or node.name).replace(".", "_")
    name, i = base, 1
    while name in modules_of(gm) or hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    gm.add_submodule(name, module)
    taken.add(name)
    return name


class RaiseATen(GraphPass):
    """Raise ``torch.export``'s ATen ops to module calls and torch-level calls (see module docstring)."""

    name = "raise_aten"
    tolerance = Tolerance(atol=0.0, rtol=0.0)

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        skips: list[Skip] = []
        matches = 0
        taken: set[str] = set()
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            target = node.target
            if target in _CHECKS:
                graph.erase_node(node)
                matches += 1
                continue
            if (target in _ALIASES or _identity_cast(node)) and node.args and isinstance(node.args[0], fx.Node):
                node.replace_all_uses_with(node.args[0])  # the same tensor (storage, sizes, strides)
                graph.erase_node(node)
                matches += 1
                continue
            if target in _MODULE_OPS:
                built = _build(gm, node)
                if isinstance(built, str):
                    skips.append(Skip(node.name, built, str(target)))
                    continue
                module, x = built
                module.train(False)
                name = _install(gm, node, module, taken)
                with graph.inserting_before(node):
                    new = graph.call_module(name, (x,))
            elif target is aten.div.Tensor and isinstance(spelled := _written_normalize(node), tuple):
                x, p, dim, eps = spelled
                with graph.inserting_before(node):
                    new = graph.call_function(F.normalize, (x,), {"p": p, "dim": dim, "eps": eps})
            elif target in FUNCTIONS:
                with graph.inserting_before(node):
                    new = graph.call_function(FUNCTIONS[target], node.args, dict(node.kwargs))
            elif target in METHODS:
                with graph.inserting_before(node):
                    new = graph.call_method(METHODS[target], node.args, dict(node.kwargs))
            else:
                continue
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            matches += 1
        # results nobody reads (export keeps MHA's averaged attention weights when the caller drops
        # them) and get_attr nodes whose only reader became a module call
        for node in reversed(list(graph.nodes)):
            if node.users or node.op not in ("call_function", "call_method", "get_attr") or node.is_impure():
                continue
            if node.op == "call_method" and str(node.target).endswith("_"):  # x.add_(y): its write is read
                continue
            graph.erase_node(node)
        gm.delete_all_unused_submodules()
        graph.lint()
        gm.recompile()
        left = sum(1 for n in graph.nodes if n.op == "call_function" and _is_aten(n.target))
        notes = [f"raised {matches} ATen call(s); {left} left as ATen (no module or torch-level form here)"]
        return PassResult(gm, matches > 0, matches, skips, notes)


def _identity_cast(node: fx.Node) -> bool:
    """``aten.to.dtype(x, d)`` where ``x`` already is ``d`` (Llama's RMSNorm ``x.to(torch.float32)`` on
    an fp32 model), or ``aten.type_as(x, y)`` of a ``y`` of ``x``'s dtype: torch returns ``x`` itself,
    so the call is the tensor (it split an exported Llama's plan at every norm: "a conversion to
    torch.float32", and Gemma's at every ``type_as``)."""
    if node.target not in (aten.to.dtype, aten.type_as.default) or len(node.args) != 2 or node.kwargs:
        return False
    src, to = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
    if node.target is aten.type_as.default:  # x.type_as(y) (Gemma's norms): y's dtype
        to = to.dtype if isinstance(to, torch.Tensor) else None
    return isinstance(src, torch.Tensor) and src.dtype == to


def _only_use(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.target is target and len(node.users) == 1


def _written_normalize(div: fx.Node) -> tuple[fx.Node, float, int, float] | str:
    """``(x, p, dim, eps)`` where ``div`` ends ``F.normalize(x, p, dim, eps)`` written out by export —
    ``div(x, expand_as(clamp_min(linalg_vector_norm(x, p, [dim], True), eps), x))``, each
    intermediate read by the next only — else why not."""
    if len(div.args) != 2 or div.kwargs:
        return "not div(x, y)"
    x, expanded = div.args
    if not _only_use(expanded, aten.expand_as.default) or expanded.args[1:] != (x,):
        return "the divisor is not a norm expanded as the dividend"
    clamped = expanded.args[0]
    if not _only_use(clamped, aten.clamp_min.default) or not isinstance(clamped.args[1], float | int):
        return "the norm is not clamped from below by a number"
    norm = clamped.args[0]
    if not _only_use(norm, aten.linalg_vector_norm.default) or norm.kwargs:
        return "not a vector norm (or one with a dtype)"
    args = (*norm.args, *[None] * (4 - len(norm.args)))
    src, p, dims, keepdim = args
    if src is not x or keepdim is not True or not isinstance(dims, list | tuple) or len(dims) != 1:
        return "a norm of another tensor, over several dims or without keepdim"
    return x, float(2.0 if p is None else p), int(dims[0]), float(clamped.args[1])


def _is_aten(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"


__all__ = ["FUNCTIONS", "METHODS", "RaiseATen"]
