"""Memory of an optimized model (issue #28): what `gml.optimize` / `gml.quantize` / `gml.load` keep
resident and the peak while they build, against the fp32 weight bytes, beside OpenVINO and ONNX
Runtime building the same model.

    python benchmarks/memory.py [--models resnet18,resnet50,bert] [--profile] [--no-peers] [--md FILE]

Every measurement runs in a fresh subprocess (``--child``): the model and its example input are
built and imports done; unless ``--no-warmup``, the same call then runs once on a small model of the
same family (so the shared libraries it maps, JIT code and one-time caches, which a second model in
the process does not pay again, are in the baseline; that warm-up's own cost is reported as
"warm-up model kept"); garbage is collected and freed heap handed back (``malloc_trim``), the RSS
read and the kernel's high-water mark reset; the call runs (and the result is called once);
garbage is collected and the RSS read again with the result alive. ``gml.load`` is measured
without a warm-up (a fresh process loading one file; its target allows 50 MB for that).

* ``kept``: RSS after minus RSS before (what the result costs while it lives);
* ``peak``: the high-water mark during the call minus the RSS before;
* ``tensors``: unique tensor storages reachable from the result (``gml.bench.memory.reachable_storages``;
  the native engine's plan-owned weights are not Python tensors and not in it).

``--profile`` also records each stage (capture, passes, torch.ao prepare / calibrate / convert, the
cost policy, the engine compile, the accuracy report, ...) with :class:`gml.bench.memory.StageTrace`
by wrapping gml's stage functions, and prints what the result holds field by field.

Acceptance (issue #28): kept <= 3x the fp32 weights for ``gml.optimize``, <= 2x for ``gml.quantize``
(ResNet18, ResNet50, BERT-base); a loaded INT8 model <= 3x its file size + 50 MB; the peak of
``gml.quantize`` <= 5x the fp32 weights + the calibration data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MODELS = {"resnet18": "resnet18", "resnet50": "resnet50", "bert": "hf:BertModel"}
_MB = 1024 * 1024


# ------------------------------------------------------------------------------------------ child
def _model(spec: str) -> tuple[Any, tuple]:
    from gml.models import example_inputs, load_with_defaults

    model, shapes, templates = load_with_defaults(spec)
    return model.eval(), example_inputs(shapes, like=templates)


def _tiny(spec: str) -> tuple[Any, tuple]:
    """A small model of the same family (the warm-up: one-time library costs into the baseline)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if spec.startswith("hf:"):
        import transformers

        config = transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
        ids = torch.randint(1, 128, (1, 16))
        return transformers.BertModel(config).eval(), (ids, torch.ones_like(ids))
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )  # fmt: skip
    return model.eval(), (torch.randn(1, 3, 32, 32),)


_STAGES = [
    # (module, attribute, stage name): gml functions a call goes through, wrapped under --profile
    ("gml.api", "capture", "capture (torch.fx / torch.export)"),
    ("gml.passes.manager.PassManager", "run", "passes (PassManager.run)"),
    ("gml.quant.frontend", "run_fp32_passes", "fp32 reference passes"),
    ("gml.quant.frontend", "prepare", "torch.ao prepare"),
    ("gml.quant.frontend", "calibrate", "calibrate"),
    ("gml.quant.frontend", "float_twin", "float twin"),
    ("gml.quant.frontend", "convert_reference", "torch.ao convert (reference graph)"),
    ("gml.quant.cost_policy", "run_policy", "cost policy"),
    ("gml.quant.cost_policy", "plan_regions", "plan regions (INT8 vs fp32 per region)"),
    ("gml.quant.cost_policy", "guard_whole_model", "whole-model guard (INT8 vs gml.optimize)"),
    ("gml.runtime.select", "attach_runtime", "attach runtime (compile, check, time)"),
    ("gml.runtime.select", "compile_engine", "engine compile (plan, reordered weights)"),
    ("gml.api", "_accuracy", "accuracy report"),
    ("gml.api", "optimize", "gml.optimize"),
    ("gml.quant.transformer", "quantize_transformer", "transformer scheme"),
    ("gml.io", "_load_module", "torch.export load"),
    ("gml.io", "attach_loaded_runtime", "attach runtime (load)"),
]


def _wrap_stages(trace: Any) -> None:
    import functools
    import importlib

    for mod_name, attr, label in _STAGES:
        owner_name, _, cls = mod_name.rpartition(".") if mod_name.endswith("PassManager") else (mod_name, "", "")
        try:
            owner: Any = importlib.import_module(owner_name)
        except ImportError:
            continue
        if cls:
            owner = getattr(owner, cls)
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def make(fn: Any = fn, label: str = label) -> Any:
            @functools.wraps(fn)
            def wrapped(*a: Any, **k: Any) -> Any:
                with trace.stage(label):
                    return fn(*a, **k)

            return wrapped

        setattr(owner, attr, make())


def _breakdown(res: Any, model: Any) -> list[dict[str, Any]]:
    """Tensor bytes each field of a result holds beyond the fields before it (unique storages)."""
    from gml.bench.memory import reachable_storages

    fields = [(k, v) for k, v in vars(res).items()] if hasattr(res, "__dict__") else [("result", res)]
    seen: set[int] = set()
    rows = []
    for name, value in fields:
        count = reachable_storages(value, stop=[model])
        new = {p: b for p, b in count.storages.items() if p not in seen}
        seen |= set(new)
        extra = sum(count.opaque.values())
        if new or extra or count.packed_objects:
            rows.append(
                {
                    "field": name,
                    "new_tensor_mb": round(sum(new.values()) / _MB, 1),
                    "opaque_mb": round(extra / _MB, 1),
                    "packed_objects": count.packed_objects,
                }
            )
    return rows


def _act(action: str, model: Any, x: tuple, file: str | None, peer: Any, n_calib: int) -> tuple[Any, Any]:
    """``(result, callable)`` of one action."""
    import gml

    if action == "optimize":
        res = gml.optimize(model, x)
        return res, res.executable
    if action in ("quantize", "save"):
        res = gml.quantize(model, n_calib, example_inputs=x)
        if action == "save":
            res.save(file)
        return res, res.executable
    if action == "load":
        res = gml.load(file)
        return res, res
    return peer(model, x)


def child(spec: str, action: str, file: str | None, profile: bool, threads: int, warmup: bool) -> dict[str, Any]:
    import gc

    import torch

    torch.set_num_threads(threads)
    import gml  # noqa: F401  (its import belongs to the baseline)
    from gml.bench.memory import (
        StageTrace,
        current_rss_mb,
        peak_rss_mb,
        reachable_storages,
        reset_peak_rss,
        tensor_bytes,
        trim_malloc,
    )

    model, x = _model(spec)
    out: dict[str, Any] = {"model": spec, "action": action, "weights_mb": tensor_bytes(model) / _MB}
    calib_batches = 8
    out["calib_mb"] = calib_batches * sum(t.numel() * t.element_size() for t in x) / _MB
    trace = StageTrace()
    if profile:
        _wrap_stages(trace)
    peer = None
    if action.startswith("peer:"):
        peer = _peer_context(action[5:], calib_batches, threads)
    if action == "load":
        out["file_mb"] = os.path.getsize(file) / _MB
    with torch.no_grad():
        model(*x)  # the eager model's first-call state (allocator, oneDNN) belongs to the baseline
    if warmup and action not in ("load", "save"):  # save: the setup of a load, not measured
        # the same call on a small model first: shared libraries mapped, JIT code, Python imports
        # and one-time caches are then in the baseline and "kept" is this model's own
        trim_malloc()
        start = current_rss_mb()
        with torch.no_grad():
            tiny, tx = _tiny(spec)
            _, trun = _act(action, tiny, tx, None, peer, 2)
            trun(*tx)
        trim_malloc()
        out["warmup_kept_mb"] = current_rss_mb() - start
        trace.records.clear()
    trim_malloc()
    before = current_rss_mb()
    reset_peak_rss()
    whole = trace.stage(f"{action} + one call") if profile else contextlib.nullcontext()
    with torch.no_grad(), whole as rec:
        res, run = _act(action, model, x, file, peer, calib_batches)
        run(*x)
    # a stage boundary resets the high-water mark (StageTrace folds it into the open stages): under
    # --profile the call's own stage holds the peak of the whole call
    peak = rec.peak_mb if profile else peak_rss_mb()
    gc.collect()
    after = current_rss_mb()
    out["kept_mb"] = after - before
    out["peak_mb"] = (peak - before) if peak is not None else None
    count = reachable_storages(res, stop=[model])
    out["tensors_mb"] = count.mb
    if profile:
        out["stages"] = trace.rows()
        out["fields"] = _breakdown(res, model)
    return out


def _peer_context(name: str, n_calib: int, threads: int) -> Any:
    """``build(model, x) -> (keepalive, callable)`` for a peer variant of gml bench (gml.bench.variants)."""
    import importlib

    from gml.bench.variants import VARIANTS, BuildContext, VariantSkipped
    from gml.quant.calibrate import generate_batches

    spec = VARIANTS[name]
    try:
        importlib.import_module(spec.group)  # the library's own import cost is not the model's
    except ImportError as e:
        raise VariantSkipped(f"{spec.group} not installed") from e
    if name == "ov-int8":
        import nncf  # noqa: F401
    workdir = Path(tempfile.mkdtemp(prefix="gml-mem-"))

    def build(model: Any, x: tuple) -> tuple[Any, Any]:
        calib = [tuple(b) for b in generate_batches(x, n_calib, seed=0)]
        ctx = BuildContext(model, x, calib, threads, workdir)
        built = spec.build(ctx)
        ctx.cache.clear()  # steps shared with other variants (an export) are not this one's
        return built, lambda *a: built.run(built.native(a))

    return build


def _child_main(args: argparse.Namespace) -> None:
    try:
        res = child(args.child, args.action, args.file, args.profile, args.threads, not args.no_warmup)
    except Exception as e:  # a skipped peer: one line the table shows
        res = {"model": args.child, "action": args.action, "skipped": f"{type(e).__name__}: {e}"}
    print("@@RESULT " + json.dumps(res))


# ----------------------------------------------------------------------------------------- parent
def _run_child(model: str, action: str, args: argparse.Namespace, file: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", model, "--action", action, "--threads", str(args.threads)]
    if file:
        cmd += ["--file", file]
    if args.profile and not action.startswith("peer:"):
        cmd.append("--profile")
    if args.no_warmup:
        cmd.append("--no-warmup")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[9:])
    return {"model": model, "action": action, "skipped": f"child failed: {proc.stderr.strip()[-400:]}"}


def _targets(r: dict[str, Any]) -> str:
    w, kept, peak = r["weights_mb"], r.get("kept_mb"), r.get("peak_mb")
    if r["action"] == "optimize":
        return f"kept {kept / w:.1f}x (<= 3x) {'ok' if kept <= 3 * w else 'MISSED'}"
    if r["action"] == "quantize":
        limit = 5 * w + r["calib_mb"]
        ok = kept <= 2 * w and (peak is None or peak <= limit)
        return f"kept {kept / w:.1f}x (<= 2x); peak {peak:.0f} MB (<= {limit:.0f}) {'ok' if ok else 'MISSED'}"
    if r["action"] == "load":
        limit = 3 * r["file_mb"] + 50
        return f"kept {kept:.0f} MB (<= 3x file + 50 = {limit:.0f} MB) {'ok' if kept <= limit else 'MISSED'}"
    return ""


def _md(results: list[dict[str, Any]], header: str) -> str:
    cols = ["model", "what", "fp32 weights MB", "kept MB", "peak MB", "tensors held MB", "warm-up model kept MB"]
    lines = [header, "", "| " + " | ".join([*cols, "target"]) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['action']} | | | | | | skipped: {r['skipped'][:80]} |")
            continue
        peak = f"{r['peak_mb']:.0f}" if r.get("peak_mb") is not None else "-"
        warm = f"{r['warmup_kept_mb']:.0f}" if r.get("warmup_kept_mb") is not None else "-"
        lines.append(
            f"| {r['model']} | {r['action']} | {r['weights_mb']:.1f} | {r['kept_mb']:.0f} | {peak} | "
            f"{r['tensors_mb']:.1f} | {warm} | {_targets(r)} |"
        )
    for r in results:
        if r.get("stages"):
            lines += ["", f"**{r['model']} {r['action']}** stages (MB; nested stages indented):", "",
                      "| stage | kept | peak above start | RSS after | s |", "|---|---|---|---|---|"]  # fmt: skip
            for s in r["stages"]:
                name = s["stage"].replace("  ", "&nbsp;&nbsp;")
                lines.append(
                    f"| {name} | {s['retained_mb']:.0f} | {s['peak_delta_mb']:.0f} | {s['rss_after_mb']:.0f} | "
                    f"{s['seconds']:.1f} |"
                )
        if r.get("fields"):
            title = f"what the result holds ({r['model']} {r['action']}): tensor MB per field, beyond earlier fields"
            lines += ["", title, "", "| field | tensors MB | opaque MB | packed objects |", "|---|---|---|---|"]
            for f in r["fields"]:
                lines.append(f"| {f['field']} | {f['new_tensor_mb']} | {f['opaque_mb']} | {f['packed_objects']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,resnet50,bert")
    ap.add_argument("--actions", default="optimize,quantize,load")
    ap.add_argument("--profile", action="store_true", help="per-stage RSS and what each result field holds")
    ap.add_argument("--no-peers", action="store_true", help="skip OpenVINO / ONNX Runtime")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-warmup", action="store_true", help="measure the first model of the process (no warm-up)")
    ap.add_argument("--md", help="write the markdown table here too")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--action", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child_main(args)
        return

    import torch

    from gml.bench.roofline import cpu_name

    header = (
        f"CPU: {cpu_name()}; {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} threads; "
        f"python {platform.python_version()}"
    )
    print(header)
    actions = args.actions.split(",")
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="gml-mem-"))
    peers = {"optimize": ["ov-fp32", "ort-fp32"], "quantize": ["ov-int8", "ort-int8", "ort-int8-dyn"]}
    for name in args.models.split(","):
        spec = MODELS.get(name, name)
        for action in actions:
            if action == "load":
                file = str(tmp / f"{name}_int8.pt2")
                setup = _run_child(spec, "save", args, file)
                if "skipped" in setup:
                    results.append({**setup, "action": "load"})
                    continue
                results.append(_run_child(spec, "load", args, file))
            else:
                results.append(_run_child(spec, action, args))
            print(_md(results[-1:], "").strip().splitlines()[-1] if "stages" not in results[-1] else results[-1])
            if not args.no_peers and action in peers:
                for p in peers[action]:
                    if name == "bert" and p == "ort-int8":
                        continue  # static QDQ INT8 of a transformer: ONNX Runtime's dynamic one is the peer
                    if name != "bert" and p == "ort-int8-dyn":
                        continue
                    results.append(_run_child(spec, f"peer:{p}", args))
                    print(_md(results[-1:], "").strip().splitlines()[-1])
    text = _md(results, header)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=1))


if __name__ == "__main__":
    main()
