"""Random-but-valid models from a short, readable description (NNSmith-style fuzzing).

A model is described by a :class:`ModelSpec`: input shapes, a list of layers and the values it
returns. Values are numbered: ``0 .. n_inputs-1`` are the model inputs and layer ``i`` produces
value ``n_inputs + i``. Each layer is an :class:`L`::

    ModelSpec(
        inputs=[(2, 3, 8, 8)],
        layers=[
            L("conv", 0, out=8, k=3, pad=1, groups=1),   # value 1
            L("bn", 1),                                   # value 2
            L("act", 2, kind="relu", form="method"),      # value 3
            L("add", 3, 1),                               # value 4: a residual add, value 1 has 2 users
            L("reuse", 4, of=0),                          # conv of layer 0 called at a second site
        ],
        outputs=[5],
    )

:func:`build` turns a spec into an ``nn.Module`` (eval mode, weights and BatchNorm running
statistics drawn from ``spec.seed``) whose ``forward`` issues exactly the spelled ops: module calls,
``F.*`` functions, tensor methods, in-place variants, operators. :func:`infer_shape` gives every
value's shape without running anything, so a generator can pick only valid layers.

The repr of a spec is valid Python: a shrunk fuzzing failure pastes straight into a regression test.
:meth:`ModelSpec.pretty` prints it as pseudo-code (``v3 = v2.relu()``) for reading.

No hypothesis here; the strategy that draws specs is :mod:`gml.testing.strategies`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Shape = tuple[int, ...]


class L:
    """One layer: ``op`` applied to values ``src`` with keyword options (see :data:`DEFAULTS`)."""

    __slots__ = ("kw", "op", "src")

    def __init__(self, op: str, *src: int, **kw: Any) -> None:
        if op not in DEFAULTS:
            raise ValueError(f"unknown layer op {op!r}; known: {sorted(DEFAULTS)}")
        unknown = set(kw) - set(DEFAULTS[op])
        if unknown:
            raise ValueError(f"{op}: unknown options {sorted(unknown)}; known: {sorted(DEFAULTS[op])}")
        self.op = op
        self.src = tuple(int(s) for s in src)
        self.kw = {**DEFAULTS[op], **kw}

    def __getitem__(self, key: str) -> Any:
        return self.kw[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, L) and (self.op, self.src, self.kw) == (other.op, other.src, other.kw)

    def __hash__(self) -> int:
        return hash((self.op, self.src, tuple(sorted(self.kw.items(), key=operator.itemgetter(0)))))

    def __repr__(self) -> str:
        # Only options that differ from the defaults: short enough to read in a failure report.
        opts = [f"{k}={v!r}" for k, v in self.kw.items() if v != DEFAULTS[self.op][k]]
        return f"L({', '.join([repr(self.op), *map(str, self.src), *opts])})"


@dataclass
class ModelSpec:
    """A whole random model; ``repr`` is paste-able Python."""

    inputs: list[Shape]
    layers: list[L]
    outputs: list[int] = field(default_factory=list)  # empty: the last value
    seed: int = 0

    def __post_init__(self) -> None:
        self.inputs = [tuple(s) for s in self.inputs]
        if not self.outputs:
            self.outputs = [len(self.inputs) + len(self.layers) - 1]

    def __repr__(self) -> str:
        layers = "".join(f"        {layer!r},\n" for layer in self.layers)
        seed = f"    seed={self.seed},\n" if self.seed else ""
        return (
            f"ModelSpec(\n    inputs={self.inputs!r},\n    layers=[\n{layers}    ],\n"
            f"    outputs={self.outputs!r},\n{seed})"
        )

    def shapes(self) -> list[Shape]:
        """Shape of every value (inputs, then one per layer)."""
        return infer_shapes(self)

    def pretty(self) -> str:
        """Pseudo-code, one line per layer, with shapes: what the traced graph will contain."""
        shapes = self.shapes()
        n = len(self.inputs)
        lines = [f"v{i}: input {shapes[i]}" for i in range(n)]
        for i, layer in enumerate(self.layers):
            args = ", ".join(f"v{s}" for s in layer.src)
            opts = ", ".join(f"{k}={v!r}" for k, v in layer.kw.items() if v != DEFAULTS[layer.op][k])
            lines.append(f"v{n + i} = {layer.op}({args}{', ' if opts else ''}{opts})  # {shapes[n + i]}")
        lines.append("return " + ", ".join(f"v{o}" for o in self.outputs))
        return "\n".join(lines)

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(s, generator=gen) for s in self.inputs)


# ---------------------------------------------------------------------------------------- vocabulary
# Every op and its options with defaults. ``form`` picks the spelling the traced graph will contain.
DEFAULTS: dict[str, dict[str, Any]] = {
    # conv1d on rank-3 values, conv2d on rank-4; form "module" (nn.ConvNd) or "functional" (F.convNd
    # on parameters of the root module: get_attr nodes).
    "conv": {"out": 4, "k": 1, "stride": 1, "pad": 0, "dil": 1, "groups": 1, "bias": True, "form": "module"},
    "convT": {"out": 4, "k": 2, "stride": 1, "pad": 0, "out_pad": 0, "groups": 1, "bias": True},
    # BatchNorm1d (rank 2/3) or 2d (rank 4). stats=False: track_running_stats=False (batch statistics
    # even in eval). form "functional": F.batch_norm on buffers of the root module.
    "bn": {"affine": True, "eps": 1e-5, "stats": True, "form": "module"},
    "linear": {"out": 4, "bias": True, "form": "module"},  # on the last dimension
    # x @ w (+ b) with w, b parameters of the root module (get_attr nodes): op: `x @ w + b`;
    # torch: torch.add(torch.matmul(x, w), b); method: x.matmul(w) + b
    "matmul": {"out": 4, "bias": True, "form": "op"},
    "act": {"kind": "relu", "form": "module"},  # forms: module, module_inplace, functional, functional_inplace,
    # method, method_inplace (see ACTIVATIONS for which kinds have which)
    "add": {"form": "op"},  # op: a + b; torch: torch.add; method: a.add(b); alpha: torch.add(a, b, alpha=.5);
    # iadd: a += b (fx traces it out of place, so `a` must not be read again); inplace: a.add_(b)
    "mul": {"form": "op"},  # op / torch / method
    "scalar": {"kind": "mul", "value": 0.5, "form": "op"},  # x * c, x + c; form "rop": c * x, c + x
    "cat": {"dim": 1},
    "flatten": {"form": "torch"},  # rank ≥3 → (N, -1): torch / method / module / view / reshape
    "merge": {"form": "flatten"},  # (N, C, H, W) → (N, C, H*W): flatten / view / reshape
    "split": {"a": 1, "form": "view"},  # (N, C, L) → (N, C, a, L//a): view / reshape / unflatten
    "unsqueeze": {"form": "method"},  # (N, F) → (N, F, 1): method / view
    "permute": {"perm": (0, 2, 1), "form": "method"},  # method / torch / transpose (a single swap)
    "contiguous": {},
    "pool": {"kind": "max", "k": 2, "stride": 2, "pad": 0, "out": 1, "form": "module"},  # max / avg / adaptive
    "dropout": {"form": "module"},  # identity in eval: module / functional
    # x + p, p a parameter of the root module (a get_attr node) that broadcasts over x: "batch" is
    # (1, *x.shape[1:]) (a ViT's position embedding), "channel" (1, C, 1, ...) (a per-channel shift)
    "bias": {"shape": "batch"},
    "reuse": {"of": 0},  # call the module of layer ``of`` again (a module called at several sites)
}

# kind: (module class, functional, method name or None, constructor kwargs, in-place supported by F/module)
ACTIVATIONS: dict[str, tuple[type[nn.Module], Callable[..., torch.Tensor], str | None, dict[str, Any], bool]] = {
    "relu": (nn.ReLU, F.relu, "relu", {}, True),
    "relu6": (nn.ReLU6, F.relu6, None, {}, True),
    "hardtanh": (nn.Hardtanh, F.hardtanh, None, {"min_val": -0.5, "max_val": 2.0}, True),
    "leaky_relu": (nn.LeakyReLU, F.leaky_relu, None, {"negative_slope": 0.1}, True),
    "elu": (nn.ELU, F.elu, None, {"alpha": 0.5}, True),
    "sigmoid": (nn.Sigmoid, torch.sigmoid, "sigmoid", {}, False),
    "tanh": (nn.Tanh, torch.tanh, "tanh", {}, False),
    "gelu": (nn.GELU, F.gelu, None, {}, False),
    "silu": (nn.SiLU, F.silu, None, {}, True),
    "hardswish": (nn.Hardswish, F.hardswish, None, {}, True),
    "hardsigmoid": (nn.Hardsigmoid, F.hardsigmoid, None, {}, True),
}

# Layers whose module can be called again by a "reuse" layer.
REUSABLE = ("conv", "convT", "bn", "linear", "act", "pool")


def act_forms(kind: str) -> list[str]:
    """Spellings available for an activation kind."""
    _, _, method, _, inplace = ACTIVATIONS[kind]
    forms = ["module", "functional"]
    if inplace:
        forms += ["module_inplace", "functional_inplace"]
    if method:
        forms += ["method", "method_inplace"]
    return forms


# ---------------------------------------------------------------------------------------- shapes
def _conv_len(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _convT_len(n: int, k: int, s: int, p: int, op: int) -> int:
    return (n - 1) * s - 2 * p + (k - 1) + op + 1


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise ValueError(why)


def infer_shape(
    layer: L, shapes: Sequence[Shape], spec_layers: Sequence[L] = (), values: Sequence[Shape] = ()
) -> Shape:
    """Output shape of ``layer`` given its input shapes; ``ValueError`` if the layer is invalid there.

    ``spec_layers`` (the layers before this one) and ``values`` (the shapes of all values so far)
    are needed only for ``reuse``: the reused module must accept the new input.
    """
    op, kw = layer.op, layer.kw
    x = shapes[0] if shapes else ()
    if op == "reuse":
        _need(0 <= kw["of"] < len(spec_layers), f"reuse of unknown layer {kw['of']}")
        orig = spec_layers[kw["of"]]
        _need(orig.op in REUSABLE, f"layer {kw['of']} ({orig.op}) has no module to reuse")
        _need(orig.kw.get("form", "module").startswith("module"), f"layer {kw['of']} is not in module form")
        was = values[orig.src[0]]
        _need(len(x) == len(was), f"reused {orig.op} expects rank {len(was)}, got {x}")
        if orig.op in ("conv", "convT", "bn"):
            _need(x[1] == was[1], f"reused {orig.op} expects {was[1]} channels, got {x[1]}")
        if orig.op == "linear":
            _need(x[-1] == was[-1], f"reused linear expects {was[-1]} features, got {x[-1]}")
        return infer_shape(L(orig.op, *layer.src, **orig.kw), shapes)
    if op in ("conv", "convT"):
        ranks = (3, 4, 5) if op == "conv" else (3, 4)  # Conv1d/2d/3d; ConvTranspose1d/2d
        _need(len(x) in ranks, f"{op} needs a rank-{'/'.join(map(str, ranks))} input, got {x}")
        cin, g = x[1], kw["groups"]
        _need(cin % g == 0 and kw["out"] % g == 0, f"groups={g} must divide in={cin} and out={kw['out']}")
        if op == "conv":
            dims = [_conv_len(n, kw["k"], kw["stride"], kw["pad"], kw["dil"]) for n in x[2:]]
            _need(kw["pad"] <= kw["k"] // 2, "padding larger than half the kernel")
        else:
            _need(kw["pad"] < kw["k"] and kw["out_pad"] < kw["stride"], "convT padding/output_padding invalid")
            dims = [_convT_len(n, kw["k"], kw["stride"], kw["pad"], kw["out_pad"]) for n in x[2:]]
        _need(all(d >= 1 for d in dims), f"{op} output would be empty: {dims}")
        return (x[0], kw["out"], *dims)
    if op == "bn":
        _need(len(x) in (2, 3, 4, 5), f"bn needs rank 2-5, got {x}")
        _need(kw["stats"] or math.prod(x) // x[1] > 1, "batch statistics need more than one value per channel")
        return x
    if op in ("linear", "matmul"):
        _need(len(x) >= 2, f"{op} needs rank ≥2")
        return (*x[:-1], kw["out"])
    if op in ("act", "dropout", "contiguous"):
        return x
    if op == "bias":
        _need(len(x) >= 2, "a broadcast parameter add needs rank >= 2")
        return x
    if op == "scalar":
        return x
    if op in ("add", "mul"):
        _need(len(shapes) == 2 and shapes[0] == shapes[1], f"{op} needs two equal shapes, got {shapes}")
        return x
    if op == "cat":
        d = kw["dim"]
        _need(len(shapes) >= 2, "cat needs ≥2 inputs")
        _need(all(len(s) == len(x) and d < len(s) for s in shapes), "cat inputs must have equal rank")
        _need(all(s[:d] + s[d + 1 :] == x[:d] + x[d + 1 :] for s in shapes), f"cat inputs differ off dim {d}: {shapes}")
        return (*x[:d], sum(s[d] for s in shapes), *x[d + 1 :])
    if op == "flatten":
        _need(len(x) >= 3, "flatten needs rank ≥3")
        return (x[0], math.prod(x[1:]))
    if op == "merge":
        _need(len(x) == 4, "merge needs rank 4")
        return (x[0], x[1], x[2] * x[3])
    if op == "split":
        _need(len(x) == 3 and x[2] % kw["a"] == 0, f"split needs rank 3 with L divisible by {kw['a']}")
        return (x[0], x[1], kw["a"], x[2] // kw["a"])
    if op == "unsqueeze":
        _need(len(x) == 2, "unsqueeze needs rank 2")
        return (*x, 1)
    if op == "permute":
        p = tuple(kw["perm"])
        _need(sorted(p) == list(range(len(x))) and p[0] == 0, f"perm {p} does not fit rank {len(x)}")
        if kw["form"] == "transpose":
            _need(sum(q != j for j, q in enumerate(p)) == 2, f"perm {p} is not a single swap")
        return tuple(x[i] for i in p)
    if op == "pool":
        _need(len(x) in (3, 4, 5), "pool needs rank 3-5")
        if kw["kind"] == "adaptive":
            return (*x[:2], *([kw["out"]] * (len(x) - 2)))
        _need(kw["pad"] <= kw["k"] // 2, "pool padding larger than half the kernel")
        # the 3-D pools check the unpadded input against the kernel ("input image smaller than kernel")
        _need(len(x) < 5 or min(x[2:]) >= kw["k"], f"3-D pool input {x[2:]} smaller than its kernel")
        dims = [_conv_len(n, kw["k"], kw["stride"], kw["pad"], 1) for n in x[2:]]
        _need(all(d >= 1 for d in dims), f"pool output would be empty: {dims}")
        return (*x[:2], *dims)
    raise ValueError(f"unknown op {op}")


def infer_shapes(spec: ModelSpec) -> list[Shape]:
    shapes: list[Shape] = list(spec.inputs)
    for i, layer in enumerate(spec.layers):
        _need(all(0 <= s < len(shapes) for s in layer.src), f"layer {i} reads an undefined value {layer.src}")
        try:
            shapes.append(infer_shape(layer, [shapes[s] for s in layer.src], spec.layers[:i], shapes))
        except ValueError as exc:
            raise ValueError(f"layer {i} {layer!r}: {exc}") from None
    for o in spec.outputs:
        _need(0 <= o < len(shapes), f"output {o} is not a value")
    return shapes


# ---------------------------------------------------------------------------------------- building
def _make_module(layer: L, x: Shape, gen: torch.Generator) -> nn.Module | None:
    """The module a layer owns (``None`` for function-only layers)."""
    op, kw = layer.op, layer.kw
    if op == "conv":
        cls = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[len(x)]
        return cls(x[1], kw["out"], kw["k"], kw["stride"], kw["pad"], kw["dil"], kw["groups"], kw["bias"])
    if op == "convT":
        cls_t = nn.ConvTranspose1d if len(x) == 3 else nn.ConvTranspose2d
        return cls_t(x[1], kw["out"], kw["k"], kw["stride"], kw["pad"], kw["out_pad"], kw["groups"], kw["bias"])
    if op == "bn":
        cls_b = {4: nn.BatchNorm2d, 5: nn.BatchNorm3d}.get(len(x), nn.BatchNorm1d)
        bn = cls_b(x[1], eps=kw["eps"], affine=kw["affine"], track_running_stats=kw["stats"])
        _randomize_bn(bn, gen)
        return bn
    if op == "linear":
        return nn.Linear(x[-1], kw["out"], bias=kw["bias"])
    if op == "act" and kw["form"].startswith("module"):
        cls_a, _, _, ctor, _ = ACTIVATIONS[kw["kind"]]
        extra = {"inplace": True} if kw["form"] == "module_inplace" else {}
        return cls_a(**ctor, **extra)
    if op == "pool" and kw["form"] == "module":
        d = len(x) - 2
        if kw["kind"] == "adaptive":
            return (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[d - 1](kw["out"])
        cls_p = {
            "max": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
            "avg": (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d),
        }[kw["kind"]][d - 1]
        return cls_p(kw["k"], kw["stride"], kw["pad"])
    if op == "flatten" and kw["form"] == "module":
        return nn.Flatten()
    if op == "dropout" and kw["form"] == "module":
        return nn.Dropout(0.5)
    return None


def _randomize_bn(bn: nn.modules.batchnorm._BatchNorm, gen: torch.Generator) -> None:
    """Non-trivial statistics and affine parameters, so folding them is really exercised.

    gamma may be negative (a sign error in folding shows), var stays in [0.2, 2] so no channel is
    degenerate, mean is of the order of the activations.
    """
    c = bn.num_features
    with torch.no_grad():
        if bn.track_running_stats:
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
            bn.running_var.copy_(torch.rand(c, generator=gen) * 1.8 + 0.2)
        if bn.affine:
            bn.weight.copy_(torch.randn(c, generator=gen) * 0.6 + 0.4)
            bn.bias.copy_(torch.randn(c, generator=gen) * 0.3)


class GeneratedModel(nn.Module):
    """The model a :class:`ModelSpec` describes. Submodules are named ``<op><layer index>``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        shapes = infer_shapes(spec)
        n = len(spec.inputs)
        self._names: list[str | None] = []
        gen = torch.Generator().manual_seed(spec.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            for i, layer in enumerate(spec.layers):
                x = shapes[layer.src[0]] if layer.src else ()
                name: str | None = None
                if layer.op == "reuse":
                    name = self._names[layer["of"]]
                elif layer.op == "matmul":
                    bound = 1 / math.sqrt(x[-1])  # nn.Linear's init range, for comparable magnitudes
                    w = (torch.rand(x[-1], layer["out"], generator=gen) * 2 - 1) * bound
                    self.register_parameter(f"m{i}", nn.Parameter(w))
                    if layer["bias"]:
                        b = (torch.rand(layer["out"], generator=gen) * 2 - 1) * bound
                        self.register_parameter(f"mb{i}", nn.Parameter(b))
                elif layer.op == "bias":
                    shape = (1, *x[1:]) if layer["shape"] == "batch" else (1, x[1], *[1] * (len(x) - 2))
                    p = torch.randn(shape, generator=gen) * 0.5
                    self.register_parameter(f"p{i}", nn.Parameter(p))
                elif layer.op in ("conv", "linear", "bn") and layer["form"] == "functional":
                    self._functional_params(i, layer, x, gen)
                else:
                    mod = _make_module(layer, x, gen)
                    if mod is not None:
                        name = f"{layer.op}{i}"
                        self.add_module(name, mod)
                self._names.append(name)
        self._shapes = shapes
        self._n = n
        # Called as probe(value_index, tensor) on every value in eager runs (None while tracing): lets a
        # test record value ranges or inject noise in place (gml.testing.fuzz's INT8 bound).
        self.probe: Callable[[int, torch.Tensor], None] | None = None
        self.eval()

    def _functional_params(self, i: int, layer: L, x: Shape, gen: torch.Generator) -> None:
        # Parameters live on the root module: the traced graph reads them with get_attr nodes.
        mod = _make_module(L(layer.op, *layer.src, **{**layer.kw, "form": "module"}), x, gen)
        assert mod is not None
        for pname, p in mod.named_parameters():
            self.register_parameter(f"{pname[0]}{i}", p)  # w3 / b3
        for bname, b in mod.named_buffers():
            if bname in ("running_mean", "running_var"):
                self.register_buffer(f"{bname.split('_')[1]}{i}", b)  # mean3 / var3

    def forward(self, x: torch.Tensor) -> Any:
        return self._run([x])

    def _run(self, xs: list[torch.Tensor]) -> Any:
        vals: list[Any] = list(xs)
        probe = self.probe
        if probe is not None:
            for j, v in enumerate(vals):
                probe(j, v)
        for i, layer in enumerate(self.spec.layers):
            v = self._apply_layer(i, layer, [vals[s] for s in layer.src])
            if probe is not None:
                probe(len(xs) + i, v)
            vals.append(v)
        outs = [vals[o] for o in self.spec.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _apply_layer(self, i: int, layer: L, xs: list[Any]) -> Any:
        op, kw = layer.op, layer.kw
        x = xs[0] if xs else None
        rank = len(self._shapes[layer.src[0]]) if layer.src else 0  # static: x is a Proxy while tracing
        name = self._names[i]
        if name is not None:
            mod = getattr(self, name)
            return mod(x)
        if op == "conv":  # functional form
            fn = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[rank]
            bias = getattr(self, f"b{i}") if kw["bias"] else None
            return fn(x, getattr(self, f"w{i}"), bias, kw["stride"], kw["pad"], kw["dil"], kw["groups"])
        if op == "linear":
            return F.linear(x, getattr(self, f"w{i}"), getattr(self, f"b{i}") if kw["bias"] else None)
        if op == "matmul":
            w = getattr(self, f"m{i}")
            if kw["form"] == "torch":
                y = torch.matmul(x, w)
                return torch.add(y, getattr(self, f"mb{i}")) if kw["bias"] else y
            y = x.matmul(w) if kw["form"] == "method" else x @ w
            return y + getattr(self, f"mb{i}") if kw["bias"] else y
        if op == "bn":
            w = getattr(self, f"w{i}") if kw["affine"] else None
            b = getattr(self, f"b{i}") if kw["affine"] else None
            mean = getattr(self, f"mean{i}") if kw["stats"] else None
            var = getattr(self, f"var{i}") if kw["stats"] else None
            return F.batch_norm(x, mean, var, w, b, training=not kw["stats"], eps=kw["eps"])
        if op == "act":
            _, fn, method, ctor, _ = ACTIVATIONS[kw["kind"]]
            form = kw["form"]
            if form == "functional":
                return fn(x, **ctor)
            if form == "functional_inplace":
                return fn(x, **ctor, inplace=True)
            if form == "method":
                return getattr(x, method)()
            if form == "method_inplace":
                return getattr(x, f"{method}_")()
            raise ValueError(f"activation form {form}")
        if op == "add":
            a, b = xs
            form = kw["form"]
            if form == "op":
                return a + b
            if form == "torch":
                return torch.add(a, b)
            if form == "method":
                return a.add(b)
            if form == "alpha":
                return torch.add(a, b, alpha=0.5)
            if form == "iadd":  # fx records this as an out-of-place add: only valid if `a` is not read again
                a += b
                return a
            if form == "inplace":  # recorded as call_method add_: the mutation is in the graph too
                return a.add_(b)
            raise ValueError(f"add form {form}")
        if op == "mul":
            a, b = xs
            if kw["form"] == "method":
                return a.mul(b)
            return torch.mul(a, b) if kw["form"] == "torch" else a * b
        if op == "scalar":
            fn2 = operator.mul if kw["kind"] == "mul" else operator.add
            return fn2(kw["value"], x) if kw["form"] == "rop" else fn2(x, kw["value"])
        if op == "cat":
            return torch.cat(xs, dim=kw["dim"])
        if op == "flatten":
            form = kw["form"]
            if form == "torch":
                return torch.flatten(x, 1)
            if form == "method":
                return x.flatten(1)
            if form == "view":
                return x.view(x.size(0), -1)
            if form == "reshape":
                return x.reshape(x.shape[0], -1)
            raise ValueError(f"flatten form {form}")
        if op == "merge":
            form = kw["form"]
            if form == "flatten":
                return x.flatten(2)
            if form == "view":
                return x.view(x.size(0), x.size(1), -1)
            return x.reshape(x.shape[0], x.shape[1], -1)
        if op == "split":
            a = kw["a"]
            form = kw["form"]
            if form == "unflatten":
                return x.unflatten(2, (a, -1))
            if form == "view":
                return x.view(x.size(0), x.size(1), a, -1)
            return x.reshape(x.size(0), x.size(1), a, -1)
        if op == "unsqueeze":
            return x.unsqueeze(-1) if kw["form"] == "method" else x.view(x.size(0), x.size(1), 1)
        if op == "permute":
            p = tuple(kw["perm"])
            if kw["form"] == "torch":
                return torch.permute(x, p)
            if kw["form"] == "transpose":
                i0, i1 = (j for j, q in enumerate(p) if q != j)
                return x.transpose(i0, i1)
            return x.permute(*p)
        if op == "contiguous":
            return x.contiguous()
        if op == "pool":
            d = rank - 2
            if kw["kind"] == "adaptive":
                return (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[d - 1](x, kw["out"])
            fn3 = {
                "max": (F.max_pool1d, F.max_pool2d, F.max_pool3d),
                "avg": (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d),
            }[kw["kind"]][d - 1]
            return fn3(x, kw["k"], kw["stride"], kw["pad"])
        if op == "dropout":
            return F.dropout(x, 0.5, training=False)
        if op == "bias":
            return x + getattr(self, f"p{i}")
        raise ValueError(f"cannot apply {layer!r}")


class GeneratedModel2(GeneratedModel):
    """Two-input variant (``forward`` needs fixed arguments: fx traces ``*args`` as one value)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:  # type: ignore[override]
        return self._run([x, y])


def build(spec: ModelSpec) -> GeneratedModel:
    """The eval-mode ``nn.Module`` for ``spec`` (deterministic in ``spec.seed``)."""
    if len(spec.inputs) not in (1, 2):
        raise ValueError("specs have one or two inputs")
    return GeneratedModel(spec) if len(spec.inputs) == 1 else GeneratedModel2(spec)


__all__ = [
    "ACTIVATIONS",
    "DEFAULTS",
    "REUSABLE",
    "GeneratedModel",
    "GeneratedModel2",
    "L",
    "ModelSpec",
    "act_forms",
    "build",
    "infer_shape",
]
