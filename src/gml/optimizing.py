"""``gml.optimize``: the fp32 / bf16 pipeline on a copy of the model, checked pass by pass, and the
native engine attached (:func:`optimize`, :func:`optimize_graph`: the same from a captured graph,
which ``gml.quantize``'s whole-model guard continues from). Public names are re-exported by
:mod:`gml.api`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gml.capture import capture, check_deterministic, check_eval_mode, check_finite_parameters
from gml.errors import InputError
from gml.inference import refuse_autograd
from gml.ir.target import Target
from gml.memory import returns_memory
from gml.passes.base import GraphPass
from gml.passes.manager import PassManager, compare_outputs, run_outputs
from gml.results import OptimizeResult
from gml.runtime.options import EngineOptions, resolve_options
from gml.verify.harness import random_inputs, verify_pass

verify = verify_pass


def _inputs_of_batch(model: nn.Module, batch: Any) -> tuple:
    """The model's inputs in calibration batch ``batch``: the tensor, or the leading items of a tuple
    that ``forward`` takes positionally — every required parameter's, then the optional ones' (an
    HF ``(input_ids, attention_mask)`` batch: both optional; ``(ids, None, mask)`` skips a decoder's
    cache) — minus a trailing label: an integer tensor of rank <= 1 after an input of higher rank
    (``(x, label)`` for ``forward(x, mask=None)``, ``(ids, mask, labels)``). It took the required
    items only: an HF model was quantized without its attention mask (every parameter optional), and
    before that ``batch[0]`` alone (a two-input model failed with a bare "StopIteration", issue #24)."""
    import inspect

    if isinstance(batch, Mapping):
        return forward_inputs(model, batch)
    if isinstance(batch, torch.Tensor) or not isinstance(batch, list | tuple):
        return (batch,)
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return tuple(batch)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return tuple(batch)
    positional = [
        p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    items = list(batch[: max(len(positional), 1)])
    first = items[0] if items and isinstance(items[0], torch.Tensor) else None

    def label(x: Any) -> bool:
        integer = isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex()
        return integer and first is not None and x.dim() <= 1 < first.dim()

    while len(items) > max(required, 1) and (label(items[-1]) or items[-1] is None):
        items.pop()
    return tuple(items)


def forward_inputs(model: nn.Module, named: Mapping[str, Any]) -> tuple:
    """Inputs given by name (a tokenizer's ``BatchEncoding``, ``{"input_ids": ..., "attention_mask":
    ...}``) as the positional tuple GML captures with: ``forward``'s parameters in order up to the
    last one given, None for an optional one left out (HF's ``token_type_ids``: its default). A
    parameter left out whose default is not None is refused (passing None would change what the
    model computes), as are names ``forward`` does not take positionally."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError) as e:
        raise InputError(
            f"inputs given by name, but {type(model).__name__}.forward has no signature to place them by.",
            hint="pass the inputs as a tuple, in forward's order.",
        ) from e
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in kinds]
    names = [p.name for p in positional]
    for key in named:
        if key not in names:
            raise InputError(
                f"{type(model).__name__}.forward takes no input {key!r} that GML can pass positionally.",
                hint=f"its positional inputs: {', '.join(names) or '(none)'}.",
            )
    last = max((names.index(k) for k in named), default=-1)
    out: list[Any] = []
    for p in positional[: last + 1]:
        if p.name in named:
            out.append(named[p.name])
        elif p.default is None:
            out.append(None)
        else:
            missing = "required" if p.default is inspect.Parameter.empty else f"defaults to {p.default!r}"
            raise InputError(
                f"input {p.name!r} of {type(model).__name__}.forward ({missing}) was not given, "
                "but an input after it was.",
                hint=f"give {p.name!r} too, or pass the inputs as a tuple in forward's order.",
            )
    return tuple(out)


def _as_tuple(example_inputs: Any, model: nn.Module) -> tuple:
    if isinstance(example_inputs, list | tuple) and len(example_inputs) == 1 and isinstance(example_inputs[0], Mapping):
        example_inputs = example_inputs[0]  # ``(tokenizer(...),)``: the inputs by name, wrapped
    if isinstance(example_inputs, Mapping):
        return forward_inputs(model, example_inputs)
    return tuple(example_inputs) if isinstance(example_inputs, list | tuple) else (example_inputs,)


def positional_batches(model: nn.Module, data: Any) -> Any:
    """Calibration / evaluation ``data`` with every batch given by name (a dict) made positional
    (:func:`forward_inputs`); a list stays a list, another iterable is mapped as it is read."""
    if data is None or isinstance(data, int | torch.Tensor | Mapping):
        return forward_inputs(model, data) if isinstance(data, Mapping) else data
    if isinstance(data, list | tuple):
        return [forward_inputs(model, b) if isinstance(b, Mapping) else b for b in data]
    return _PositionalBatches(model, data)


class _PositionalBatches:
    """An iterable of batches read through :func:`forward_inputs` (``len`` where the source has one)."""

    def __init__(self, model: nn.Module, data: Any) -> None:
        self.model, self.data = model, data

    def __iter__(self) -> Any:
        return (forward_inputs(self.model, b) if isinstance(b, Mapping) else b for b in self.data)

    def __len__(self) -> int:
        return len(self.data)


@returns_memory
def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    passes: Sequence[GraphPass] | None = None,
    strict: bool = False,
    leaf_modules: Sequence[str | type] = (),
    n_check_inputs: int = 3,
    precision: str = "fp32",
    runtime: str = "engine",
    target: Target | None = None,
    options: EngineOptions | None = None,
) -> OptimizeResult:
    """Run the fp32 pipeline (normalize → untie → fold BN → fuse) on a copy of ``model``.

    Every pass is checked against the outputs before it on ``example_inputs`` plus seeded random
    inputs of the same shapes; a pass that breaks numerics or lint is rolled back (``strict``: raised).

    ``runtime``: ``engine`` (default: the optimized graph also compiled for the native oneDNN engine,
    ``result.engine``, where it covers the graph and agrees with the Python executor on
    ``example_inputs``; ``result.executable`` is what to call, ``result.runtime`` says which path
    runs each node) or ``torch`` (the Python executor only).

    ``precision="bf16"`` adds :class:`~gml.passes.bf16.LowerToBf16` (bf16 weights and activations,
    fp32 accumulation, LayerNorm/softmax/reductions/outputs in fp32; ``result.precision`` lists every
    op's precision and why). On a CPU without native bf16 it warns and returns the fp32 model
    (``result.precision.warnings``); never a slow emulation. A bf16 graph the engine covers only in
    part stays on the executor (measured faster than engine segments between torch nodes).

    ``target``: the CPU to plan for (:class:`~gml.ir.target.Target`; default: this process's,
    detected once here — ``ONEDNN_MAX_CPU_ISA`` honoured). ``options``: the engine's switches
    (:class:`~gml.runtime.options.EngineOptions`; default: the ``GML_*`` variables', read here).
    """
    from gml.runtime.select import check_runtime
    from gml.runtime.target import resolve

    check_precision(precision)
    check_runtime(runtime)
    target, options = resolve(target), resolve_options(options)
    inputs = _as_tuple(example_inputs, model)
    check_eval_mode(model)
    check_finite_parameters(model)
    check_deterministic(model, inputs)
    # Capture first: it turns a wrong input (shape, dtype, count) into the user's error; running the
    # eager copy first (one copy of the weights alive at a time, #28) raised torch's raw error instead
    gm = capture(copy.deepcopy(model), inputs, leaf_modules=leaf_modules)
    ref = run_outputs(copy.deepcopy(model), [inputs])  # a copy: forward may update buffers
    return optimize_graph(
        gm, inputs, ref, passes=passes, strict=strict, n_check_inputs=n_check_inputs, precision=precision,
        runtime=runtime, target=target, options=options,
    )  # fmt: skip


def optimize_graph(
    gm: Any,
    inputs: tuple,
    eager_outputs: list,
    *,
    passes: Sequence[GraphPass] | None = None,
    strict: bool = False,
    n_check_inputs: int = 3,
    precision: str = "fp32",
    runtime: str = "engine",
    target: Target | None = None,
    options: EngineOptions | None = None,
) -> OptimizeResult:
    """:func:`optimize` from a captured graph ``gm`` (used in place; its tensors are replaced, never
    written) whose outputs on ``inputs`` the model gave as ``eager_outputs``
    (:func:`~gml.passes.manager.run_outputs`). ``gml.quantize``'s whole-model guard builds its fp32
    model this way from the graph it captured once (issue #25): the canonical passes that already ran
    on it change nothing, and the model's weights are not copied again (#28)."""
    from gml.passes.pipeline import fp32_passes
    from gml.runtime.select import FP32_TOLERANCE, INT8_TOLERANCE, attach_runtime
    from gml.runtime.target import resolve

    target, options = resolve(target), resolve_options(options)
    samples = [inputs, *random_inputs(inputs, max(0, n_check_inputs - 1), seed=1)]
    ref = eager_outputs
    pipeline = list(passes) if passes is not None else fp32_passes()
    refusal = _bf16_refusal(target) if precision == "bf16" else None
    if precision == "bf16" and refusal is None:
        from gml.passes.bf16 import LowerToBf16

        pipeline.append(LowerToBf16(target=target))
    result = PassManager(pipeline, strict=strict).run(gm, samples)
    err, _ = compare_outputs(ref, run_outputs(result.graph_module, samples[:1]), None)
    scale = max(
        (float(t.abs().max()) for outs in ref for t in outs if t.numel() and t.is_floating_point()), default=0.0
    )
    refuse_autograd(result.graph_module)
    out = OptimizeResult(result.graph_module, result.report, err, scale, example_inputs=inputs)
    bf16 = False
    if precision == "bf16":
        from gml.passes.bf16 import bf16_outcome

        out.precision = bf16_outcome(result.graph_module, result.report, refusal)
        bf16 = out.precision.effective == "bf16"
    # bf16 on both sides still rounds differently (fusion order, bf16 stores): the INT8 bound applies
    tolerance = INT8_TOLERANCE if bf16 else FP32_TOLERANCE
    out.engine, out.runtime = attach_runtime(
        result.graph_module, inputs, runtime, tolerance=tolerance, target=target, options=options
    )
    if bf16 and out.engine is not None and out.runtime.path != "engine" and _bf16_compute_in_torch(out.runtime):
        # Measured (benchmarks/bf16.py, MiniLM seq128, Zen 4): a bf16 graph whose kernels the engine
        # covers only in part ran slower as segments between torch nodes (122 ms) than on the
        # executor (108). Cheap torch nodes around whole engine-run layers (a transformer's
        # embedding lookups and mask arithmetic) do not count.
        from gml.runtime.compile import RuntimeReport

        covered = f"{out.runtime.engine_nodes} of {len(out.runtime.nodes)} nodes"
        note = f"the engine covers part of this bf16 graph ({covered}); mixed runs measured slower: using torch"
        out.engine, out.runtime = None, RuntimeReport("torch", nodes=out.runtime.nodes, note=note, target=target)
    if out.engine is not None:
        # the error reported is the one of what the user calls (result.executable), not the executor's
        out.max_abs_err, _ = compare_outputs(ref, run_outputs(out.engine, samples[:1]), None)
    return out


#: nodes whose compute a mixed bf16 graph must not leave in torch (see optimize)
_BF16_COMPUTE = frozenset({"Bf16Conv", "Bf16ConvAdd", "Bf16Linear", "attention", "LayerNorm"})


def _bf16_compute_in_torch(report: Any) -> bool:
    """Whether a bf16 kernel, attention or LayerNorm node runs in torch, or a shape fell back."""
    return bool(report.shape_fallbacks) or any(n.op in _BF16_COMPUTE for n in report.torch_nodes)


PRECISIONS = ("fp32", "bf16")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        from gml.errors import InputError

        raise InputError(f"unknown precision {precision!r}.", hint=f"use one of: {', '.join(PRECISIONS)}.")


def _bf16_refusal(target: Target) -> str | None:
    """Why bf16 is refused on ``target`` (a warning is issued), or None. The CPU probe is
    :func:`gml.kernels.bf16.bf16_unavailable_reason` (monkeypatch it to simulate a CPU)."""
    import warnings

    from gml.kernels import bf16 as kb

    why = kb.bf16_unavailable_reason(target)
    if why is None:
        return None
    msg = f"bf16 requested but {why}; returning the fp32 model instead"
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return msg
