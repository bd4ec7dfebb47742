"""The native engine (gml.runtime) vs the Python executor vs OpenVINO / ONNX Runtime, and its per-op cost.

    .venv/bin/python benchmarks/engine_resnet18.py [--batch 1 8] [--rounds 15] [--threads 2] [--no-openvino]
        [--fp32] [--models mobilenet_v2 resnet50] [--skip-resnet18]

* ResNet18 INT8 (random init, 224x224, one ``gml.quantize`` with 8 generated calibration batches):
  ``python`` = the lowered GraphModule run by torch (one ATen/ideep call per op), ``engine`` = the
  same graph as one oneDNN plan (``result.engine``), ``openvino`` = NNCF PTQ on OpenVINO (the
  ``[bench]`` extra; skipped with a line when not installed), each at every batch size.
* ``--fp32``: ResNet18 fp32 bs1 through ``gml.optimize`` (``python`` = the fused GraphModule,
  ``engine`` = ``result.engine``) vs ONNX Runtime fp32 and OpenVINO fp32
  (``INFERENCE_PRECISION_HINT=f32``), built as ``gml bench``'s ``ort-fp32`` / ``ov-fp32`` variants.
* ``--models``: more torchvision models, INT8 bs1, engine vs OpenVINO INT8 (#13: MobileNetV2 and
  ResNet50 at <= 0.9x OpenVINO).
* Per-op overhead: a chain of 100 INT8 1x1 convs on 1x64x8x8 (the tiny conv of issue #13), engine
  and Python executor; the engine's time per op is the number docs/benchmarks.md quotes.

Latency: interleaved rounds (:func:`gml.bench.runner.time_interleaved`: every variant once per
round, shuffled), medians. Other processes share the cores: read ratios within one run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path

import torch
import torchvision
from torch import fx, nn

import gml
from gml.bench.runner import time_interleaved
from gml.ir.values import ConvSpec, QParams
from gml.quant import modules as qm
from gml.quant.lower import emit_op_calls
from gml.runtime import compile_engine


def cpu_name() -> str:
    name, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX-512 VNNI'})"


def openvino_int8(model: nn.Module, example: tuple[torch.Tensor, ...], calib: list, threads: int):
    from gml.bench.variants import BuildContext, VariantSkipped, build_ov_int8

    try:
        built = build_ov_int8(BuildContext(model, example, calib, threads, Path(tempfile.mkdtemp())))
    except VariantSkipped as e:
        print(f"openvino: skipped ({e})")
        return None
    feed = built.native(example)
    return lambda: built.run(feed), built


def peer_variant(name: str, model: nn.Module, example: tuple, threads: int):
    """``gml bench``'s variant ``name`` (e.g. ``ort-fp32``, ``ov-fp32``) as a timed call, or None."""
    from gml.bench.variants import VARIANTS, BuildContext, VariantSkipped

    try:
        built = VARIANTS[name].build(BuildContext(model, example, [example], threads, Path(tempfile.mkdtemp())))
    except (VariantSkipped, ImportError) as e:
        print(f"{name}: skipped ({e})")
        return None
    feed = built.native(example)
    return lambda: built.run(feed)


def int8_rows(name: str, batches: list[int], args: argparse.Namespace) -> list[tuple]:
    """INT8 ``name`` (torchvision, random init) at each batch size: python / engine / OpenVINO."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    rows = []
    for bs in batches:
        example = (torch.randn(bs, 3, 224, 224),)
        calib = [(torch.randn(bs, 3, 224, 224, generator=torch.Generator().manual_seed(i)),) for i in range(8)]
        res = gml.quantize(model, calib, example_inputs=example, per_layer=False)
        print(f"{name} bs{bs} INT8 {res.runtime}")
        py_mod, eng_mod = res.module, res.executable
        calls = {"python": lambda: py_mod(*example), "engine": lambda: eng_mod(*example)}  # noqa: B023
        ov = None if args.no_openvino else openvino_int8(model, example, calib, args.threads)
        if ov is not None:
            calls["openvino"] = ov[0]
        with torch.no_grad():
            fp32, eng, py = model(*example), eng_mod(*example), py_mod(*example)
            cos = float(torch.nn.functional.cosine_similarity(fp32.flatten(), eng.flatten(), dim=0))
            cos_py = float(torch.nn.functional.cosine_similarity(fp32.flatten(), py.flatten(), dim=0))
            samples = time_interleaved(calls, rounds=args.rounds, threads=args.threads)
        med = {k: statistics.median(v) for k, v in samples.items()}
        rows.append((bs, med, cos, cos_py))
        print(f"{name} bs{bs}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
              + f"; cosine vs fp32: engine {cos:.5f}, python {cos_py:.5f}")
    return rows


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n| {title} | " + " | ".join(f"bs{bs} ms" for bs, *_ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in rows[0][1]:
        print(f"| {name} | " + " | ".join(f"{r[1][name]:.2f}" for r in rows) + " |")
    if "openvino" in rows[0][1]:
        print("| engine / openvino | " + " | ".join(f"{r[1]['engine'] / r[1]['openvino']:.2f}" for r in rows) + " |")
    print("| engine / python | " + " | ".join(f"{r[1]['engine'] / r[1]['python']:.2f}" for r in rows) + " |")
    print("| cosine vs fp32 (engine / python) | " + " | ".join(f"{r[2]:.5f} / {r[3]:.5f}" for r in rows) + " |")


def fp32_resnet18(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    example = (torch.randn(1, 3, 224, 224),)
    res = gml.optimize(model, example)
    print(f"resnet18 fp32 {res.runtime}")
    py_mod, eng_mod = res.module, res.executable
    calls = {"python": lambda: py_mod(*example), "engine": lambda: eng_mod(*example)}
    for peer, label in (("ort-fp32", "onnxruntime"), ("ov-fp32", "openvino")):
        call = None if args.no_openvino and peer.startswith("ov") else peer_variant(peer, model, example, args.threads)
        if call is not None:
            calls[label] = call
    with torch.no_grad():
        err = float((eng_mod(*example) - model(*example)).abs().max())
        samples = time_interleaved(calls, rounds=args.rounds, threads=args.threads)
    med = {k: statistics.median(v) for k, v in samples.items()}
    peers = [med[k] for k in ("onnxruntime", "openvino") if k in med]
    print("\n| ResNet18 fp32 bs1 | ms |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    if peers:
        print(f"| engine / faster peer | {med['engine'] / min(peers):.2f} |")
    print(f"| max abs diff engine vs eager | {err:.2e} |")


def conv_chain(n: int = 100, c: int = 64, hw: int = 8) -> fx.GraphModule:
    """``n`` INT8 1x1 convs (ReLU) in a chain on uint8 ``[1, c, hw, hw]``, as ``gml.qconv`` calls."""
    root, g = nn.Module(), fx.Graph()
    v = g.placeholder("x")
    qp = QParams(0.05, 0)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        w = torch.randint(-127, 128, (c, c, 1, 1), dtype=torch.int8, generator=gen)
        conv = qm.QConv2d(w, torch.full((c,), 1e-3), torch.zeros(c), ConvSpec(), qp, qp, relu=True)
        root.add_module(f"c{i}", conv)
        v = g.call_module(f"c{i}", (v,))
    g.output(v)
    gm = fx.GraphModule(root, g)
    emit_op_calls(gm, lambda node: getattr(root, str(node.target)) if node.op == "call_module" else None)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-openvino", action="store_true")
    ap.add_argument("--fp32", action="store_true", help="also ResNet18 fp32 bs1 vs ONNX Runtime / OpenVINO fp32")
    ap.add_argument("--models", nargs="*", default=[], help="more torchvision models, INT8 bs1")
    ap.add_argument("--skip-resnet18", action="store_true", help="no ResNet18 INT8 / per-op section")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}; threads {args.threads}; oneDNN ISA {gml.runtime.native.load().cpu_isa()}")
    if Path("/proc/loadavg").exists():
        print(f"load average at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    for name in args.models:
        print_table(f"{name} INT8", int8_rows(name, [1], args))
    if args.fp32:
        fp32_resnet18(args)
    if args.skip_resnet18:
        return

    rows = int8_rows("resnet18", args.batch, args)

    chain = conv_chain()
    x = torch.randint(0, 256, (1, 64, 8, 8), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    eng = compile_engine(chain, (x,))
    with torch.no_grad():
        s = time_interleaved({"python": lambda: chain(x), "engine": lambda: eng(x)}, rounds=args.rounds,
                             threads=args.threads)
    per_op = {k: statistics.median(v) * 1e3 / 100 for k, v in s.items()}
    print(f"100 tiny convs (1x64x8x8, 1x1): engine {per_op['engine']:.2f} us/op, python {per_op['python']:.2f} us/op")

    print_table("ResNet18 INT8", rows)


if __name__ == "__main__":
    main()
