"""``.gguf`` sources for :func:`gml.llm`: a llama.cpp GGUF file read offline by transformers' GGUF loader.

transformers (``from_pretrained(folder, gguf_file=name)``) turns the file's metadata into a config,
dequantizes every tensor to fp32 with the ``gguf`` package and undoes llama.cpp's conversion
(Llama's Q/K row permutation, Gemma's ``1 + w`` norms). GML then captures that module like any other
HF model, so a GGUF's quantized weights are the *fp32 reference*; ``weights="int8" | "int4"``
quantize it again with GML's own formats.

Checked here, before transformers runs, so each mistake is one clear error: ``gguf`` / ``accelerate``
not installed (the ``[llm]`` extra), a file that is not GGUF (no magic), an architecture transformers
cannot read, a tensor type the ``gguf`` package cannot dequantize. After loading, a parameter the file
did not provide (it would keep its random init) is refused too.

Tokens: :func:`gml.llm` on a GGUF takes token ids (``lm.tokenizer`` is ``None``: rebuilding the tokenizer
from a 262k vocabulary costs about as long as loading Gemma-3-270M). :func:`load_gguf_tokenizer` gives
transformers' tokenizer rebuilt from the file (``gml generate --prompt`` uses it). For Gemma 3 it was
checked against llama.cpp's own tokenizer (benchmarks/llm_accuracy.py: equal ids on 29 texts, with
transformers 5.24); other architectures' GGUF tokenizers are not checked by GML.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from gml.errors import ModelLoadError, UnsupportedError

EXTRA_HINT = "pip install 'gml-lab[llm]' (it adds gguf and accelerate, which transformers needs for GGUF files)"
GGUF_MAGIC = b"GGUF"


def is_gguf_source(path: str) -> bool:
    """A path :func:`gml.llm` reads as GGUF: a ``.gguf`` name or any file (a folder is an HF model folder)
    except a zip archive (a file ``lm.save`` wrote: :mod:`gml.llm.store`)."""
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(2) != b"PK"
    except OSError:
        return True  # the GGUF reader names the problem


def _require_packages() -> None:
    missing = []
    for name in ("gguf", "accelerate", "transformers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModelLoadError(f"reading a .gguf file needs the package(s) {', '.join(missing)}", EXTRA_HINT)


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path!r} does not exist", "give the path of a .gguf file or of an HF model folder")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})",
            "give a llama.cpp .gguf file, or the folder of a Hugging Face model (config.json + weights)",
        )


def _dequantizable(type_name: str) -> bool:
    """Whether the installed ``gguf`` package dequantizes this GGML tensor type (so transformers can load it)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[type_name]
    _, nbytes = GGML_QUANT_SIZES[qtype]  # (values, bytes) per block
    try:
        dequantize(np.zeros(nbytes, dtype=np.uint8), qtype)  # one all-zero block
    except NotImplementedError:
        return False
    return True


def _check_contents(path: str) -> None:
    """Architecture and tensor types, from the header only (tensor data is memory-mapped, not read)."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:  # truncated header, unknown type ids, ...
        raise ModelLoadError(
            f"could not read the GGUF header of {path!r}: {e}",
            "the file is damaged or newer than the installed gguf package: pip install -U gguf",
        ) from e
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise UnsupportedError(
            f"{path!r} holds a {arch!r} model; transformers' GGUF loader reads only {', '.join(readable)}",
            "convert the original Hugging Face model instead (a local folder works with gml.llm), "
            "or pick a GGUF of a supported architecture",
        )
    bad = sorted(t for t in {t.tensor_type.name for t in reader.tensors} if not _dequantizable(t))
    if bad:
        names = [t.name for t in reader.tensors if t.tensor_type.name in bad][:3]
        raise UnsupportedError(
            f"{path!r} has tensors of type {', '.join(bad)} (e.g. {', '.join(names)}), which the installed gguf "
            "package cannot dequantize, so transformers cannot load them",
            "requantize with llama.cpp (llama-quantize --allow-requantize IN.gguf OUT.gguf Q8_0), "
            "or pip install -U gguf",
        )


def load_gguf_tokenizer(path: str):
    """transformers' tokenizer rebuilt from the GGUF's vocabulary, or ``None`` when the file has none."""
    _check_file(path)
    _require_packages()
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError):
        return None


def load_gguf(path: str) -> nn.Module:
    """The ``*ForCausalLM`` module of a GGUF file, fp32 (dequantized), eager attention, eval mode."""
    _check_file(path)
    _require_packages()
    _check_contents(path)
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(os.path.abspath(path))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            local_files_only=True,
            trust_remote_code=False,
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
        )
    except (ValueError, OSError, KeyError, NotImplementedError, RuntimeError) as e:
        raise ModelLoadError(
            f"transformers could not load {path!r}: {str(e).splitlines()[0]}",
            "check that the file is a decoder-only LM GGUF (llama, mistral, qwen2, qwen3, phi3, gpt2, gemma3)",
        ) from e
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ModelLoadError(
            f"{path!r} does not provide {len(missing)} of the model's parameters (e.g. {', '.join(missing[:3])}); "
            "they would keep random values",
            "the GGUF was written with tensor names transformers does not map; convert the HF model instead",
        )
    return model.eval()
