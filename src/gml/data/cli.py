"""The data options of ``gml quantize`` / ``gml bench`` / ``gml run``; ``gml.cli`` wires them with one call."""

from __future__ import annotations

import argparse
from typing import Any

from gml.argtypes import positive_int
from gml.data.images import ImageOptions
from gml.data.loader import KINDS, DataOptions


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def add_preprocess_arguments(p: argparse.ArgumentParser) -> None:
    """``--resize/--crop/--mean/--std`` (images) and ``--tokenizer/--seq-len`` (text)."""
    g = p.add_argument_group(
        "turning data files into model inputs",
        "images: resize, center crop, [0, 1] pixels, normalize; each number from the flag, else the model's "
        "metadata (torchvision weights / timm), else resize to the model's input size without normalizing",
    )
    g.add_argument("--resize", type=positive_int, metavar="N", help="images: resize the shorter side to N pixels")
    g.add_argument("--crop", type=positive_int, metavar="N", help="images: center-crop N x N after resizing")
    g.add_argument("--mean", type=_floats, metavar="M[,M,M]", help="images: per-channel mean of [0, 1] pixels")
    g.add_argument("--std", type=_floats, metavar="S[,S,S]", help="images: per-channel std of [0, 1] pixels")
    g.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="text: a local Hugging Face folder whose tokenizer splits the lines (default: MODEL, when it is "
        "a local folder)",
    )
    g.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="N",
        help="text: tokens per line, padded or truncated (default: the example input's length; gml run: 128 when "
        "the saved model takes any length)",
    )


def add_data_arguments(p: argparse.ArgumentParser, *, accuracy_gate: bool = True) -> None:
    """``--calib-data/--calib-samples/--eval-data`` (and ``--max-accuracy-drop``) plus preprocessing."""
    g = p.add_argument_group("real data (instead of generated inputs)")
    g.add_argument(
        "--calib-data",
        metavar="PATH",
        help=f"calibrate on this data instead of generated batches: {KINDS}",
    )
    g.add_argument(
        "--calib-samples",
        type=positive_int,
        default=128,
        metavar="N",
        help="calibrate on a seeded random subset of N samples of --calib-data (default 128; all if fewer)",
    )
    g.add_argument(
        "--eval-data",
        metavar="PATH",
        help="held-out data for the accuracy report (default: generated inputs); with labels (class "
        "sub-folders, or tensors saved with 'labels') it gives fp32 and INT8 top-1 / top-5 accuracy",
    )
    if accuracy_gate:
        g.add_argument(
            "--max-accuracy-drop",
            "--min-accuracy-drop",
            dest="max_accuracy_drop",
            type=float,
            metavar="X",
            help="fail (exit 9, nothing saved) when INT8's top-1 accuracy on the labelled --eval-data is more "
            "than X percentage points below fp32's",
        )
    add_preprocess_arguments(p)


def data_options(args: argparse.Namespace) -> DataOptions:
    image = ImageOptions(resize=args.resize, crop=args.crop, mean=args.mean, std=args.std)
    return DataOptions(image=image, tokenizer=args.tokenizer, seq_len=args.seq_len)


def open_calib_eval(args: argparse.Namespace, model: Any, inputs: tuple) -> tuple[Any, Any]:
    """``(calib source or None, eval source or None)`` from the parsed options; the gate's
    requirements (labelled ``--eval-data``) are checked here, before any work."""
    from gml.data.loader import open_data
    from gml.errors import GMLError

    drop = getattr(args, "max_accuracy_drop", None)
    if drop is not None and not drop >= 0:
        raise GMLError(f"--max-accuracy-drop {drop:g} is not a number of points >= 0.", hint="e.g. 1.0")
    if drop is not None and not args.eval_data:
        raise GMLError(
            "--max-accuracy-drop needs --eval-data with labels: generated inputs have no right answer.",
            hint="add --eval-data val/ (an ImageFolder: one sub-folder of images per class).",
        )
    spec = args.model if isinstance(args.model, str) else None
    opts = data_options(args)
    calib = open_data(args.calib_data, inputs, model=model, spec=spec, options=opts) if args.calib_data else None
    evaluation = (
        open_data(args.eval_data, inputs, model=model, spec=spec, options=opts, require_labels=drop is not None)
        if args.eval_data
        else None
    )
    return calib, evaluation
