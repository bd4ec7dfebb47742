"""One dynamic INT8 GEMM (``gml::dynamic_linear``, ADR 008) on MiniLM's sizes: the native engine
against the Python kernel (``int8_matmul``'s fp32 chunks + torch ops), ONNX Runtime's dynamic INT8
(``quantize_dynamic``: DynamicQuantizeLinear + MatMulInteger, per-tensor activation scale) and fp32
``F.linear``, interleaved round by round, the same thread count for all.

    python benchmarks/dynamic_gemm.py [--threads 1] [--rounds 200] [--shapes 11x384x384,...]

Shapes are ``MxKxN`` (rows = tokens x batch). ``engine`` is the compiled EngineModule called from
Python (its per-call wrapper included), ``plan.run`` the native plan alone (pointers prepared once:
what one engine segment costs inside a larger model). Prints the median µs per call of each variant
and the ratios; ``uptime``'s load and the CPU go with the numbers (the machine is shared).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch
from torch import fx, nn

DEFAULT_SHAPES = "11x384x384,11x384x1536,128x384x384,128x384x1536,128x1536x384"


def _graph(k: int, n: int, post_op: str, weight_qmax: int = 127) -> fx.GraphModule:
    from gml.ir.library import op
    from gml.kernels.int8_ops import register
    from gml.quant.transformer import DynamicQuantLinear

    register()
    torch.manual_seed(0)
    lin = nn.Linear(k, n)
    q = DynamicQuantLinear(lin, weight_qmax=weight_qmax)
    root, g = nn.Module(), fx.Graph()
    x = g.placeholder("x")
    for name in ("weight", "weight_scale", "bias"):
        root.register_buffer(name, getattr(q, name))
    consts = [g.get_attr(name) for name in ("weight", "weight_scale", "bias")]
    g.output(
        g.call_function(op("dynamic_linear"), (x, *consts, None, post_op, [], "none" if post_op == "gelu" else ""))
    )
    return fx.GraphModule(root, g), lin


def _ort(lin: nn.Linear, m: int, threads: int, tmp: str):
    """ORT session of ``x @ W^T + b`` quantized with ``quantize_dynamic`` (per-channel weights)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    w = numpy_helper.from_array(lin.weight.detach().t().contiguous().numpy(), "W")
    b = numpy_helper.from_array(lin.bias.detach().numpy(), "B")
    k, n = lin.in_features, lin.out_features
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fp32, q8 = os.path.join(tmp, f"g{m}_{k}_{n}.onnx"), os.path.join(tmp, f"g{m}_{k}_{n}.int8.onnx")
    onnx.save(model, fp32)
    logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's "consider pre-processing" advice
    quantize_dynamic(fp32, q8, weight_type=QuantType.QInt8, per_channel=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(q8, so, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"x": x})[0], np.float32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--post-op", default="none", choices=("none", "relu", "gelu"))
    ap.add_argument(
        "--weight-qmax", type=int, default=127, choices=(127, 64),
        help="int8 weights in [-q, q]: 64 (7 bits) takes the AVX2 kernel's u8 path (native/int8_gemm_avx2.h)",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")

    from transformer_latency import _cpu  # benchmarks/ is the script's directory

    torch.set_num_threads(args.threads)
    print(f"CPU: {_cpu()}; torch {torch.__version__}; {args.threads} thread(s); load {os.getloadavg()[0]:.1f}")
    print(f"post-op {args.post_op}; median µs per call over {args.rounds} interleaved rounds")
    header = (f"{'M x K x N':>16} {'engine':>9} {'plan.run':>9} {'py-kernel':>9} {'ort-dyn':>9} {'fp32':>9}"
              "  engine/py  engine/ort  run/ort  engine/fp32")  # fmt: skip
    print(header)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for shape in args.shapes.split(","):
            m, k, n = (int(v) for v in shape.split("x"))
            med = _time_shape(m, k, n, args, tmp)
            ort_ = med.get("ort-dyn", float("nan"))
            print(
                f"{shape:>16} {med['engine']:9.1f} {med['plan.run']:9.1f} {med['py-kernel']:9.1f} {ort_:9.1f}"
                f" {med['fp32']:9.1f}  {med['engine'] / med['py-kernel']:9.2f}  {med['engine'] / ort_:10.2f}"
                f"  {med['plan.run'] / ort_:7.2f}  {med['engine'] / med['fp32']:11.2f}"
            )


def _time_shape(m: int, k: int, n: int, args: argparse.Namespace, tmp: str) -> dict[str, float]:
    """Median µs per call of each variant on one ``M x K x N`` GEMM, interleaved round by round."""
    from gml.runtime import compile_engine
    from gml.runtime.compile import EngineSegment

    gm, lin = _graph(k, n, args.post_op, args.weight_qmax)
    x = torch.randn(m, k)
    eng = compile_engine(gm, [x])
    assert eng.report.path == "engine", str(eng.report)
    act = {"none": lambda y: y, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[args.post_op]
    seg = next(s_ for s_ in eng.modules() if isinstance(s_, EngineSegment))
    plan, _ = seg.plan_for([x])
    out = torch.empty(m, n)
    ptr_in, ptr_out = [x.data_ptr()], [out.data_ptr()]
    variants = {
        "engine": lambda: eng(x),
        "plan.run": lambda: plan.run(ptr_in, ptr_out, args.threads),
        "py-kernel": lambda: gm(x),
        "fp32": lambda: act(lin(x)),
    }
    try:
        run_ort, _ = _ort(lin, m, args.threads, tmp)
        xn = x.numpy()
        variants["ort-dyn"] = lambda: run_ort(xn)
    except ImportError as e:
        print(f"  (ONNX Runtime not installed: {e}; make install-bench)")
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for f in variants.values():
        for _ in range(20):
            f()
    for _ in range(args.rounds):
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {k_: statistics.median(v) for k_, v in times.items()}


if __name__ == "__main__":
    main()
