"""A text file, one sample per non-empty line, tokenized with a local Hugging Face folder's tokenizer.

The tokenizer is loaded with ``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` under
``HF_HUB_OFFLINE=1`` (a Hub name is refused: nothing is downloaded). Every line is padded and
truncated to the same length (the model's example sequence length, or ``--seq-len``), so lines
stack into batches; the model's inputs are the first of ``input_ids``, ``attention_mask``,
``token_type_ids`` that its example inputs count (the order of BERT-family ``forward``\\s).
Lines carry no labels.
"""

from __future__ import annotations

import os
from typing import Any

from gml.data.source import DataSource, Inputs
from gml.errors import InputError

#: the order transformers' encoders take their tensors in
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


def load_tokenizer(folder: str | None, data_path: str) -> Any:
    if folder is None:
        raise InputError(
            f"{data_path} is a text file: its lines need the model's tokenizer.",
            hint="quantize a local Hugging Face model folder (its tokenizer is used), or pass --tokenizer FOLDER.",
        )
    if not os.path.isdir(folder):
        raise InputError(
            f"tokenizer {folder!r} is not a local folder (GML-Lab never downloads a tokenizer from the Hub).",
            hint="pass the folder holding tokenizer.json / vocab.txt (a local model folder).",
        )
    try:
        import transformers
    except ImportError:
        raise InputError(
            "tokenizing text needs the `transformers` package, which is not installed.",
            hint="pip install 'gml-lab[transformers]'.",
        ) from None
    from gml.models_hf import hub_offline

    try:
        with hub_offline():
            return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise InputError(
            f"cannot load a tokenizer from {folder}: {type(exc).__name__}: {str(exc).strip()[:200]}",
            hint="the folder needs a tokenizer (tokenizer.json, or vocab.txt / tokenizer_config.json).",
        ) from None


class TextLinesSource(DataSource):
    """One sample per non-empty line of a UTF-8 text file."""

    kind = "text"
    classes = None

    def __init__(self, path: str, tokenizer: Any, seq_len: int, n_inputs: int = 2) -> None:
        if n_inputs > len(INPUT_NAMES):
            raise InputError(
                f"this model takes {n_inputs} inputs; a text file gives at most {len(INPUT_NAMES)} "
                f"({', '.join(INPUT_NAMES)}).",
                hint="give tensors (.pt / .safetensors with one tensor per input) instead.",
            )
        self.path = path
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.names = INPUT_NAMES[:n_inputs]
        try:
            with open(path, encoding="utf-8") as f:
                self.lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, 1) if line.strip()]
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); a text data file holds one sample "
                "per line.",
                hint="convert it to UTF-8, or give images or tensor files instead.",
            ) from None

    def __len__(self) -> int:
        return len(self.lines)

    def item_id(self, i: int) -> str:
        return f"{os.path.basename(self.path)}:{self.lines[i][0]}"

    def read(self, i: int) -> tuple[Inputs, int | None]:
        enc = self.tokenizer(
            self.lines[i][1], padding="max_length", truncation=True, max_length=self.seq_len, return_tensors="pt"
        )
        missing = [n for n in self.names if n not in enc]
        if missing:
            raise InputError(
                f"the tokenizer gives no {missing[0]} for {self.item_id(i)}; the model takes {', '.join(self.names)}.",
                hint="use the tokenizer of the model's own folder (--tokenizer).",
            )
        return tuple(enc[n][0] for n in self.names), None

    def describe(self) -> str:
        return (
            f"{len(self)} lines from {self.path}, tokenized by {type(self.tokenizer).__name__} to "
            f"{self.seq_len} tokens ({', '.join(self.names)})"
        )
