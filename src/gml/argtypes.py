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


def add_model_arguments(p: argparse.ArgumentParser, saved_models: str) -> None:
    """The positional MODEL (its help: :data:`MODEL_KINDS` + ``saved_models``, what the command does
    with a model saved by gml) and the options that say how its code and weights may be loaded
    (``--weights``, ``--unsafe-load``, ``--trust-remote-code``), for every command that loads a model."""
    p.add_argument("model", help=MODEL_KINDS + saved_models)
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
