"""Real data in, real accuracy out, batch inference in and out of Ray (issue #27).

    .venv/bin/python benchmarks/real_data.py                  # both parts, prints a Markdown block
    .venv/bin/python benchmarks/real_data.py --part digits    # only the calibration comparison
    .venv/bin/python benchmarks/real_data.py --images 200     # a quick trial of the run part

1. **Calibration on real vs generated inputs.** The digits CNN trained on scikit-learn's digits
   (:mod:`gml.data.digits`) is quantized twice with GML's static INT8 scheme (cost policy off, so
   both results are INT8 and not the fp32 fallback): calibrated on 64 real training digits, read
   from an ImageFolder of PNGs by :func:`gml.data.open_data` (what ``--calib-data`` does), and on
   64 generated N(0, 1) inputs (what ``--calib 8`` gives, in batches of 8). Both are scored on the
   450 held-out digits read the same way (``--eval-data``): fp32 and INT8 top-1, and agreement.
2. **Batch inference throughput.** ResNet18 (random weights) quantized and saved as ``.pt2``, run
   over 2,000 generated 224×224 JPEGs (random 14×14 colour fields upsampled: compressible like
   photos) with torchvision's ResNet18 preprocessing (decode, resize 256, crop 224, normalize):
   ``gml run`` in process (one engine, all threads) against ``gml run --ray`` on a local Ray of
   2 CPUs (two actors, one thread each, each loading the ``.pt2``), interleaved, ``--rounds``
   times each. Times are of the whole ``run_batch`` call (loading the model, and with Ray the
   actors' start-up and engine builds, included; Ray's own start-up reported apart); "first
   results after" is from the start of the work (after the driver loaded the model) to the first
   batch of outputs, and the last column the rate from there on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import torch

import gml
from gml.data import DataOptions, ImageOptions, open_data, save_digits_images, train_digits_model


def cpu_name() -> str:
    from gml.bench.roofline import cpu_name as name

    return name()


def digits_part(seed: int = 0) -> list[str]:
    from gml.quant.calibrate import generate_batches

    trained = train_digits_model(seed=seed, cache_dir=tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="gml-digits-") as root:
        mean, std = save_digits_images(trained.data, os.path.join(root, "train"), "train")
        save_digits_images(trained.data, os.path.join(root, "test"), "test")
        x = trained.data.x_test[:1]
        opts = DataOptions(image=ImageOptions(mean=mean, std=std))
        train = open_data(os.path.join(root, "train"), (x,), options=opts)
        held_out = open_data(os.path.join(root, "test"), (x,), options=opts)
        real = train.calibration(64, batch_size=8, seed=seed)
        generated = generate_batches((x,), 8, seed=seed, batch_size=8)
        rows = []
        for observer in ("minmax", "histogram"):
            for label, calib in (("64 real training digits", real), ("64 generated N(0, 1) inputs", generated)):
                q = gml.quantize(
                    trained.model, calib, example_inputs=(x,), eval_data=held_out, per_layer=False,
                    cost_policy="off", observer=observer,
                )  # fmt: skip
                a = q.accuracy
                rows.append(
                    f"| {label} | {observer} | {100 * a.fp32_top1:.2f}% | {100 * a.int8_top1:.2f}% | "
                    f"{a.accuracy_drop:+.2f} | {100 * a.top1_agreement:.2f}% | {a.cosine:.5f} |"
                )
    return [
        f"Held-out: {a.samples} digits (ImageFolder of PNGs, read by `gml.data.open_data`); calibration "
        "batches of 8; static INT8 scheme, cost policy off (every op INT8).",
        "",
        "| calibrated on | observer | fp32 top-1 | INT8 top-1 | drop (points) | top-1 agreement | output cosine |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def _write_images(root: str, n: int, seed: int = 0) -> None:
    from torchvision.io import write_jpeg

    gen = torch.Generator().manual_seed(seed)
    os.makedirs(root, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for i in range(n):
            small = torch.rand(1, 3, 14, 14, generator=gen)
            img = torch.nn.functional.interpolate(small, size=(224, 224), mode="bilinear", align_corners=False)
            write_jpeg((img[0] * 255).to(torch.uint8), os.path.join(root, f"{i:05d}.jpg"), quality=90)


def run_part(n_images: int, rounds: int, batch_size: int) -> list[str]:
    import ray

    from gml.batch import run_batch

    with tempfile.TemporaryDirectory(prefix="gml-run-") as root:
        model = __import__("torchvision").models.resnet18().eval()
        x = torch.randn(1, 3, 224, 224)
        t0 = time.perf_counter()
        q = gml.quantize(model, 8, example_inputs=(x,), per_layer=False)
        saved = os.path.join(root, "r18_int8.pt2")
        q.save(saved)
        quant_s = time.perf_counter() - t0
        _write_images(os.path.join(root, "in"), n_images)
        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_init_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {"gml run": [], "gml run --ray": []}
        firsts: dict[str, list[float]] = {"gml run": [], "gml run --ray": []}
        steady: dict[str, list[float]] = {"gml run": [], "gml run --ray": []}
        written = {}
        for r in range(rounds):
            for name, address in (("gml run", None), ("gml run --ray", "")):
                out = os.path.join(root, f"out-{r}-{'ray' if address is not None else 'local'}.parquet")
                t0 = time.perf_counter()
                rep = run_batch(
                    saved, os.path.join(root, "in"), out, batch_size=batch_size, preprocess_model="resnet18",
                    ray_address=address, progress=False,
                )  # fmt: skip
                times[name].append(time.perf_counter() - t0)
                firsts[name].append(rep.first_result_s or 0.0)
                steady[name].append(rep.written / (rep.seconds - (rep.first_result_s or 0.0)))
                written[name] = (rep.written, rep.runner)
        ray.shutdown()
    lines = [
        f"ResNet18 INT8 (`{q.precision}`, quantized + saved in {quant_s:.0f} s), {n_images} generated 224×224 JPEGs, "
        f"torchvision ResNet18 preprocessing, batch size {batch_size}, Parquet output; {rounds} interleaved "
        f"round(s) each; local Ray start-up {ray_init_s:.1f} s (not included).",
        "",
        "| runner | images/s (median) | rounds (s) | first results after (s) | images/s after the first results "
        "| how |",
        "|---|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(
            f"| `{name}` | {written[name][0] / med:.1f} | {', '.join(f'{t:.1f}' for t in ts)} | "
            f"{', '.join(f'{f:.1f}' for f in firsts[name])} | {statistics.median(steady[name]):.1f} | "
            f"{written[name][1]} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "digits", "run"), default="all")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    header = [
        f"CPU: {cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__}, {platform.python_version()}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    out = header
    if args.part in ("all", "digits"):
        out += ["**Calibration on real vs generated inputs (trained digits CNN)**", "", *digits_part(), ""]
    if args.part in ("all", "run"):
        lines = run_part(args.images, args.rounds, args.batch_size)
        out += ["**Batch inference: `gml run` vs `gml run --ray`**", "", *lines]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
