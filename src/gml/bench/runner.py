"""Run every variant of one model side by side and measure them the same way.

Method, per batch size:

1. **Build** each variant in turn (own deep copy of the eager model, same calibration batches,
   threads pinned). Build time = construction + export/quantization/compilation + the first call
   (torch.compile compiles lazily on it). RSS is sampled around each build (see
   :mod:`gml.bench.memory`). A missing peer or stage is *skipped* with its reason; a build that
   raises is *failed*; neither stops the run.
2. **Check** each variant's outputs on held-out generated batches against eager fp32: max abs
   difference, cosine similarity and (for ``(batch, classes)`` outputs) top-1 agreement.
3. **Warm up** ``warmup`` calls, then time blocks of 1, 4, 16, ... calls until a block lasts a
   quarter of ``target_sample_ms``; that per-call time picks ``inner``, the number of calls per
   sample, so a sample lasts about ``target_sample_ms`` (1 for ResNet-size models; more for tiny
   ones, whose single calls are too short to time well and too easily hit by one preemption).
4. **Interleaved rounds**: in each of ``rounds`` rounds every variant gives one sample, in an order
   shuffled per round by a seeded RNG, so slow drift of a shared machine (other processes, clock
   and thermal changes) falls on all variants alike instead of on whichever ran last. A sample is
   one :meth:`torch.utils.benchmark.Timer.timeit` of ``inner`` calls, i.e. the mean time of a call
   in that block. ``timeit`` first runs ``max(inner // 100, 2)`` untimed calls, which here re-warms
   caches and thread pools after the previous variant ran; Timer also pins torch's thread count
   and disables the garbage collector while timing. Before each sample the harness sleeps
   ``settle_ms``: some runtimes' worker threads keep spinning after a call returns (measured here
   with ``getrusage``: ONNX Runtime's for 50–100 ms, OpenMP's for under 20 ms), and without the
   pause they would steal a core from whichever variant runs next.
5. **Summarise**: median, p10 and p90 over the samples, speedup = eager median / variant median.

Every sample is kept (``BenchResult.to_dict()``), with the round order that produced it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import platform
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console
from torch import nn

from gml.bench.memory import Footprint, RssMeter, RssProbe, activation_footprint
from gml.bench.roofline import Peak, cached_peak, count_flops, cpu_name, measure_peak
from gml.bench.stats import Stats, cosine, flat_output, max_abs_diff, speedup, summarize, top1_agreement
from gml.bench.variants import VARIANTS, BuildContext, Built, VariantSkipped, resolve_variants

PEER_PACKAGES = ("onnxruntime", "onnx", "onnxscript", "openvino", "nncf")


def _as_is(obj: Any, *names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for the fields ``to_dict`` writes unchanged (JSON-ready as they are)."""
    return {name: getattr(obj, name) for name in names}


_T = TypeVar("_T")


def _first(items: Sequence[_T], field_name: str, value: Any) -> _T:
    """The first of ``items`` whose ``field_name`` is ``value``; ``KeyError(value)`` if none is."""
    for item in items:
        if getattr(item, field_name) == value:
            return item
    raise KeyError(value)


@dataclass
class VariantResult:
    name: str
    label: str
    precision: str
    status: str  # "ok" | "skipped" | "failed"
    message: str = ""
    build_s: float | None = None
    inner: int = 1
    samples_ms: list[float] = field(default_factory=list)
    sample_rounds: list[int] = field(default_factory=list)
    stats: Stats | None = None
    speedup: float | None = None
    max_abs_diff: float | None = None
    cosine: float | None = None
    top1_agreement: float | None = None
    #: top-1 accuracy against the labels of real evaluation data (``eval_data`` with labels)
    top1_accuracy: float | None = None
    rss: RssProbe | None = None
    footprint: Footprint | None = None
    floor_ms: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            **_as_is(self, "name", "label", "precision", "status", "message", "build_s"),
            "calls_per_sample": self.inner,
            **_as_is(self, "samples_ms", "sample_rounds"),
            "stats_ms": self.stats.to_dict() if self.stats else None,
            "speedup_vs_eager": _finite(self.speedup),
            "max_abs_diff_vs_eager": _finite(self.max_abs_diff),
            "cosine_vs_eager": _finite(self.cosine),
            "top1_agreement_vs_eager": self.top1_agreement,
            "top1_accuracy_labelled": self.top1_accuracy,
            "rss": self.rss.to_dict() if self.rss else None,
            "activation_footprint": self.footprint.to_dict() if self.footprint else None,
            **_as_is(self, "floor_ms", "notes"),
        }


def _finite(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)  # JSON has no inf/nan


@dataclass
class BatchResult:
    batch_size: int
    input_shapes: list[tuple[int, ...]]
    flops: int | None
    variants: list[VariantResult]
    schedule: list[list[str]] = field(default_factory=list)

    @property
    def macs(self) -> int | None:
        return None if self.flops is None else self.flops // 2

    def variant(self, name: str) -> VariantResult:
        return _first(self.variants, "name", name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "input_shapes": [list(s) for s in self.input_shapes],
            **_as_is(self, "flops", "macs", "schedule"),
            "variants": [v.to_dict() for v in self.variants],
        }


@dataclass
class BenchResult:
    model: str
    created: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    peak: Peak | None
    batches: list[BatchResult]

    def batch(self, batch_size: int) -> BatchResult:
        return _first(self.batches, "batch_size", batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            **_as_is(self, "model", "created", "machine", "settings"),
            "peak": self.peak.to_dict() if self.peak else None,
            "batches": [b.to_dict() for b in self.batches],
        }


def interleaved_schedule(names: Sequence[str], rounds: int, seed: int) -> list[list[str]]:
    """``rounds`` permutations of ``names``, shuffled by ``random.Random(seed)``: every variant
    runs exactly once per round, in a fresh order each round."""
    rng = random.Random(seed)
    schedule = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        schedule.append(order)
    return schedule


def pick_inner(per_call_ms: float, target_sample_ms: float, cap: int = 10_000) -> int:
    """Calls per sample so a sample lasts about ``target_sample_ms`` (at least one call)."""
    if per_call_ms <= 0:
        return cap
    return max(1, min(cap, math.ceil(target_sample_ms / per_call_ms)))


def per_call_estimate(run: Any, arg: Any, min_block_ms: float, cap: int = 10_000) -> float:
    """Milliseconds per call, from the first block of 1, 4, 16, ... calls lasting ``min_block_ms``."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            run(arg)
        ms = (time.perf_counter() - t0) * 1e3
        if ms >= min_block_ms or n >= cap:
            return ms / n
        n *= 4


def _timer_class() -> Any:
    # importing torch.utils.benchmark loads cpp_extension, which logs a CUDA warning on CPU machines
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils.benchmark import Timer

    return Timer


def time_interleaved(
    calls: dict[str, Any],
    *,
    rounds: int,
    seed: int = 0,
    target_sample_ms: float = 20.0,
    threads: int | None = None,
    settle_ms: float = 20.0,
) -> dict[str, list[float]]:
    """Per-call latency samples (ms) of zero-argument callables, timed in interleaved rounds.

    The same method as :func:`run_bench` (shuffled order per round, ``Timer.timeit`` blocks sized
    by :func:`per_call_estimate`) for code that already holds its callables, such as the demo.
    """
    Timer = _timer_class()
    threads = threads or torch.get_num_threads()
    inner = {
        n: pick_inner(per_call_estimate(lambda f: f(), fn, target_sample_ms / 4), target_sample_ms)
        for n, fn in calls.items()
    }
    samples: dict[str, list[float]] = {n: [] for n in calls}
    for order in interleaved_schedule(list(calls), rounds, seed):
        for n in order:
            time.sleep(settle_ms / 1e3)
            timer = Timer(stmt="fn()", globals={"fn": calls[n]}, num_threads=threads)
            samples[n].append(timer.timeit(inner[n]).mean * 1e3)
    return samples


def machine_info(threads: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"torch": torch.__version__}
    for pkg in ("torchvision", *PEER_PACKAGES):
        with contextlib.suppress(PackageNotFoundError):
            versions[pkg] = version(pkg)
    from gml.runtime.target import detect_target

    return {
        "cpu": cpu_name(),
        "target": detect_target(threads).describe(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _load(
    model: str | nn.Module, **options: Any
) -> tuple[nn.Module, str, list[tuple[int, ...]], tuple[torch.Tensor, ...] | None]:
    """The eager model, its display name, default input shapes and input templates (``options``:
    :func:`gml.models.load_with_defaults`'s: ``weights``, ``unsafe_load``, ``submodule``, ...)."""
    from gml.models import load_with_defaults

    name = model if isinstance(model, str) else type(model).__name__
    if options.get("submodule"):
        name = f"{name}.{options['submodule']}"
    m, shapes, like = load_with_defaults(model, **options)
    return m, name, [tuple(s) for s in shapes], like


def _inputs(
    shapes: Sequence[Sequence[int]], batch: int, seed: int, like: Sequence[torch.Tensor] | None = None
) -> tuple[torch.Tensor, ...]:
    from gml.models import example_inputs

    return example_inputs(shapes, batch=batch, seed=seed, like=like)


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _resolve_peak(peak: Peak | str | None, threads: int) -> Peak | None:
    if peak is None or isinstance(peak, Peak):
        return peak
    if peak == "cache":
        return cached_peak(threads)
    if peak == "measure":
        return measure_peak(threads)
    raise ValueError(f"peak must be a Peak, 'cache', 'measure' or None, not {peak!r}")


class _Runner:
    def __init__(
        self, console: Console, progress: bool, timer_cls: Any, target_sample_ms: float, settle_ms: float = 0.0
    ) -> None:
        self.target_sample_ms = target_sample_ms
        self.settle_ms = settle_ms
        self.console = console
        self.progress = progress
        self.timer_cls = timer_cls

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def build(
        self, name: str, ctx: BuildContext, check: list[tuple[torch.Tensor, ...]], warmup: int
    ) -> tuple[VariantResult, Built | None, Any, list[Any], float]:
        spec = VARIANTS[name]
        res = VariantResult(spec.name, spec.label, spec.precision, "ok")
        built: Built | None = None
        native: Any = None
        outputs: list[Any] = []
        per_call_ms = 0.0
        meter = RssMeter()
        try:
            with meter:
                t0 = time.perf_counter()
                built = spec.build(ctx)
                native = built.native(ctx.example)
                built.run(native)
                res.build_s = time.perf_counter() - t0 + built.shared_build_s
                for _ in range(warmup):
                    built.run(native)
                per_call_ms = per_call_estimate(built.run, native, self.target_sample_ms / 4)
                outputs = [built.output(built.run(built.native(b))) for b in check]
        except VariantSkipped as exc:
            res.status, res.message = "skipped", str(exc)
            built = None
        except Exception as exc:
            res.status, res.message = "failed", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            built = None
        res.rss = meter.probe if built is not None else None
        if built is not None:
            res.notes = list(built.notes)
        return res, built, native, outputs, per_call_ms

    def sample(self, built: Built, native: Any, inner: int, threads: int) -> float:
        timer = self.timer_cls(stmt="run(x)", globals={"run": built.run, "x": native}, num_threads=threads)
        return timer.timeit(inner).mean * 1e3


def run_bench(
    model: str | nn.Module,
    *,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    batch_sizes: Sequence[int] = (1,),
    variants: str | Sequence[str] | None = None,
    rounds: int = 20,
    warmup: int = 3,
    threads: int | None = None,
    calib_batches: int = 8,
    check_batches: int = 2,
    seed: int = 0,
    target_sample_ms: float = 20.0,
    settle_ms: float = 100.0,
    peak: Peak | str | None = "cache",
    footprint: bool = True,
    weights: str | None = None,
    unsafe_load: bool = False,
    submodule: str | None = None,
    console: Console | None = None,
    progress: bool = True,
    leaf_modules: Sequence[str | type] = (),
    precision: str = "fp32",
    calib_data: Any = None,
    calib_samples: int | None = 128,
    eval_data: Any = None,
    data_options: Any = None,
    trust_remote_code: bool = False,
) -> BenchResult:
    """Benchmark ``model`` (a spec ``gml.models.load_model`` accepts, or an ``nn.Module``).

    Args:
        input_shape: one shape or a list of shapes (one per forward argument); dim 0 is replaced by
            each batch size. Default: what the model declares, else ``1x3x224x224``.
        batch_sizes: each is a separate experiment: every variant is rebuilt for it (static shapes).
        variants: names from :data:`gml.bench.variants.VARIANTS`, comma-separated or a list;
            ``"all"``; ``None`` for the defaults. ``eager`` is always added: it is the reference.
        rounds, warmup, target_sample_ms, settle_ms: see the module docstring.
        threads: threads for every runtime (default: all cores this process may use).
        calib_batches: generated batches every INT8 variant calibrates on (the same ones).
        check_batches: held-out generated batches for the accuracy check.
        peak: compute peak for the roofline floor: ``"cache"`` (measure once, then reuse),
            ``"measure"``, a :class:`Peak`, or ``None`` for no floor.
        footprint: compute the activation footprint of variants that are FX graphs.
        weights, unsafe_load: a state_dict checkpoint to load into the model (see ``gml.models``).
        trust_remote_code: let a local Hugging Face folder run its own Python code (``auto_map``).
        submodule: benchmark only this part of the model (a dotted path, e.g. ``backbone``).
        leaf_modules: submodules GML's variants keep opaque while tracing, as in :func:`gml.capture`.
        precision: ``fp32`` or ``bf16``: the default variant list (``bf16``: GML bf16 against
            OpenVINO bf16, with both fp32 rows; :data:`gml.bench.variants.BF16_VARIANTS`).
        calib_data: real calibration data for every INT8 variant instead of generated batches: a
            path :func:`gml.data.open_data` reads (``data_options``: preprocessing) or a
            :class:`gml.data.DataSource`; a seeded subset of ``calib_samples``, in full batches of
            each batch size.
        eval_data: real held-out data for the output-error columns instead of generated batches
            (full batches of each batch size); with labels, each variant's top-1 accuracy too
            (``VariantResult.top1_accuracy``).
    """
    console = console or Console(stderr=True)
    names = resolve_variants(
        variants if variants is None or isinstance(variants, str) else list(variants), precision=precision
    )
    threads = threads or _default_threads()
    eager_model, model_name, declared, like = _load(
        model, weights=weights, unsafe_load=unsafe_load, submodule=submodule, trust_remote_code=trust_remote_code
    )
    if input_shape is None:
        shapes = declared or [(1, 3, 224, 224)]
    elif input_shape and isinstance(input_shape[0], int):
        shapes = [tuple(input_shape)]  # type: ignore[arg-type]
    else:
        shapes = [tuple(s) for s in input_shape]  # type: ignore[union-attr]
    data = _open_bench_data(model, eager_model, shapes, like, calib_data, eval_data, data_options)
    runner = _Runner(console, progress, _timer_class(), target_sample_ms, settle_ms)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak_obj = _resolve_peak(peak, threads)
        batches = []
        with torch.no_grad():
            for bs in batch_sizes:
                batches.append(
                    _run_batch(
                        runner,
                        eager_model,
                        names,
                        shapes,
                        bs,
                        rounds,
                        warmup,
                        threads,
                        calib_batches,
                        check_batches,
                        seed,
                        target_sample_ms,
                        peak_obj,
                        footprint,
                        like,
                        leaf_modules=leaf_modules,
                        data=data,
                        calib_samples=calib_samples,
                    )
                )
    finally:
        torch.set_num_threads(old_threads)
    settings = {
        "variants": names,
        "rounds": rounds,
        "warmup": warmup,
        "threads": threads,
        "batch_sizes": list(batch_sizes),
        "calib_batches": calib_batches,
        "check_batches": check_batches,
        "calib_data": data[0].describe() if data[0] is not None else "generated",
        "eval_data": data[1].describe() if data[1] is not None else "generated",
        "seed": seed,
        "target_sample_ms": target_sample_ms,
        "settle_ms": settle_ms,
        "timer": "torch.utils.benchmark.Timer.timeit",
    }
    return BenchResult(
        model_name, time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine_info(threads), settings, peak_obj, batches
    )


def _run_batch(
    runner: _Runner,
    eager_model: nn.Module,
    names: list[str],
    shapes: list[tuple[int, ...]],
    bs: int,
    rounds: int,
    warmup: int,
    threads: int,
    calib_batches: int,
    check_batches: int,
    seed: int,
    target_sample_ms: float,
    peak: Peak | None,
    want_footprint: bool,
    like: Sequence[torch.Tensor] | None = None,
    leaf_modules: Sequence[str | type] = (),
    data: tuple[Any, Any] = (None, None),
    calib_samples: int | None = 128,
) -> BatchResult:
    example = _inputs(shapes, bs, seed, like)
    calib = [_inputs(shapes, bs, seed + 1 + i, like) for i in range(calib_batches)]
    check = [_inputs(shapes, bs, seed + 10_000 + i, like) for i in range(check_batches)]
    labels: list[torch.Tensor] | None = None
    if data[0] is not None:
        calib = _full(data[0].calibration(calib_samples, batch_size=bs, seed=seed), bs, data[0].path)
    if data[1] is not None:
        batches = [b for b in data[1].batches(bs) if len(b.ids) == bs]
        _full([b.inputs for b in batches], bs, data[1].path)
        check = [b.inputs for b in batches]
        labels = [b.labels for b in batches] if data[1].labelled else None
    in_shapes = [tuple(t.shape) for t in example]
    runner.say(f"[bold]batch size {bs}[/]: inputs {', '.join(str(s) for s in in_shapes)}, {threads} threads")
    try:
        flops: int | None = count_flops(eager_model, example)
    except Exception:
        flops = None

    results: list[VariantResult] = []
    live: dict[str, tuple[Built, Any]] = {}
    ref_outputs: list[Any] = []
    per_call: dict[str, float] = {}
    from gml.runtime.target import detect_target

    with tempfile.TemporaryDirectory(prefix="gml-bench-") as workdir:
        ctx = BuildContext(
            eager_model, example, calib, threads, Path(workdir), leaf_modules=tuple(leaf_modules),
            target=detect_target(threads),
        )  # fmt: skip
        for name in names:
            res, built, native, outputs, per_call_ms = runner.build(name, ctx, check, warmup)
            results.append(res)
            if built is None:
                style = "yellow" if res.status == "skipped" else "red"
                runner.say(f"  [{style}]{res.status}[/] {name}: {res.message}")
                continue
            runner.say(f"  built {name} in {res.build_s:.1f} s")
            live[name] = (built, native)
            per_call[name] = per_call_ms
            if name == "eager":
                ref_outputs = outputs
            _accuracy(res, ref_outputs, outputs)
            if labels is not None and len(labels) == len(outputs):
                res.top1_accuracy = _labelled_top1(outputs, labels)
            if want_footprint:
                _footprint(res, built, eager_model if name == "eager" else None, example)
            if peak is not None and flops is not None:
                res.floor_ms = peak.floor_ms(flops, res.precision)  # bf16: None without a native bf16 peak
        ctx.cache.clear()

        ok = [r.name for r in results if r.ok]
        inner = {n: pick_inner(per_call[n], target_sample_ms) for n in ok}
        schedule = interleaved_schedule(ok, rounds, seed)
        by_name = {r.name: r for r in results}
        _timed_rounds(runner, schedule, live, inner, threads, by_name, bs)
        live.clear()
        gc.collect()

    for r in results:
        r.inner = inner.get(r.name, 1)
        if r.samples_ms:
            r.stats = summarize(r.samples_ms)
    base = by_name["eager"].stats if "eager" in by_name else None
    for r in results:
        if r.stats is not None and base is not None:
            r.speedup = speedup(base.median, r.stats.median)
    _reset_dynamo()
    return BatchResult(bs, in_shapes, flops, results, schedule)


def _timed_rounds(
    runner: _Runner,
    schedule: list[list[str]],
    live: dict[str, tuple[Built, Any]],
    inner: dict[str, int],
    threads: int,
    by_name: dict[str, VariantResult],
    bs: int,
) -> None:
    total = sum(len(r) for r in schedule)
    if not total:
        return

    def one(round_i: int, name: str) -> None:
        built, native = live[name]
        try:
            if runner.settle_ms > 0:
                time.sleep(runner.settle_ms / 1e3)
            by_name[name].samples_ms.append(runner.sample(built, native, inner[name], threads))
            by_name[name].sample_rounds.append(round_i)
        except Exception as exc:  # a variant that dies mid-run is reported, the others go on
            res = by_name[name]
            res.status, res.message = "failed", f"while timing: {type(exc).__name__}: {exc}"

    if runner.progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn(f"  timing bs{bs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeRemainingColumn(),
            console=runner.console,
            transient=True,
        ) as bar:
            task = bar.add_task("", total=total)
            for i, order in enumerate(schedule):
                for name in order:
                    bar.update(task, description=f"round {i + 1}/{len(schedule)} {name}")
                    if by_name[name].ok:
                        one(i, name)
                    bar.advance(task)
    else:
        for i, order in enumerate(schedule):
            for name in order:
                if by_name[name].ok:
                    one(i, name)


def _accuracy(res: VariantResult, ref_outputs: list[Any], outputs: list[Any]) -> None:
    if not ref_outputs or len(ref_outputs) != len(outputs):
        return
    refs = [flat_output(o) for o in ref_outputs]
    news = [flat_output(o) for o in outputs]
    res.max_abs_diff = max(max_abs_diff(r, n) for r, n in zip(refs, news))
    res.cosine = (
        cosine(torch.cat(refs), torch.cat(news)) if all(r.shape == n.shape for r, n in zip(refs, news)) else math.nan
    )
    agree = [top1_agreement(r, n) for r, n in zip(ref_outputs, outputs)]
    if agree and all(a is not None for a in agree):
        res.top1_agreement = sum(agree) / len(agree)  # type: ignore[arg-type]


def _labelled_top1(outputs: list[Any], labels: list[torch.Tensor]) -> float | None:
    correct = total = 0
    for out, y in zip(outputs, labels):
        logits = flat_output(out).reshape(len(y), -1) if flat_output(out).numel() % len(y) == 0 else None
        if logits is None or logits.shape[1] < 2:
            return None
        correct += int((logits.argmax(1) == y).sum())
        total += len(y)
    return correct / total if total else None


def _full(batches: list[Any], bs: int, path: str) -> list[Any]:
    """The batches of exactly ``bs`` samples (the variants are built for static shapes)."""
    from gml.errors import InputError

    full = [b for b in batches if len(b[0]) == bs]
    if not full:
        raise InputError(
            f"{path} gives fewer samples than one batch of {bs}.",
            hint="use a smaller --batch-sizes, more data, or a larger --calib-samples.",
        )
    return full


def _open_bench_data(
    spec: Any, model: nn.Module, shapes: Any, like: Any, calib: Any, evaluation: Any, options: Any
) -> tuple[Any, Any]:
    """``(calib source, eval source)``: paths opened with :func:`gml.data.open_data`."""
    from gml.data.loader import open_data

    example = _inputs(shapes, 1, 0, like)
    name = spec if isinstance(spec, str) else None

    def one(value: Any) -> Any:
        if value is None or not isinstance(value, str):
            return value
        return open_data(value, example, model=model, spec=name, options=options)

    return one(calib), one(evaluation)


def _footprint(res: VariantResult, built: Built, eager: nn.Module | None, example: tuple[torch.Tensor, ...]) -> None:
    gm = built.graph_module
    try:
        if gm is None and eager is not None:
            gm = torch.fx.symbolic_trace(copy.deepcopy(eager))
        if gm is not None:
            res.footprint = activation_footprint(gm, example)
    except Exception as exc:  # metadata only: never fail the benchmark on it
        res.notes.append(f"activation footprint unavailable: {type(exc).__name__}")


def _reset_dynamo() -> None:
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass
