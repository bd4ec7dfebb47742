"""Model-zoo sweep: torchvision and timm families through ``gml.optimize`` and ``gml.quantize``.

Per model (random init, batch 1, the model's default resolution): BatchNorm left after the fp32
pipeline, INT8 conv/linear coverage, cosine of GML INT8 vs fp32 and vs torch.ao's reference Q/DQ
graph (the same quantization run by torch's reference ops: what the lowering must reproduce),
the worst layer when that cosine is below 0.99, latency of eager / GML fp32 / GML INT8 (median of
interleaved rounds), and any failure with its message. No hand fixes: no leaf modules, no
concrete_args — what a new user gets.

    python benchmarks/zoo_sweep.py                       # every model below, writes docs/coverage.md
    python benchmarks/zoo_sweep.py --models timm:resnet18 timm:efficientnet_b0 --out /tmp/x.md
    python benchmarks/zoo_sweep.py --jobs 2 --threads 1  # two models at a time, one thread each

Each model runs in its own process (a crash or hang costs one row, ``--timeout`` seconds).
Results append to a JSON-lines file as they come (``--results``), so a run can be rendered while
it goes (``--render-only``); ``--append`` adds a re-run of some models to that file (a model's
last row wins).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TORCHVISION = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "regnet_y_400mf", "shufflenet_v2_x1_0"]
#: one small member per timm family (the families of issue #16 first)
TIMM = [
    "tf_efficientnet_lite0",
    "tf_efficientnetv2_b0",
    "gcresnet33ts",
    "efficientnet_b0",
    "mobilenetv3_large_100",
    "mobilenetv4_conv_small",
    "mixnet_s",
    "rexnet_100",
    "regnetx_002",
    "regnety_002",
    "mobileone_s0",
    "cspresnet50",
    "repvgg_a0",
    "nf_resnet26",
    "resnetv2_50x1_bit",
    "vgg11_bn",
    "resnet18",
    "resnet26d",
    "seresnext26d_32x4d",
    "skresnet18",
    "resnest14d",
    "res2net50_14w_8s",
    "dla34",
    "densenet121",
    "ghostnet_100",
    "hrnet_w18_small",
    "selecsls42b",
    "tinynet_a",
    "lcnet_050",
    "fbnetc_100",
    "spnasnet_100",
    "mnasnet_100",
    "semnasnet_100",
    "hardcorenas_a",
    "efficientnet_lite0",
    "mobilenetv2_050",
    "ese_vovnet19b_dw",
    "ecaresnet26t",
    "resnet10t",
    "legacy_seresnet18",
    "dpn48b",
    "cs3darknet_s",
    "repghostnet_050",
    "tf_mixnet_s",
    "inception_v3",
    "xception41",
    "convnext_atto",
    "mobilevit_xs",
    "tiny_vit_5m_224",
    "levit_128s",
    # re-parameterisable and hybrid CNN families added on 2026-11-24
    "hgnetv2_b0",
    "starnet_s1",
    "repvit_m0_9",
    "fastvit_t8",
    # more families (2026-11-24, #16's >= 40 families): transformers, hybrids, metaformers, more CNNs
    "levit_conv_128s",
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "eva02_tiny_patch14_224",
    "poolformer_s12",
    "efficientformer_l1",
    "efficientformerv2_s0",
    "edgenext_xx_small",
    "coatnet_nano_rw_224",
    "maxvit_rmlp_nano_rw_256",
    "mobilevitv2_050",
    "gernet_s",
    "resnext26ts",
    "regnetz_b16",
    "nf_regnet_b0",
    "ghostnetv2_100",
    "efficientvit_b0",
    "efficientvit_m0",
    "pit_ti_224",
    "xcit_nano_12_p16_224",
    "visformer_tiny",
    "pvt_v2_b0",
    "fasternet_t0",
    "shvit_s1",
    "hgnet_tiny",
    "convmixer_1024_20_ks9_p14",
    "inception_v4",
    "convnextv2_atto",
    "botnet26t_256",
    "mambaout_femto",
    "mixer_s16_224",
    "dla46_c",
    "mobilenetv1_100",
]
MODELS = TORCHVISION + [f"timm:{n}" for n in TIMM]


def _cos(a: Any, b: Any) -> float:
    import torch.nn.functional as F

    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def latency_ms(fns: dict[str, Any], x: Any, rounds: int, inner: int) -> dict[str, float]:
    """Median ms per call of each function, measured in interleaved rounds (noise hits all alike)."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():  # warm up (oneDNN primitive creation, allocator)
            f(x)
            f(x)
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(inner):
                    f(x)
                times[k].append((time.perf_counter() - t0) * 1e3 / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def _bn_left(gm: Any) -> int:
    import torch.nn.functional as F
    from torch import nn

    mods = dict(gm.named_modules())
    n = 0
    for node in gm.graph.nodes:
        mod = mods.get(str(node.target)) if node.op == "call_module" else None
        n += isinstance(mod, nn.modules.batchnorm._BatchNorm) or node.target is F.batch_norm
    return n


def _bn_left_node(gm: Any, node: Any) -> bool:
    from torch import nn

    return isinstance(gm.get_submodule(str(node.target)), nn.modules.batchnorm._BatchNorm)


def _weighted(gm: Any) -> int:
    """conv / linear ops in a graph (modules and functional calls)."""
    import torch.nn.functional as F
    from torch import nn

    mods = dict(gm.named_modules())
    fns = {F.conv1d, F.conv2d, F.conv3d, F.linear}
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_module":
            m = mods.get(str(node.target))
            root = m[0] if isinstance(m, nn.Sequential) and len(m) else m
            n += isinstance(root, nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.Linear)
        elif node.op == "call_function" and node.target in fns:
            n += 1
    return n


#: the gml ops of conv / linear kernels (docs/ir.md): static INT8, and the transformer scheme's
#: per-token dynamic INT8 GEMM
WEIGHTED_OPS = ("qconv", "qconv_add", "qlinear", "dynamic_linear")


def _shrink(model: Any, shape: tuple[int, ...], max_side: int | None) -> tuple[int, ...]:
    """``shape`` with its spatial sides capped at ``max_side`` when the model runs at that size
    (CNNs with global pooling do; a ViT with a fixed patch grid raises and keeps its own size)."""
    import torch

    if not max_side or len(shape) != 4 or max(shape[2:]) <= max_side:
        return shape
    small = (*shape[:2], min(shape[2], max_side), min(shape[3], max_side))
    try:
        with torch.no_grad():
            model(torch.zeros(small))
    except Exception:  # the model's own size check: keep its declared size
        return shape
    return small


def _live_head(model: Any) -> bool:
    """Give a zero-initialised classifier (timm's ResMLP, Hiera, ... at random init) N(0, 0.02) weights:
    with it every output is 0, and no cosine below measures anything (they read 0.0). False where the
    model has no ``get_classifier`` linear (the row keeps its zero outputs)."""
    import torch
    from torch import nn

    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if isinstance(head, nn.Module) and not isinstance(head, nn.Linear):  # timm's ClassifierHead: its fc
        head = next((m for m in reversed(list(head.modules())) if isinstance(m, nn.Linear)), None)
    if not isinstance(head, nn.Linear):
        return False
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(2))
    return True


def run_one(
    spec: str, rounds: int, inner: int, calib: int, cost_policy: str = "measure", max_side: int | None = None
) -> dict[str, Any]:
    import warnings
    from collections import Counter

    import torch

    import gml
    from gml.ir import library
    from gml.models import default_input_shapes, load_model

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    row: dict[str, Any] = {"model": spec}
    t0 = time.perf_counter()
    model = load_model(spec)
    (shape,) = default_input_shapes(model, spec)[:1]
    shape = _shrink(model, shape, max_side)
    row["input"] = "x".join(map(str, shape))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x)
        if isinstance(y, torch.Tensor) and not y.any() and _live_head(model):
            row["head"] = "zero-initialised classifier given N(0, 0.02) weights"
            y = model(x)
    fns: dict[str, Any] = {"eager": model}
    try:
        opt = gml.optimize(model, (x,), n_check_inputs=1)  # each pass checked on the example input
        row["bn_left"] = _bn_left(opt.module)
        # why each BN stayed (FoldBatchNorm's reasons, deduplicated): what a fold rule should take next
        left = {n.name for n in opt.module.graph.nodes if n.op == "call_module" and _bn_left_node(opt.module, n)}
        bn_why = Counter(
            f"{sk.pattern}: " + re.sub(r"(reads|output is also read by) [\w, ]+", r"\1 …", sk.reason)
            for name, sk in opt.report.skips
            if name == "fold_bn" and sk.node in left  # a later pass (merge_branches) may have removed it
        )
        row["bn_skips"] = [f"{n}x {k}" for k, n in bn_why.most_common(6) if "LayerNorm" not in k]
        # a BN a conv/linear feeds (directly or through a reshape) that stayed: #16 says it must fold
        row["bn_after_layer"] = sum(
            n for k, n in bn_why.items() if "LayerNorm" not in k and ("nothing to fold" not in k or "reshape)" in k)
        )
        row["fp32_rel_err"] = opt.rel_err
        row["rolled_back"] = [r.name for r in opt.report.rolled_back]
        # what gml.optimize says to call (the engine where it covers the graph), as for INT8 below
        fns["gml_fp32"] = opt.executable
        row["fp32_runtime"] = opt.runtime.path if opt.runtime is not None else "torch"
        row["ref_steps"] = _ref_steps(opt.runtime, "fp32")
    except Exception as e:  # the row says what failed
        row["optimize_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    try:
        q = gml.quantize(
            model, calib, example_inputs=(x,), per_layer=False, cost_policy=cost_policy, keep_intermediates=True
        )
        # what the returned graph computes (its torch.ops.gml calls) vs what its report says
        in_graph = Counter(library.gml_op_name(n) for n in q.module.graph.nodes if library.gml_op_name(n))
        reported = Counter(e.result for e in q.coverage.lowered)
        int8_weighted = sum(in_graph[k] for k in WEIGHTED_OPS)
        row["int8_weighted"] = int8_weighted
        row["weighted"] = _weighted(q.reference)
        row["coverage"] = q.coverage.summary()
        boundary = {"quantize", "dequantize", "requantize"}  # conversions: not coverage entries
        int8_ops = set(library.SCHEMAS) - boundary  # the INT8 vocabulary (docs/ir.md)
        # INT8 ops: the coverage counts what the graph holds; every other gml op (gml.attention,
        # fp32/bf16 kernels) is listed with its precision and reason
        listed = {n for e in q.coverage.kept_fp32 for n in e.nodes} | {p.node for p in (q.precisions or [])}
        others = [n.name for n in q.module.graph.nodes if library.gml_op_name(n) not in (None, *int8_ops, *boundary)]
        row["coverage_agrees"] = all(in_graph[k] == reported[k] for k in {*WEIGHTED_OPS, *in_graph} & int8_ops) and all(
            n in listed for n in others
        )
        row["scheme"] = q.scheme
        row["precision"] = q.precision  # "fp32": the whole-model guard returned gml.optimize's model
        row["cost"] = str(q.cost)
        row["cost_kept_fp32"] = len(q.cost.kept_fp32) if q.cost is not None else 0
        if q.cost is not None and q.cost.whole is not None:
            row["guard_int8_ms"], row["guard_fp32_ms"] = q.cost.whole
        row["kept_fp32"] = [f"{','.join(e.nodes)}: {e.reason}" for e in q.coverage.kept_fp32][:8]
        row["lower_rolled_back"] = [f"{r.name}: {r.error}" for r in q.report.rolled_back]
        with torch.no_grad():
            yq, yr = q.module(x), q.reference(x)
        row["cos_fp32"] = _cos(yq, y)
        row["cos_ref"] = _cos(yq, yr)
        row["cos_ref_fp32"] = _cos(yr, y)
        if row["cos_ref"] < 0.99:
            from gml.quant.accuracy import accuracy_report

            acc = accuracy_report(q.reference, q.module, [x], per_layer=True)
            worst = min(acc.layers, key=lambda layer: layer.sqnr_db, default=None)
            row["worst_layer"] = f"{worst.node} ({worst.op}, SQNR {worst.sqnr_db:.1f} dB)" if worst else "?"
        row["runtime"] = q.runtime.path if q.runtime is not None else "torch"
        row["ref_steps"] = row.get("ref_steps", []) + _ref_steps(q.runtime, "int8")
        fns["gml_int8"] = q.executable  # what gml.quantize says to call: the engine where it covers the graph
    except Exception as e:
        row["quantize_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    row.update({f"ms_{k}": v for k, v in latency_ms(fns, x, rounds, inner).items()})
    row["seconds"] = time.perf_counter() - t0
    return row


def _ref_steps(runtime: Any, label: str) -> list[str]:
    """The engine steps that ran oneDNN's reference kernel (``RuntimeReport.reference_steps``): #23
    asks for none on any tier."""
    steps = getattr(runtime, "reference_steps", None) or {}
    return [f"{label} {name} ({impl})" for name, impl in steps.items()]


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    row = run_one(args.child, args.rounds, args.inner, args.calib, args.cost_policy, args.max_side)
    print("ZOO_ROW " + json.dumps(row))


def _run_in_process(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--threads", str(args.threads)]
    cmd += ["--rounds", str(args.rounds), "--inner", str(args.inner), "--calib", str(args.calib)]
    cmd += ["--cost-policy", args.cost_policy] + (["--max-side", str(args.max_side)] if args.max_side else [])
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": spec, "error": f"timed out after {args.timeout} s"}
    for line in out.stdout.splitlines():
        if line.startswith("ZOO_ROW "):
            return json.loads(line[len("ZOO_ROW ") :])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"model": spec, "error": tail[:300], "seconds": time.perf_counter() - t0}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in ("avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX-512 VNNI'})"


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _guard_returned_fp32(r: dict[str, Any]) -> bool:
    """The whole-model guard returned gml.optimize's model (its note is in the cost report)."""
    return "gml.optimize's model is returned" in r.get("cost", "") and bool(r.get("guard_int8_ms"))


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    size = ", "
    if meta.get("max_side"):
        size = f" capped at {meta['max_side']} px a side where the model runs at that size (column input), "
    lines = [
        "# Model-zoo coverage (torchvision + timm)",
        "",
        "Generated by `benchmarks/zoo_sweep.py` from a real run (do not edit by hand; re-run the script).",
        f"CPU: {meta['cpu']}; {meta['threads']} thread(s) per model, {meta['jobs']} model(s) at a time on a "
        f"shared machine; torch {meta['torch']}, timm {meta['timm']}; {meta['date']}.",
        "Random init (timm `pretrained=False`), batch 1, the model's default resolution"
        + size
        + f"{meta['calib']} generated calibration batches; latency = median of {meta['rounds']} interleaved rounds. "
        "No hand fixes (no leaf modules, no concrete_args). "
        f"`gml.quantize(..., cost_policy={meta.get('cost_policy', 'measure')!r})` (docs/cost-policy.md). "
        f"Machine load (1/5/15-min load average on 2 cores) when the run started: {meta.get('load', '?')}.",
        *([meta["note"]] if meta.get("note") else []),
        "",
        "Columns: **BN left** after the fp32 pipeline; **INT8 conv/linear** = conv/linear ops running on "
        "INT8 kernels / conv/linear ops in torch.ao's reference graph; **cos ao** = cosine of GML INT8 "
        "vs torch.ao's reference Q/DQ graph on the same input (< 0.99 is flagged with the worst layer); "
        "**cos fp32** = GML INT8 vs the fp32 model (random-init models can have near-degenerate "
        "outputs, so this one is informative only); **GML fp32 ms** / **GML INT8 ms** = `result.executable` of "
        "`gml.optimize` / `gml.quantize` (the native engine where it covers the graph, torch elsewhere); "
        "**ok** = the report's coverage matches the gml ops of the returned graph. A conv/linear the cost "
        "policy measured slower in INT8 is fp32 by decision (last section).",
        "",
        "| model | input | BN left | INT8 conv/linear | cos ao | cos fp32 | eager ms | GML fp32 ms | GML INT8 ms | "
        "INT8/fp32 | ok | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        notes = []
        for key in ("error", "optimize_error", "quantize_error"):
            if r.get(key):
                notes.append(f"{key.replace('_', ' ')}: {r[key]}")
        if r.get("worst_layer"):
            notes.append(f"**flagged**: worst layer {r['worst_layer']}")
            ref_fp32 = r.get("cos_ref_fp32", 1.0)
            if ref_fp32 < 0.5:
                notes.append(
                    f"torch.ao's own reference vs fp32: cos {ref_fp32:.4f} too (the random-init outputs vanish "
                    "below the INT8 step in both; a trained model is needed to judge this one)"
                )
            elif ref_fp32 < 0.99:
                notes.append(
                    f"torch.ao's own reference vs fp32: cos {ref_fp32:.4f} (this random-init model's INT8 error is "
                    "large in both; GML and the reference round differently at the flagged layer)"
                )
        if r.get("scheme") == "transformer":
            notes.append(
                "transformer scheme (per-token dynamic INT8 GEMMs, gml.dynamic_linear): its cos ao column is "
                "vs the fp32 graph (torch.ao has no reference for this scheme)"
            )
        if _guard_returned_fp32(r):
            notes.append("the whole-model guard returned gml.optimize's fp32 model (INT8 was not >= 10% faster)")
        if r.get("commit"):
            notes.append(f"measured on commit {r['commit']}")
        if r.get("lower_rolled_back"):
            notes.append("lowering rolled back: " + "; ".join(r["lower_rolled_back"])[:200])
        if r.get("ref_steps"):
            notes.append("**reference kernel steps**: " + ", ".join(r["ref_steps"])[:300])
        if r.get("rolled_back"):
            notes.append("fp32 passes rolled back: " + ", ".join(r["rolled_back"]))
        if r.get("bn_left") and r.get("bn_skips"):
            notes.append("BN left: " + "; ".join(r["bn_skips"][:3])[:400])
        ratio = r["ms_gml_int8"] / r["ms_gml_fp32"] if r.get("ms_gml_int8") and r.get("ms_gml_fp32") else None
        cov = f"{r['int8_weighted']}/{r['weighted']}" if "int8_weighted" in r else "-"
        lines.append(
            f"| {r['model']} | {r.get('input', '-')} | {r.get('bn_left', '-')} | {cov} | "
            f"{_fmt(r.get('cos_ref'), '.4f')} | {_fmt(r.get('cos_fp32'), '.4f')} | {_fmt(r.get('ms_eager'))} | "
            f"{_fmt(r.get('ms_gml_fp32'))} | {_fmt(r.get('ms_gml_int8'))} | {_fmt(ratio, '.2f')} | "
            f"{'yes' if r.get('coverage_agrees') else ('-' if 'coverage_agrees' not in r else '**no**')} | "
            f"{'; '.join(notes).replace('|', '/')} |"
        )
    done = [r for r in rows if "int8_weighted" in r]
    failed = [r for r in rows if r.get("error") or r.get("optimize_error") or r.get("quantize_error")]
    flagged = [r for r in done if r.get("cos_ref", 1.0) < 0.99]
    bn = [r for r in rows if r.get("bn_left")]
    bn_bad = [r for r in rows if r.get("bn_after_layer")]
    timed = [r for r in done if r.get("ms_gml_int8") and r.get("ms_gml_fp32")]
    # a model the guard returned as fp32 is gml.optimize's model built twice: its ratio is timing noise
    slower = [r for r in timed if r["ms_gml_int8"] > r["ms_gml_fp32"] and not _guard_returned_fp32(r)]
    same = [r for r in timed if r["ms_gml_int8"] > r["ms_gml_fp32"] and _guard_returned_fp32(r)]
    traced = [
        r
        for r in rows
        if "trac" in " ".join(str(r.get(k, "")) for k in ("error", "optimize_error", "quantize_error")).lower()
    ]
    costed = [r for r in done if r.get("cost_kept_fp32")]
    guard = [r for r in done if _guard_returned_fp32(r)]
    lines += [
        "",
        "## Summary",
        "",
        f"- {len(rows)} models, {len(done)} quantized, {len(failed)} with a failure (see notes).",
        f"- BN left after the fp32 pipeline in {len(bn)} model(s): "
        + (", ".join(f"{r['model']} ({r['bn_left']})" for r in bn) or "none")
        + ".",
        "- of these, BN that a conv/linear feeds (directly or through a reshape) left unfolded: "
        + (", ".join(f"{r['model']} ({r['bn_after_layer']})" for r in bn_bad) or "none")
        + " (the others follow an activation, an add or the input, and no conv/linear they could fold "
        "into exactly reads them; their reasons are in the notes).",
        "- cosine vs torch.ao reference < 0.99 (flagged with the layer): "
        + (", ".join(r["model"] for r in flagged) or "none")
        + ".",
        "- engine steps on oneDNN's reference kernel (`ref:`): "
        + (", ".join(f"{r['model']} ({len(r['ref_steps'])})" for r in rows if r.get("ref_steps")) or "none")
        + f" (recorded for {sum('ref_steps' in r for r in rows)} of {len(rows)} models).",
        "- report disagrees with the module: "
        + (", ".join(r["model"] for r in done if not r.get("coverage_agrees")) or "none")
        + ".",
        "- GML INT8 slower than GML fp32 (same run, interleaved): "
        + (", ".join(f"{r['model']} ({r['ms_gml_int8'] / r['ms_gml_fp32']:.2f}x)" for r in slower) or "none")
        + "."
        + (
            " Timed above 1.00 but the same fp32 model (the guard returned `gml.optimize`'s, built a second "
            "time; the ratio is timing noise between two builds): "
            + ", ".join(f"{r['model']} ({r['ms_gml_int8'] / r['ms_gml_fp32']:.2f}x)" for r in same)
            + "."
            if same
            else ""
        ),
        "- the whole-model guard inside `gml.quantize` (INT8 executable vs `gml.optimize`'s, interleaved) "
        "returned the fp32 model (INT8 not >= 10% faster) for: "
        + (", ".join(f"{r['model']} ({r['guard_int8_ms'] / r['guard_fp32_ms']:.2f}x)" for r in guard) or "none")
        + ".",
        f"- INT8 regions kept fp32 by the cost policy in {len(costed)} model(s): "
        + (", ".join(f"{r['model']} ({r['cost_kept_fp32']})" for r in costed) or "none")
        + ".",
        "- trace failures: " + (", ".join(r["model"] for r in traced) or "none") + ".",
        "",
        "## What stayed fp32 (first reasons per model)",
        "",
    ]
    for r in done:
        if r.get("kept_fp32"):
            lines.append(f"- **{r['model']}**: " + "; ".join(r["kept_fp32"][:4]).replace("|", "/"))
    lines += [
        "",
        f"## Cost policy (`cost_policy={meta.get('cost_policy', 'measure')}`): INT8 regions kept fp32, measured",
        "",
        "Per model: the INT8 regions `gml.quantize` timed slower than their fp32 ops (kept fp32, numbers "
        "from that run), and its last guard, the whole INT8 executable vs the all-fp32 float twin.",
        "",
    ]
    for r in done:
        cost = [ln.strip() for ln in r.get("cost", "").splitlines()[1:]]
        if cost:
            shown = [ln for ln in cost if not ln.startswith("whole")][:3] + [
                ln for ln in cost if ln.startswith("whole")
            ]
            more = r.get("cost_kept_fp32", 0) - len([ln for ln in shown if ln.startswith("region")])
            lines.append(
                f"- **{r['model']}**: "
                + "; ".join(shown + ([f"(+{more} more region(s))"] if more > 0 else [])).replace("|", "/")
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "coverage.md"))
    ap.add_argument("--results", default=os.path.join(HERE, "results", "zoo.jsonl"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--cost-policy", default="measure", choices=["measure", "off"], help="gml.quantize's cost_policy")
    ap.add_argument(
        "--max-side",
        type=int,
        default=None,
        help="cap the input's height/width (e.g. 160) for models that run at a smaller size; others keep theirs",
    )
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument(
        "--append", action="store_true", help="add rows to --results (a re-run of some models; their last row wins)"
    )
    ap.add_argument("--note", default="", help="a line to add under the header (e.g. the commit measured)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    import torch

    try:
        import timm

        timm_version = timm.__version__
    except ImportError:
        timm_version = "not installed"
    meta = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "jobs": args.jobs,
        "torch": torch.__version__,
        "timm": timm_version,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": args.rounds,
        "calib": args.calib,
        "cost_policy": args.cost_policy,
        "load": "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg()),
        "max_side": args.max_side,
    }
    if not args.render_only:
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        if not args.append:
            with open(args.results, "w") as f:
                f.write(json.dumps({"meta": meta}) + "\n")

        def work(spec: str) -> None:
            row = _run_in_process(spec, args)
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{spec}: {row.get('seconds', 0):.0f}s {row.get('error') or row.get('coverage', '')}", flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(work, args.models))
    with open(args.results) as f:
        records = [json.loads(line) for line in f if line.strip()]
    meta = next((r["meta"] for r in records if "meta" in r), meta) | ({"note": args.note} if args.note else {})
    # a model measured again (a re-run appended to the same file) keeps its last row
    rows = list({r["model"]: r for r in records if "model" in r}.values())
    order = {m: i for i, m in enumerate(args.models)}
    rows.sort(key=lambda r: order.get(r["model"], len(order)))
    with open(args.out, "w") as f:
        f.write(render(rows, meta))
    print(f"wrote {args.out} ({len(rows)} models)")


if __name__ == "__main__":
    main()
