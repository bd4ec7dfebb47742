"""Hypothesis strategy that draws random but valid :class:`~gml.testing.graphgen.ModelSpec` s.

NNSmith's recipe, on torch.fx: keep the shape of every value drawn so far, and at each step draw
an op together with a *valid* input for it (a value of the right rank and channel count) and
options that keep every dimension ≥ 1. Inputs are usually the newest value (so chains such as
conv → bn → relu, which the passes fuse, are common) and sometimes any earlier live value (which
gives residual adds, concatenations, nodes with several users and dead code). Modules are
sometimes called again at another site (``reuse``), and in-place ops appear where they are safe to
trace:

* never on a model input or a view of one (the caller's tensors would change);
* ``a += b`` (which fx records as an out-of-place add) only when no other value shares ``a``'s
  storage, and ``a`` is never read afterwards;
* ``.view()`` only on values no ``permute`` has touched (``.contiguous()`` clears that).

Everything is drawn through hypothesis, so failures shrink: fewer layers, earlier op kinds
(``act`` first), smaller channels and shapes, the newest value as input.

Needs ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from gml.testing.graphgen import ACTIVATIONS, REUSABLE, L, ModelSpec, Shape, act_forms, infer_shape

# Drawn op kinds and their weights. The passes target CNNs, so convs and what follows them dominate.
# Hypothesis shrinks towards the front of the tuple, hence the simplest op (act) first.
_WEIGHTS = {
    "act": 3, "conv": 7, "bn": 3, "add": 3, "linear": 2, "pool": 2, "cat": 2, "convT": 2, "reuse": 2,
    "matmul": 1, "mul": 1, "scalar": 1, "flatten": 1, "merge": 1, "split": 1, "unsqueeze": 1, "permute": 1,
    "contiguous": 1, "dropout": 1, "bias": 1,
}  # fmt: skip
OPS: tuple[str, ...] = tuple(op for op, w in _WEIGHTS.items() for _ in range(w))
# ReLU is what the fused kernels take as a post-op, so it is drawn as often as all the others together.
_ACT_KINDS: tuple[str, ...] = ("relu",) * (len(ACTIVATIONS) - 1) + tuple(k for k in ACTIVATIONS if k != "relu")
# After these producers, the next op is often the one the fp32/INT8 passes fuse with them.
FOLLOW: dict[str, tuple[str, ...]] = {
    "conv": ("bn", "bn", "bn", "act", "add", "bias"),
    "convT": ("bn", "act"),
    "linear": ("act", "bn", "add"),
    "matmul": ("act", "act", "add"),
    "bn": ("act", "add", "act"),
    "add": ("act",),
}


@dataclass
class _Value:
    shape: Shape
    root: int  # the value whose storage this one shares (itself for fresh tensors)
    strided: bool = False  # a permute is upstream: .view() may fail
    dead: bool = False  # overwritten by `+=`: may not be read again
    producer: str = "input"


class _Drawer:
    def __init__(self, draw: Any, max_channels: int, ops: Sequence[str]) -> None:
        self.draw = draw
        self.max_c = max_channels
        self.ops = tuple(ops)
        self.values: list[_Value] = []
        self.layers: list[L] = []
        self.n_inputs = 1

    # ---------------------------------------------------------------- helpers
    def live(self, pred: Any = lambda v: True) -> list[int]:
        return [i for i, v in enumerate(self.values) if not v.dead and pred(self.values[i])]

    def pick(self, cands: list[int]) -> int | None:
        """The newest candidate usually; any candidate when the draw says so."""
        if not cands:
            return None
        if self.draw(st.integers(0, 3)) < 3:
            return cands[-1]
        return self.draw(st.sampled_from(cands))

    def safe_inplace(self, i: int) -> bool:
        return self.values[i].root >= self.n_inputs

    def add(self, layer: L, root: int | None = None, strided: bool | None = None) -> None:
        shapes = [self.values[s].shape for s in layer.src]
        shape = infer_shape(layer, shapes, self.layers, [v.shape for v in self.values])
        idx = len(self.values)
        src_strided = any(self.values[s].strided for s in layer.src)
        self.values.append(
            _Value(shape, idx if root is None else root, src_strided if strided is None else strided, False, layer.op)
        )
        self.layers.append(layer)

    def valid(self, layer: L) -> bool:
        try:
            infer_shape(layer, [self.values[s].shape for s in layer.src], self.layers, [v.shape for v in self.values])
        except ValueError:
            return False
        return True

    # ---------------------------------------------------------------- ops
    def step(self) -> None:
        last = self.values[-1]
        follow = FOLLOW.get(last.producer, ())
        follow = tuple(o for o in follow if o in self.ops)
        if follow and self.draw(st.integers(0, 1)) == 0 and getattr(self, f"op_{self.draw(st.sampled_from(follow))}")():
            return
        for _ in range(3):  # a drawn op may have no valid input here (split needs a rank-3 value, ...)
            if getattr(self, f"op_{self.draw(st.sampled_from(self.ops))}")():
                return
        self.op_act()  # always applicable

    def op_act(self) -> bool:
        src = self.pick(self.live())
        assert src is not None
        kind = self.draw(st.sampled_from(_ACT_KINDS))
        forms = [f for f in act_forms(kind) if "inplace" not in f or self.safe_inplace(src)]
        form = self.draw(st.sampled_from(forms))
        inplace = "inplace" in form
        self.add(L("act", src, kind=kind, form=form), root=self.values[src].root if inplace else None)
        return True

    def _groups(self, cin: int) -> tuple[int, int]:
        divisors = [g for g in range(1, cin + 1) if cin % g == 0]
        groups = self.draw(st.sampled_from(divisors))
        out = groups * self.draw(st.integers(1, max(1, self.max_c // groups)))
        return groups, out

    def op_conv(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) in (3, 4, 5)))
        if src is None:
            return False
        cin = self.values[src].shape[1]
        if self.draw(st.integers(0, 2)) == 0:
            # a shape-preserving conv (ResNet's 3x3 / 1x1): its output can join a residual add
            groups = self.draw(st.sampled_from([g for g in (1, cin) if cin % g == 0]))
            k = self.draw(st.sampled_from([1, 3]))
            kw0: dict[str, Any] = {"out": cin, "k": k, "pad": k // 2, "groups": groups}
            kw0["bias"] = not self.draw(st.booleans())
            self.add(L("conv", src, **kw0))
            return True
        groups, out = self._groups(cin)
        k = self.draw(st.integers(1, 3))
        kw: dict[str, Any] = {
            "out": out,
            "k": k,
            "stride": self.draw(st.integers(1, 2)),
            "pad": self.draw(st.integers(0, k // 2)),
            "dil": self.draw(st.sampled_from([1, 1, 2])),
            "groups": groups,
            "bias": not self.draw(st.booleans()),
            "form": "functional" if self.draw(st.integers(0, 7)) == 7 else "module",
        }
        layer = L("conv", src, **kw)
        if not self.valid(layer):  # spatial dims too small for this kernel: fall back to 1x1
            layer = L("conv", src, **{**kw, "k": 1, "pad": 0, "dil": 1, "stride": 1})
        self.add(layer)
        return True

    def op_convT(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) in (3, 4) and max(v.shape[2:]) <= 12))
        if src is None:
            return False
        groups, out = self._groups(self.values[src].shape[1])
        k = self.draw(st.integers(1, 3))
        stride = self.draw(st.integers(1, 2))
        kw = {
            "out": out,
            "k": k,
            "stride": stride,
            "pad": self.draw(st.integers(0, k - 1)),
            "out_pad": self.draw(st.integers(0, stride - 1)),
            "groups": groups,
            "bias": not self.draw(st.booleans()),
        }
        layer = L("convT", src, **kw)
        if not self.valid(layer):
            layer = L("convT", src, **{**kw, "pad": 0, "out_pad": 0})
        self.add(layer)
        return True

    def op_bn(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) in (2, 3, 4)))
        if src is None:
            return False
        layer = L(
            "bn",
            src,
            affine=not self.draw(st.booleans()),
            eps=self.draw(st.sampled_from([1e-5, 1e-3, 0.1])),
            stats=self.draw(st.integers(0, 9)) != 9,
            form="functional" if self.draw(st.integers(0, 7)) == 7 else "module",
        )
        if not self.valid(layer):  # batch statistics over a single value
            layer = L("bn", src, **{**layer.kw, "stats": True})
        self.add(layer)
        return True

    def op_linear(self) -> bool:
        return self._gemm("linear", lambda: "functional" if self.draw(st.integers(0, 7)) == 7 else "module")

    def op_matmul(self) -> bool:
        return self._gemm("matmul", lambda: self.draw(st.sampled_from(["op", "torch", "method"])))

    def _gemm(self, kind: str, form: Callable[[], str]) -> bool:
        """A ``linear`` / ``matmul`` layer (``out`` features, maybe a bias, ``form()`` drawn last)."""
        src = self.pick(self.live(lambda v: len(v.shape) >= 2 and v.shape[-1] <= 2048))
        if src is None:
            return False
        out = self.draw(st.integers(1, self.max_c))
        bias = not self.draw(st.booleans())
        self.add(L(kind, src, out=out, bias=bias, form=form()))
        return True

    def _binary(self, op: str, forms: list[str]) -> bool:
        src = self.pick(self.live())
        if src is None:
            return False
        shape = self.values[src].shape
        others = [i for i in self.live(lambda v: v.shape == shape) if i != src]
        # any earlier same-shaped value (a skip connection), rarely the value itself (x + x)
        other = self.draw(st.sampled_from(others)) if others and self.draw(st.integers(0, 5)) else src
        assert other is not None
        a, b = self.values[src], self.values[other]
        allowed = list(forms)
        if op == "add" and (not self.safe_inplace(src) or a.root == b.root):
            allowed = [f for f in allowed if f not in ("iadd", "inplace")]
        if "iadd" in allowed:
            aliased = any(v.root == a.root for j, v in enumerate(self.values) if j != src)
            if aliased or a.root != src:
                allowed.remove("iadd")
        form = self.draw(st.sampled_from(allowed))
        root = a.root if form == "inplace" else None
        self.add(L(op, src, other, form=form), root=root)
        if form == "iadd":
            a.dead = True
        return True

    def op_add(self) -> bool:
        return self._binary("add", ["op", "torch", "method", "alpha", "iadd", "inplace"])

    def op_mul(self) -> bool:
        return self._binary("mul", ["op", "torch", "method"])

    def op_scalar(self) -> bool:
        src = self.pick(self.live())
        assert src is not None
        kind = self.draw(st.sampled_from(["mul", "add"]))
        value = self.draw(st.sampled_from([0.5, 2.0, -1.0, 3]))
        self.add(L("scalar", src, kind=kind, value=value, form=self.draw(st.sampled_from(["op", "rop"]))))
        return True

    def op_cat(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) >= 2))
        if src is None:
            return False
        shape = self.values[src].shape

        def fits(v: _Value) -> bool:
            s = v.shape
            return len(s) == len(shape) and s[:1] + s[2:] == shape[:1] + shape[2:]

        parts = [src]
        for _ in range(self.draw(st.integers(1, 2))):
            nxt = self.pick(self.live(fits))
            assert nxt is not None
            parts.append(nxt)
        if sum(self.values[p].shape[1] for p in parts) > 2 * self.max_c:
            parts = parts[:2]
            if sum(self.values[p].shape[1] for p in parts) > 2 * self.max_c:
                return False
        self.add(L("cat", *parts))
        return True

    def _view_form(self, src: int, forms: list[str], view_forms: tuple[str, ...] = ("view",)) -> str:
        if self.values[src].strided:
            forms = [f for f in forms if f not in view_forms]
        return self.draw(st.sampled_from(forms))

    def op_flatten(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) >= 3))
        if src is None:
            return False
        form = self._view_form(src, ["torch", "method", "module", "view", "reshape"])
        self.add(L("flatten", src, form=form), root=self.values[src].root)
        return True

    def op_merge(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) == 4))
        if src is None:
            return False
        form = self._view_form(src, ["flatten", "view", "reshape"])
        self.add(L("merge", src, form=form), root=self.values[src].root)
        return True

    def op_split(self) -> bool:
        def splittable(v: _Value) -> bool:
            return len(v.shape) == 3 and any(v.shape[2] % a == 0 for a in range(2, v.shape[2]))

        src = self.pick(self.live(splittable))
        if src is None:
            return False
        n = self.values[src].shape[2]
        a = self.draw(st.sampled_from([a for a in range(2, n) if n % a == 0]))
        form = self._view_form(src, ["view", "reshape", "unflatten"])
        self.add(L("split", src, a=a, form=form), root=self.values[src].root)
        return True

    def op_unsqueeze(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) == 2))
        if src is None:
            return False
        form = self._view_form(src, ["method", "view"])
        self.add(L("unsqueeze", src, form=form), root=self.values[src].root)
        return True

    def op_permute(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) >= 3))
        if src is None:
            return False
        r = len(self.values[src].shape)
        rest = list(self.draw(st.permutations(list(range(1, r)))))
        if rest == list(range(1, r)):
            rest[-2], rest[-1] = rest[-1], rest[-2]
        perm = (0, *rest)
        forms = ["method", "torch"]
        if sum(q != j for j, q in enumerate(perm)) == 2:
            forms.append("transpose")
        self.add(
            L("permute", src, perm=perm, form=self.draw(st.sampled_from(forms))),
            root=self.values[src].root,
            strided=True,
        )
        return True

    def op_contiguous(self) -> bool:
        src = self.pick(self.live(lambda v: v.strided))
        if src is None:
            return False
        # .contiguous() copies only when the strides need it: a permute of size-1 dims is already
        # contiguous, and then the result *is* the source tensor. So it keeps the source's storage
        # root (an in-place op on it may write the source, a model input included).
        self.add(L("contiguous", src), root=self.values[src].root, strided=False)
        return True

    def op_pool(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) in (3, 4, 5)))
        if src is None:
            return False
        kind = self.draw(st.sampled_from(["max", "avg", "adaptive"]))
        k = self.draw(st.integers(1, 3))
        kw = {
            "kind": kind,
            "k": k,
            "stride": self.draw(st.integers(1, 2)),
            "pad": self.draw(st.integers(0, k // 2)),
            "out": self.draw(st.integers(1, 2)),
            "form": self.draw(st.sampled_from(["module", "functional"])),
        }
        layer = L("pool", src, **kw)
        if not self.valid(layer):
            layer = L("pool", src, **{**kw, "kind": "adaptive", "out": 1})
        self.add(layer)
        return True

    def op_dropout(self) -> bool:
        src = self.pick(self.live())
        assert src is not None
        form = self.draw(st.sampled_from(["module", "functional"]))
        self.add(L("dropout", src, form=form), root=self.values[src].root)
        return True

    def op_bias(self) -> bool:
        src = self.pick(self.live(lambda v: len(v.shape) >= 2))
        if src is None:
            return False
        self.add(L("bias", src, shape=self.draw(st.sampled_from(["batch", "channel"]))))
        return True

    def op_reuse(self) -> bool:
        owners = [
            j
            for j, layer in enumerate(self.layers)
            if layer.op in REUSABLE
            and layer.kw.get("form", "module").startswith("module")
            and not (layer.op == "act" and layer.kw["form"] == "module_inplace")
        ]
        pairs = [(v, j) for v in self.live() for j in owners if self.valid(L("reuse", v, of=j))]
        if not pairs:
            return False
        newest = [p for p in pairs if p[0] == pairs[-1][0]] if self.draw(st.integers(0, 3)) < 3 else pairs
        v, j = self.draw(st.sampled_from(newest))
        self.add(L("reuse", v, of=j))
        return True


def _input_shape(draw: Any, max_channels: int) -> Shape:
    rank = draw(st.sampled_from([4, 3, 2, 4, 3, 4, 5]))
    batch = draw(st.integers(1, 2))
    c = draw(st.integers(1, max_channels // 2))
    if rank == 5:  # video clips [N, C, T, H, W], kept small
        return (batch, c, draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    if rank == 4:
        return (batch, c, draw(st.integers(1, 10)), draw(st.integers(1, 10)))
    if rank == 3:
        return (batch, c, draw(st.integers(1, 16)))
    return (batch, draw(st.integers(1, 2 * max_channels)))


@st.composite
def model_specs(
    draw: Any,
    *,
    max_layers: int = 10,
    max_channels: int = 16,
    ops: Sequence[str] = OPS,
    two_inputs: bool = True,
) -> ModelSpec:
    """A random valid :class:`ModelSpec` with 1..``max_layers`` layers.

    ``ops`` restricts the op kinds drawn (``act`` is always possible: it is the fallback when a
    drawn op has no valid input).
    """
    d = _Drawer(draw, max_channels, ops)
    shape = _input_shape(draw, max_channels)
    d.n_inputs = 2 if two_inputs and draw(st.integers(0, 5)) == 5 else 1
    for i in range(d.n_inputs):
        d.values.append(_Value(shape, i))
    for i in range(draw(st.integers(1, max_layers))):
        # a conv stem most of the time: the passes are about what follows convs
        if i == 0 and "conv" in d.ops and len(shape) in (3, 4, 5) and draw(st.integers(0, 2)) > 0:
            d.op_conv()
        else:
            d.step()
    outputs = [len(d.values) - 1]
    extra = d.live(lambda v: v is not d.values[-1])
    extra = [i for i in extra if i >= d.n_inputs]
    if extra and draw(st.integers(0, 4)) == 4:
        outputs.append(draw(st.sampled_from(extra)))
    seed = draw(st.integers(0, 2**16))
    return ModelSpec(inputs=[shape] * d.n_inputs, layers=d.layers, outputs=outputs, seed=seed)


def fuzz_settings(default_examples: int, *, share: float = 1.0) -> Any:
    """Hypothesis settings for a fuzz test: ``default_examples`` graphs, deterministic.

    ``GML_FUZZ_EXAMPLES=N`` (``make fuzz``) runs ``N * share`` graphs instead (``share`` lets a slow
    property run a fraction); ``GML_FUZZ_SEED=S`` explores a different random stream (apply
    :func:`fuzz_seed` too). Without a seed the run is derandomized: CI sees the same graphs every time.
    """
    import os

    from hypothesis import HealthCheck, settings

    env = os.environ.get("GML_FUZZ_EXAMPLES")
    n = max(1, int(int(env) * share)) if env else default_examples
    seeded = os.environ.get("GML_FUZZ_SEED") is not None
    return settings(
        max_examples=n,
        derandomize=not seeded,
        database=None,
        deadline=None,
        print_blob=seeded,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def fuzz_seed(fn: Any) -> Any:
    """Apply ``GML_FUZZ_SEED`` (if set) to a hypothesis test."""
    import os

    from hypothesis import seed

    value = os.environ.get("GML_FUZZ_SEED")
    return seed(int(value))(fn) if value is not None else fn


__all__ = ["FOLLOW", "OPS", "fuzz_seed", "fuzz_settings", "model_specs"]
