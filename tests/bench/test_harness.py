"""Harness logic of ``gml bench`` on tiny models: scheduling, statistics, reports, skips.

No assertion here depends on how fast anything ran: latencies are either replaced by a fixed
script of samples (to check the statistics exactly) or only counted.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from gml.bench import render_markdown, render_png, render_table, run_bench, write_json
from gml.bench.memory import activation_footprint
from gml.bench.roofline import Peak
from gml.bench.runner import _Runner, interleaved_schedule, pick_inner
from gml.bench.stats import cosine, max_abs_diff, speedup, summarize
from gml.bench.variants import VARIANTS, Built, VariantSkipped, VariantSpec, require, resolve_variants
from gml.errors import InputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAKE_PEAK = Peak(fp32_flops=1e11, int8_ops=4e11, threads=1, cpu="test", torch_version=torch.__version__)


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # fixed weights: INT8 agreement checks must not depend on the draw
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(x, 1))


def _quiet_console() -> Console:
    return Console(file=io.StringIO(), width=200)


# --- pure logic ------------------------------------------------------------------------------


def test_schedule_runs_every_variant_once_per_round_in_shuffled_orders():
    names = ["eager", "a", "b", "c", "d"]
    schedule = interleaved_schedule(names, rounds=12, seed=3)
    assert len(schedule) == 12
    for order in schedule:
        assert sorted(order) == sorted(names)
    assert len({tuple(o) for o in schedule}) > 1, "orders must change between rounds"
    assert len({o[0] for o in schedule}) > 1, "the same variant must not always go first"
    assert schedule == interleaved_schedule(names, rounds=12, seed=3), "seeded: reproducible"
    assert schedule != interleaved_schedule(names, rounds=12, seed=4)


def test_summarize_known_samples():
    s = summarize([7.0, 1.0, 3.0, 10.0, 2.0, 9.0, 4.0, 8.0, 6.0, 5.0])
    assert (s.n, s.median, s.min, s.max) == (10, 5.5, 1.0, 10.0)
    # linear interpolation between order statistics: rank 0.1*(n-1) = 0.9 and 0.9*(n-1) = 8.1
    assert s.p10 == pytest.approx(1.9)
    assert s.p90 == pytest.approx(9.1)
    one = summarize([4.0])
    assert (one.median, one.p10, one.p90) == (4.0, 4.0, 4.0)
    with pytest.raises(ValueError):
        summarize([])


def test_speedup_cosine_and_diff():
    assert speedup(12.0, 6.0) == 2.0
    assert speedup(6.0, 12.0) == 0.5
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert cosine(a, 2 * a) == pytest.approx(1.0)
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(0.0)
    assert cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert math.isnan(cosine(a, torch.ones(2)))
    assert max_abs_diff(a, torch.tensor([1.0, 2.5, 2.0], dtype=torch.float64)) == 1.0
    assert max_abs_diff(a, torch.ones(2)) == math.inf


def test_pick_inner():
    assert pick_inner(15.0, 20.0) == 2
    assert pick_inner(30.0, 20.0) == 1
    assert pick_inner(0.01, 20.0) == 2000
    assert pick_inner(0.0, 20.0) == 10_000


def test_resolve_variants():
    assert resolve_variants("compile,ao-int8") == ["eager", "compile", "ao-int8"]
    assert resolve_variants(["ao-int8", "eager", "ao-int8"]) == ["eager", "ao-int8"]
    assert resolve_variants("all") == list(VARIANTS)
    with pytest.raises(InputError, match="Unknown benchmark variant"):
        resolve_variants("eager,tensorrt")


def test_activation_footprint_counts_intermediates_and_keeps_viewed_storage_alive():
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.fc = nn.Linear(8 * 16 * 16, 4096)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.flatten(torch.relu(self.conv(x)), 1))

    gm = torch.fx.symbolic_trace(Chain().eval())
    fp = activation_footprint(gm, (torch.randn(1, 3, 16, 16),))
    act = 8 * 16 * 16 * 4  # conv and relu outputs, fp32
    out = 4096 * 4
    assert fp.tensors == 3  # flatten is a view: no new tensor
    assert fp.total_bytes == act + act + out
    # relu's storage is read by fc through the flatten view, so it is alive with fc's output
    assert fp.peak_live_bytes == act + out


def test_missing_peer_is_skipped_with_install_hint(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(VariantSkipped, match=r"^onnxruntime not installed: pip install 'gml-lab\[bench\]'$"):
        require("onnxruntime")


# --- run_bench with scripted timings --------------------------------------------------------


def _fake_spec(name: str, factor: float, samples: list[float]) -> VariantSpec:
    def build(ctx):
        def run(args):
            return args[0] * factor

        run.samples = list(samples)  # type: ignore[attr-defined]
        return Built(run=run)

    return VariantSpec(name, f"{name} label", "fp32", build)


@pytest.fixture
def scripted(monkeypatch):
    """eager and two fake variants whose timer samples are fixed in advance."""
    monkeypatch.setitem(VARIANTS, "eager", _fake_spec("eager", 1.0, [10.0, 12.0, 11.0, 13.0, 14.0]))
    monkeypatch.setitem(VARIANTS, "fast", _fake_spec("fast", 2.0, [5.0, 6.0, 7.0, 5.0, 6.0]))
    monkeypatch.setitem(VARIANTS, "neg", _fake_spec("neg", -1.0, [24.0, 24.0, 24.0, 24.0, 24.0]))

    def boom(ctx):
        raise RuntimeError("compiler exploded\nsecond line")

    def missing(ctx):
        require("surely_not_installed_pkg", "surelynot")

    monkeypatch.setitem(VARIANTS, "boom", VariantSpec("boom", "boom", "fp32", boom))
    monkeypatch.setitem(VARIANTS, "missing", VariantSpec("missing", "missing", "fp32", missing))
    monkeypatch.setattr(_Runner, "sample", lambda self, built, native, inner, threads: built.run.samples.pop(0))


def test_scripted_run_statistics_speedup_accuracy_and_failures(scripted):
    res = run_bench(
        TinyNet().eval(),
        input_shape=(1, 3, 8, 8),
        variants="fast,neg,boom,missing",
        rounds=5,
        warmup=1,
        threads=1,
        peak=FAKE_PEAK,
        target_sample_ms=0.5,
        settle_ms=0,
        console=_quiet_console(),
        progress=False,
    )
    b = res.batch(1)
    eager, fast, neg = b.variant("eager"), b.variant("fast"), b.variant("neg")
    assert eager.stats.median == 12.0 and fast.stats.median == 6.0
    assert fast.stats.p10 == pytest.approx(5.0) and fast.stats.p90 == pytest.approx(6.6)
    assert fast.speedup == 2.0 and neg.speedup == 0.5 and eager.speedup == 1.0
    # outputs: fast returns 2x, neg returns -x of the same input
    assert fast.cosine == pytest.approx(1.0) and neg.cosine == pytest.approx(-1.0)
    x_max = max(float(t[0].abs().max()) for t in [_check_inputs(res)])
    assert fast.max_abs_diff == pytest.approx(x_max, rel=1e-6)
    assert neg.max_abs_diff == pytest.approx(2 * x_max, rel=1e-6)
    boom, missing = b.variant("boom"), b.variant("missing")
    assert (boom.status, boom.message) == ("failed", "RuntimeError: compiler exploded")
    assert (missing.status, missing.message) == ("skipped", "surelynot not installed: pip install 'gml-lab[bench]'")
    assert boom.samples_ms == [] and missing.stats is None
    # every round ran exactly the three working variants, and each sample knows its round
    assert all(sorted(o) == ["eager", "fast", "neg"] for o in b.schedule) and len(b.schedule) == 5
    assert fast.sample_rounds == [0, 1, 2, 3, 4]
    # roofline floor from the given peak: fp32 FLOPs / 1e11 FLOP/s
    assert fast.floor_ms == pytest.approx(b.flops / 1e11 * 1e3)


def _check_inputs(res):
    """The first held-out accuracy batch the runner generated (same seeds as the runner)."""
    from gml.bench.runner import _inputs

    return _inputs([(1, 3, 8, 8)], 1, res.settings["seed"] + 10_000)


# --- run_bench for real, on a tiny model ----------------------------------------------------


@pytest.fixture(scope="module")
def real_result():
    return run_bench(
        TinyNet().eval(),
        input_shape=(1, 3, 8, 8),
        batch_sizes=[1, 2],
        variants="eager,ao-int8,gml-fp32",
        rounds=3,
        warmup=1,
        threads=1,
        calib_batches=2,
        peak=FAKE_PEAK,
        target_sample_ms=1.0,
        console=_quiet_console(),
        progress=False,
    )


def test_real_run_measures_every_variant_every_round(real_result):
    assert [b.batch_size for b in real_result.batches] == [1, 2]
    for b in real_result.batches:
        ok = [v for v in b.variants if v.ok]
        assert {"eager", "ao-int8"} <= {v.name for v in ok}
        for v in ok:
            assert len(v.samples_ms) == 3 and all(s > 0 for s in v.samples_ms)
            assert v.build_s is not None and v.build_s >= 0
            assert v.rss is not None and v.rss.rss_before_mb > 0
        ao = b.variant("ao-int8")
        assert 0.9 < ao.cosine <= 1.0 + 1e-9 and ao.max_abs_diff > 0
        assert b.variant("eager").max_abs_diff == 0.0
        # FX variants report their activation footprint: 8 channels x 8 x 8 fp32 per conv-like tensor
        assert b.variant("eager").footprint.total_bytes > 0
        assert ao.footprint is not None
        assert b.macs == (8 * 3 * 9 * 64 + 512 * 10) * b.batch_size


def test_gml_variant_reports_not_available_instead_of_crashing(real_result, monkeypatch):
    v = real_result.batch(1).variant("gml-fp32")
    assert v.status in ("ok", "skipped")
    if v.status == "skipped":
        assert v.message.startswith("not available: ")


def test_gml_api_missing_function_is_not_available(monkeypatch):
    import types

    from gml.bench import variants

    monkeypatch.setattr(variants, "_gml_api", lambda: types.SimpleNamespace())
    with pytest.raises(VariantSkipped, match=r"^not available: gml.quantize is not implemented yet$"):
        variants.build_gml_int8(None)  # type: ignore[arg-type]  # fails before touching ctx


def test_png_chart(real_result, tmp_path: Path):
    pytest.importorskip("matplotlib")  # part of the [bench] extra
    png = tmp_path / "r.png"
    render_png(real_result, png)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_png_without_matplotlib_says_what_to_install(real_result, tmp_path: Path, monkeypatch):
    import sys

    from gml.errors import GMLError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(GMLError, match="needs matplotlib") as info:
        render_png(real_result, tmp_path / "r.png")
    assert info.value.hint == "pip install 'gml-lab[bench]'"


def test_reports_json_md_table(real_result, tmp_path: Path):
    jpath = tmp_path / "r.json"
    write_json(real_result, jpath)
    data = json.loads(jpath.read_text())
    for b_json, b in zip(data["batches"], real_result.batches):
        for v_json in b_json["variants"]:
            v = b.variant(v_json["name"])
            assert v_json["samples_ms"] == v.samples_ms  # every sample, not just the summary
            assert len(v_json["sample_rounds"]) == len(v.samples_ms)
        assert len(b_json["schedule"]) == 3
    assert data["peak"]["fp32_flops"] == 1e11
    assert data["machine"]["versions"]["torch"] == torch.__version__

    md = render_markdown(real_result)
    assert "#### batch size 1" in md and "#### batch size 2" in md
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    separator = md.splitlines()[md.splitlines().index(header) + 1]
    # a literal "|" inside a cell (max |Δ|) must be escaped or the table gains columns
    assert header.replace("\\|", "").count("|") == separator.count("|")
    assert "| eager fp32 |" in md and "| torch.ao FX INT8 (x86) |" in md
    assert "Roofline:" in md

    console = Console(record=True, width=160)
    console.print(render_table(real_result))
    text = console.export_text()
    assert "ao-int8" in text and "latency per call" in text


def test_cli_writes_all_outputs(tmp_path: Path, monkeypatch, scripted):
    import argparse

    from gml.bench.cli import add_bench_arguments, bench_command

    model_file = tmp_path / "m.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 3)\n"
        "    def forward(self, x):\n        return torch.relu(self.fc(x))\n"
    )
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    out = tmp_path / "o"
    png = importlib.util.find_spec("matplotlib") is not None
    args = p.parse_args(
        [f"{model_file}:M", "--input-shape", "1x4", "--variants", "fast", "--rounds", "5", "--no-floor",
         "--threads", "1", "--no-progress", "--json", f"{out}.json", "--md", f"{out}.md"]
        + (["--png", f"{out}.png"] if png else [])
    )  # fmt: skip
    assert bench_command(args, console=_quiet_console()) == 0
    assert json.loads(Path(f"{out}.json").read_text())["batches"][0]["variants"][1]["stats_ms"]["median"] == 6.0
    assert "fast label" in Path(f"{out}.md").read_text()
    if png:
        assert Path(f"{out}.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--batch-sizes", "0"])


@pytest.mark.slow
def test_peer_runtimes_build_and_agree_with_eager():
    """The ONNX Runtime and OpenVINO builders work against the installed [bench] extra."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    res = run_bench(
        TinyNet().eval(),
        input_shape=(1, 3, 8, 8),
        variants="ort-fp32,ort-int8,ort-int8-dyn,ov-fp32,ov-int8",
        rounds=2,
        warmup=1,
        threads=1,
        calib_batches=2,
        peak=None,
        target_sample_ms=1.0,
        console=_quiet_console(),
        progress=False,
    )
    b = res.batch(1)
    for name in ("ort-fp32", "ov-fp32"):
        v = b.variant(name)
        assert v.ok, v.message
        assert v.max_abs_diff < 1e-4 and v.cosine == pytest.approx(1.0, abs=1e-6)
    for name in ("ort-int8", "ort-int8-dyn", "ov-int8"):
        v = b.variant(name)
        assert v.ok, v.message
        assert v.cosine > 0.9 and v.max_abs_diff > 0  # quantized, yet close (tiny random net: 0.96+)
        assert len(v.samples_ms) == 2


def test_cached_peak_keeps_the_best_measurement(monkeypatch, tmp_path: Path):
    from gml.bench import roofline

    measured = iter([(100.0, 400.0), (50.0, 500.0), (60.0, 300.0)])

    def fake_measure(threads: int) -> Peak:
        fp32, int8 = next(measured)
        return Peak(fp32, int8, threads, "cpu", torch.__version__)

    monkeypatch.setattr(roofline, "measure_peak", fake_measure)
    cache = tmp_path / "peak.json"
    first = roofline.cached_peak(2, cache=cache)
    assert (first.fp32_flops, first.int8_ops, first.source) == (100.0, 400.0, "measured")
    busy = roofline.cached_peak(2, cache=cache)  # a low fp32 measurement must not lower the peak
    assert (busy.fp32_flops, busy.int8_ops, busy.source) == (100.0, 500.0, "cache")
    reset = roofline.cached_peak(2, cache=cache, reset=True)
    assert (reset.fp32_flops, reset.int8_ops) == (60.0, 300.0)
    assert reset.floor_ms(120.0, "fp32") == pytest.approx(2000.0)  # 120 FLOP at 60 FLOP/s
    assert reset.floor_ms(120.0, "int8") == pytest.approx(400.0)


def test_cached_peak_is_kept_per_isa(monkeypatch, tmp_path: Path):
    """A run capped to a lower ISA on the same CPU keeps its own, lower peak."""
    from gml.bench import roofline

    measured = iter([("avx512_core_vnni", 400.0), ("avx2", 150.0), ("avx512_core_vnni", 300.0)])

    def fake_measure(threads: int) -> Peak:
        isa, int8 = next(measured)
        return Peak(100.0, int8, threads, "cpu", torch.__version__, isa=isa)

    monkeypatch.setattr(roofline, "measure_peak", fake_measure)
    cache = tmp_path / "peak.json"
    assert roofline.cached_peak(2, cache=cache).int8_ops == 400.0
    capped = roofline.cached_peak(2, cache=cache)
    assert (capped.isa, capped.int8_ops, capped.source) == ("avx2", 150.0, "measured")
    assert roofline.cached_peak(2, cache=cache).int8_ops == 400.0  # the VNNI entry is still there


def test_shared_step_runs_once_and_charges_reusers(tmp_path: Path):
    from gml.bench.variants import BuildContext, _shared_step

    ctx = BuildContext(TinyNet(), (torch.randn(1, 3, 8, 8),), [], 1, tmp_path)
    calls = []

    def make():
        calls.append(1)
        return "exported"

    first = _shared_step(ctx, "onnx", make)
    again = _shared_step(ctx, "onnx", make)
    assert calls == [1]
    assert first == ("exported", 0.0)  # the first user pays inside its own timed build
    assert again[0] == "exported" and again[1] == ctx.cache["onnx"][1] >= 0.0


def test_submodule_is_benchmarked_with_its_own_input_shape():
    from gml.bench.runner import _load

    spec = str(Path(__file__).parents[1] / "assets" / "models.py") + ":PerImage"
    model, name, shapes, _ = _load(spec, submodule="backbone")
    assert type(model).__name__ == "SmallCNN" and not model.training
    assert name.endswith("models.py:PerImage.backbone")
    assert shapes == [(1, 3, 32, 32)]  # SmallCNN's declared shape, not PerImage's (2, 3, 32, 32)
