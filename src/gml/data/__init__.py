"""Small bundled data sets and the models GML-Lab trains on them (for accuracy checks)."""

from __future__ import annotations

from gml.data.digits import DigitsCNN, DigitsData, TrainedDigits, load_digits, train_digits_model

__all__ = ["DigitsCNN", "DigitsData", "TrainedDigits", "load_digits", "train_digits_model"]
