"""OpenVINO IR export for ``gml bench --llm --openvino-model DIR`` and benchmarks/llm_decode_ab.py; runs in a
venv with openvino-genai, optimum-intel and nncf (not GML's: ``pip install openvino-genai optimum-intel
nncf``; for a ``.gguf`` source also ``gguf accelerate``; optimum-intel 2.2.0 exports Gemma 3 only with
``transformers<=5.0``, so ``pip install transformers==5.0.0`` there). Offline: nothing is downloaded.

    python openvino_worker.py export SRC OUT_DIR {int8,int4} [--group-size G] [--asym]

``export``: SRC is a local Hugging Face folder or a ``.gguf`` file (loaded by transformers' GGUF loader
as fp32, as ``gml.llm`` does; needs ``gguf`` in this venv); optimum-intel converts it to an OpenVINO IR
with NNCF weight compression (``OVWeightQuantizationConfig``). ``int8``: 8-bit weights, symmetric unless
``--asym``, per output channel (``--group-size -1``, the default: NNCF's INT8 modes are per channel);
``int4``: 4-bit weights in groups of ``--group-size`` (default 32, GML's), symmetric unless ``--asym``,
``ratio=1.0`` (every matrix), NNCF's rule for the embedding and the LM head (8-bit per channel) kept.
No tokenizer is converted: the IR is run on token ids.

The pipeline itself is driven by ``gml.bench.llm_worker`` (``gml bench --llm``, ``llm_decode_ab.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _hf_model(src: str):
    """The fp32 HF model of a local folder or a .gguf file."""
    import torch

    from transformers import AutoModelForCausalLM

    p = Path(src)
    if p.is_file():
        return AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, local_files_only=True, dtype=torch.float32
        )
    return AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float32)


def export(src: str, out: str, weights: str, group_size: int | None, asym: bool) -> dict:
    import tempfile

    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    bits = {"int8": 8, "int4": 4}[weights]
    if group_size is None:
        group_size = -1 if bits == 8 else 32
    q = OVWeightQuantizationConfig(bits=bits, sym=not asym, group_size=group_size, ratio=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = src
        if Path(src).is_file():  # a .gguf: through a local HF folder (optimum exports folders)
            _hf_model(src).save_pretrained(tmp)
            folder = tmp
        model = OVModelForCausalLM.from_pretrained(
            folder, export=True, quantization_config=q, compile=False, local_files_only=True
        )
        model.save_pretrained(out)
    return {"out": out, "bits": bits, "sym": not asym, "group_size": group_size}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("src")
    e.add_argument("out")
    e.add_argument("weights", choices=["int8", "int4"])
    e.add_argument("--group-size", type=int, default=None)
    e.add_argument("--asym", action="store_true")
    a = ap.parse_args()
    result = export(a.src, a.out, a.weights, a.group_size, a.asym)
    print(json.dumps(result))
    sys.stdout.flush()
