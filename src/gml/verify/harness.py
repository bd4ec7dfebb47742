"""``verify_pass``: check one pass on one model the way a reviewer would.

Given a model and a pass it reports, as a :class:`VerifyResult`:

* numerical equivalence over ``n_inputs`` seeded random inputs (max abs error, within tolerance?),
* gradient equivalence w.r.t. the inputs where that is meaningful (fp32 rewrites of an eval-mode
  model; a rewrite onto inference-only kernels reports "not applicable" with the reason),
* ``graph.lint()`` of the rewritten graph,
* that the parameter count (tensors in ``state_dict``) did not grow.

The model is never modified: the pass runs on a copy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from gml.capture import capture
from gml.passes.base import GraphPass, PassResult, Tolerance
from gml.passes.manager import _flat_outputs, compare_outputs, run_outputs


@dataclass
class VerifyResult:
    pass_name: str
    matches: int
    n_inputs: int
    max_abs_err: float
    numerics_ok: bool
    numerics_detail: str | None
    grad_ok: bool | None  # None: not applicable
    grad_max_err: float | None
    grad_detail: str | None
    lint_ok: bool
    lint_error: str | None
    params_before: int
    params_after: int
    skips: list[str] = field(default_factory=list)

    @property
    def params_ok(self) -> bool:
        return self.params_after <= self.params_before

    @property
    def passed(self) -> bool:
        return self.numerics_ok and self.lint_ok and self.params_ok and self.grad_ok is not False

    def summary(self) -> str:
        grad = "n/a" if self.grad_ok is None else ("ok" if self.grad_ok else "FAIL")
        return (
            f"{self.pass_name}: {'PASS' if self.passed else 'FAIL'} — matches={self.matches}, "
            f"max|err|={self.max_abs_err:.2e} over {self.n_inputs} inputs, grad={grad}, "
            f"lint={'ok' if self.lint_ok else 'FAIL'}, params {self.params_before}→{self.params_after}"
        )


def count_state(module: nn.Module) -> int:
    """Elements in the module's state_dict, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in module.state_dict(keep_vars=True).values():
        if not isinstance(t, torch.Tensor) or t.is_mkldnn:
            continue
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel()
    return total


def random_inputs(like: Sequence[Any], n: int, seed: int = 0) -> list[tuple[Any, ...]]:
    """``n`` seeded random input tuples with the shapes and dtypes of ``like``; an entry that is not a
    tensor (``None`` for a skipped positional parameter: ``(ids, None, mask)`` for an HF decoder whose
    second parameter is its cache) is passed as it is."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        args: list[Any] = []
        for t in like:
            if not isinstance(t, torch.Tensor):
                args.append(t)
            elif t.dtype == torch.bool:
                args.append(torch.randint(0, 2, t.shape, generator=gen).bool())
            elif t.is_floating_point():
                args.append(torch.randn(t.shape, generator=gen, dtype=t.dtype))
            else:
                hi = int(t.max()) + 1 if t.numel() else 2
                args.append(torch.randint(0, max(hi, 2), t.shape, generator=gen, dtype=t.dtype))
        samples.append(tuple(args))
    return samples


def _input_grads(module: nn.Module, args: tuple[torch.Tensor, ...], seed: int) -> list[torch.Tensor]:
    leaves = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)
    outs = _flat_outputs(module(*leaves))
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, [x for x in leaves if x.requires_grad], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def verify_pass(
    model: nn.Module,
    pass_: GraphPass,
    example_inputs: Sequence[torch.Tensor],
    *,
    n_inputs: int = 8,
    tolerance: Tolerance | None = None,
    check_grad: bool = True,
    seed: int = 0,
) -> VerifyResult:
    """Run ``pass_`` on a copy of ``model`` and check it (see module docstring)."""
    tol = tolerance if tolerance is not None else (pass_.tolerance or Tolerance(1e-4, 1e-3))
    original = capture(copy.deepcopy(model), tuple(example_inputs))
    original.eval()
    rewritten_in = copy.deepcopy(original)
    result: PassResult = pass_(rewritten_in)
    rewritten: fx.GraphModule = result.graph_module
    lint_error = None
    try:
        rewritten.graph.lint()
        rewritten.recompile()
    except Exception as exc:
        lint_error = f"{type(exc).__name__}: {exc}"

    samples = random_inputs(example_inputs, n_inputs, seed)
    ref = run_outputs(original, samples)
    try:
        new = run_outputs(rewritten, samples)
        max_err, why = compare_outputs(ref, new, tol)
    except Exception as exc:
        max_err, why = math.inf, f"rewritten model failed to run: {type(exc).__name__}: {exc}"

    grad_ok: bool | None = None
    grad_err: float | None = None
    grad_detail: str | None = None
    if check_grad and why is None:
        try:
            g_ref = _input_grads(original, samples[0], seed)
        except Exception as exc:
            grad_detail = f"original model has no input gradient ({type(exc).__name__})"
        else:
            try:
                g_new = _input_grads(rewritten, samples[0], seed)
                grad_err = max((float((a - b).abs().max()) for a, b in zip(g_ref, g_new)), default=0.0)
                scale = max((float(a.abs().max()) for a in g_ref), default=0.0)
                grad_ok = grad_err <= tol.atol * 10 + tol.rtol * 10 * scale
                if not grad_ok:
                    grad_detail = f"input-gradient max abs error {grad_err:.3g}"
            except Exception as exc:
                grad_detail = f"not applicable: the rewritten kernels are inference-only ({type(exc).__name__})"

    return VerifyResult(
        pass_name=pass_.pass_name,
        matches=result.matches,
        n_inputs=n_inputs,
        max_abs_err=max_err,
        numerics_ok=why is None,
        numerics_detail=why,
        grad_ok=grad_ok,
        grad_max_err=grad_err,
        grad_detail=grad_detail,
        lint_ok=lint_error is None,
        lint_error=lint_error,
        params_before=count_state(original),
        params_after=count_state(rewritten),
        skips=[str(s) for s in result.skips],
    )
