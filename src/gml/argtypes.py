"""argparse ``type=`` converters and options the ``gml`` subcommands share (one definition each)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """``N`` with N >= 1, or argparse's usage error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


#: what the MODEL argument of ``gml optimize`` / ``quantize`` / ``inspect`` / ``bench`` names
MODEL_KINDS = (
    "torchvision name (resnet18), timm:NAME (random init), path/to/file.py:ClassName, hf:ArchitectureClass "
    "(e.g. hf:BertModel: default config, random weights, nothing downloaded) or a local Hugging Face model folder"
)


def add_model_arguments(
    p: argparse.ArgumentParser,
    saved_models: str,
    input_shape: str = "example input shape(s), e.g. 1x3x224x224; several inputs: 1x3x32x32,1x10 "
    "(default: what the model declares, else 1x3x224x224)",
) -> None:
    """What every command that loads a model takes: the positional MODEL (help: :data:`MODEL_KINDS` +
    ``saved_models``, what the command does with a model saved by gml), ``--input-shape`` (help:
    ``input_shape``), the options that say how its code and weights may be loaded (``--weights``,
    ``--unsafe-load``, ``--trust-remote-code``), ``--leaf`` and ``--submodule``."""
    p.add_argument("model", help=MODEL_KINDS + saved_models)
    p.add_argument("--input-shape", metavar="SHAPE", help=input_shape)
    p.add_argument("--weights", metavar="FILE", help="state_dict checkpoint to load (weights_only=True)")
    p.add_argument(
        "--unsafe-load",
        action="store_true",
        help="allow pickled objects in --weights (runs code from the file: only for files you trust)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a local Hugging Face model folder whose config.json has auto_map run its own Python code "
        "(only for folders you trust; refused by default)",
    )
    p.add_argument(
        "--leaf",
        action="append",
        default=[],
        metavar="SUBMODULE",
        help="keep this submodule opaque while tracing (repeatable); helps with untraceable code",
    )
    p.add_argument(
        "--submodule",
        metavar="PATH",
        help="work on this part of the model only (e.g. backbone), when the whole does not trace",
    )
