"""The user's data as model inputs (:func:`open_data`: image folders, text lines, tensor files), and
small bundled data sets with the models GML-Lab trains on them (for accuracy checks)."""

from __future__ import annotations

from gml.data.digits import (
    DigitsCNN,
    DigitsData,
    TrainedDigits,
    load_digits,
    save_digits_images,
    train_digits_model,
)
from gml.data.images import ImageOptions, ImagePreprocess
from gml.data.loader import DataOptions, open_data
from gml.data.source import Batch, DataSource

__all__ = [
    "Batch",
    "DataOptions",
    "DataSource",
    "DigitsCNN",
    "DigitsData",
    "ImageOptions",
    "ImagePreprocess",
    "TrainedDigits",
    "load_digits",
    "open_data",
    "save_digits_images",
    "train_digits_model",
]
