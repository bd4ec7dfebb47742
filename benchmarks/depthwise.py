"""GML's depthwise INT8 conv (native/dw_int8.h, #23) against oneDNN's, in one process.

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/depthwise.py [--threads 2] [--rounds 30]
                                                          [--models mobilenet_v2 ...] [--skip-convs]

* Per conv: depthwise shapes of MobileNetV2 (3x3, strides 1 and 2, ReLU6), EfficientNet / MNASNet
  (5x5) and ConvNeXt (7x7), u8 in and out, 8-bit weights, as one-conv engine plans built with
  ``winograd="0"`` (oneDNN's direct conv) and ``"1"`` (GML's own INT8 convs forced), timed
  alternately; minimum over the rounds, and whether both outputs are equal.
* Models (torchvision, random init with BatchNorm statistics set by train-mode passes over generated
  batches: a random-init MobileNet's statistics are degenerate) through ``gml.quantize``, engines
  built with ``winograd="0"`` and ``auto`` (GML's kernels where timed faster at plan build), timed
  interleaved at batch 1; medians, and how many depthwise convs took GML's kernel.

GML's own INT8 convs are for targets without VNNI (``Target.int8_winograd``): run with
``ONEDNN_MAX_CPU_ISA=AVX2`` on a bigger CPU. Prints the CPU and oneDNN's ISA; read ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from winograd import interleaved  # benchmarks/winograd.py: engines timed in turn
from winograd import winograd as engine_options  # EngineOptions with winograd=mode

#: (channels, side, kernel, stride, model it is from)
CONVS = [
    (32, 112, 3, 1, "MobileNetV2"),
    (96, 112, 3, 2, "MobileNetV2"),
    (144, 56, 3, 1, "MobileNetV2"),
    (192, 28, 3, 1, "MobileNetV2"),
    (576, 14, 3, 2, "MobileNetV2"),
    (960, 7, 3, 1, "MobileNetV2"),
    (240, 28, 5, 1, "EfficientNet / MNASNet"),
    (672, 14, 5, 2, "EfficientNet / MNASNet"),
    (96, 56, 7, 1, "ConvNeXt"),
]


def per_conv(rounds: int) -> None:
    from gml.ir.values import PostOp, QParams
    from gml.runtime import compile_engine
    from runtime.helpers import graph_of, qconv

    print("\n| conv | from | oneDNN µs | GML µs | GML / oneDNN | kernel |")
    print("|---|---|---:|---:|---:|---|")
    for c, hw, k, s, model in CONVS:
        torch.manual_seed(0)
        mod = qconv(
            c,
            c,
            k,
            stride=(s, s),
            padding=(k // 2, k // 2),
            groups=c,
            in_qp=QParams(0.05, 0),
            out_qp=QParams(0.03, 0),
            post_op=PostOp("hardtanh", (0.0, 6.0)),
        )
        x = torch.randint(0, 256, (1, c, hw, hw), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            eng = {m: compile_engine(graph_of(mod), [x], options=engine_options(m)) for m in ("0", "1")}
            times = interleaved(eng, x, rounds)
            same = "equal outputs" if torch.equal(eng["0"](x), eng["1"](x)) else "outputs DIFFER"
        a, b = min(times["0"]) * 1e6, min(times["1"]) * 1e6
        conv = f"{c} ch {k}×{k}/{s} @ {hw}²"
        print(
            f"| {conv} | {model} | {a:.0f} | {b:.0f} | {b / a:.2f} | {eng['1'].step_impls()[0][1]}, {same} |",
            flush=True,
        )


def _with_bn_statistics(name: str) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 224, 224))
    return model.eval()


def models(names: list[str], rounds: int) -> None:
    import gml

    print("\n| model | direct only ms | auto ms | auto / direct | GML depthwise convs |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        model = _with_bn_statistics(name)
        x = torch.randn(1, 3, 224, 224)
        calib = [torch.randn(1, 3, 224, 224) for _ in range(8)]
        engines = {}
        for mode in ("0", "auto"):
            q = gml.quantize(model, calib, example_inputs=(x,), options=engine_options(mode))
            if q.precision != "int8":
                print(f"| {name} | gml.quantize returned {q.precision} | | | |")
                break
            engines[mode] = q.engine
        if len(engines) < 2:
            continue
        times = interleaved(engines, x, rounds)
        a, b = (statistics.median(times[m]) * 1e3 for m in ("0", "auto"))
        dw = sum(impl.startswith("gml:dw") for _, impl in engines["auto"].step_impls())
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.3f} | {dw} |", flush=True)


def main() -> None:
    from gml.kernels.bf16 import cpu_description
    from gml.runtime.target import detect_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--models", nargs="*", default=["mobilenet_v2", "mnasnet1_0", "mobilenet_v3_large", "convnext_tiny"])
    p.add_argument("--skip-convs", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{cpu_description()}; target {detect_target().describe()}; threads {args.threads}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if not args.skip_convs:
        per_conv(args.rounds)
    if args.models:
        models(args.models, args.rounds)


if __name__ == "__main__":
    main()
