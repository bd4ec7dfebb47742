"""OpenVINO GenAI side of benchmarks/llm_decode_ab.py; runs in a venv with openvino-genai, optimum-intel and
nncf (not GML's: ``pip install openvino-genai optimum-intel nncf``; for a ``.gguf`` source also ``gguf
accelerate``; optimum-intel 2.2.0 exports Gemma 3 only with ``transformers<=5.0``, so
``pip install transformers==5.0.0`` there). Offline: nothing is downloaded.

    python openvino_worker.py export SRC OUT_DIR {int8,int4} [--group-size G] [--asym]
    python openvino_worker.py decode OUT_DIR TOKENS.json PROMPT STEPS   # prints decode tokens/s (JSON)

``export``: SRC is a local Hugging Face folder or a ``.gguf`` file (loaded by transformers' GGUF loader
as fp32, as ``gml.llm`` does; needs ``gguf`` in this venv); optimum-intel converts it to an OpenVINO IR
with NNCF weight compression (``OVWeightQuantizationConfig``). ``int8``: 8-bit weights, symmetric unless
``--asym``, per output channel (``--group-size -1``, the default: NNCF's INT8 modes are per channel);
``int4``: 4-bit weights in groups of ``--group-size`` (default 32, GML's), symmetric unless ``--asym``,
``ratio=1.0`` (every matrix), NNCF's rule for the embedding and the LM head (8-bit per channel) kept.
No tokenizer is converted: the IR is run on token ids.

``decode``: ``openvino_genai.LLMPipeline`` on CPU with ``INFERENCE_NUM_THREADS`` =
``GML_OPENVINO_THREADS`` (default 2) and the pipeline's defaults otherwise; one short untimed generation,
then a prompt of PROMPT ids of the sequence and STEPS + 1 greedy new tokens (``ignore_eos``). Decode
tokens/s = 1000 / the pipeline's mean time per output token (``perf_metrics.get_tpot()``, which leaves
out the first token), time to first token = ``get_ttft()``. Only numpy, openvino and openvino_genai are
imported for it (this file must not need GML).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

THREADS = int(os.environ.get("GML_OPENVINO_THREADS", "2"))


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


def decode(path: str, tokens_json: str, prompt: int, steps: int) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    seq = json.loads(Path(tokens_json).read_text())[0]
    pipe = ov_genai.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=THREADS)

    def ids(n: int) -> ov.Tensor:
        return ov.Tensor(np.asarray([seq[:n]], dtype=np.int64))

    pipe.generate(ids(8), max_new_tokens=4, ignore_eos=True, do_sample=False)
    res = pipe.generate(ids(prompt), max_new_tokens=steps + 1, ignore_eos=True, do_sample=False)
    pm = res.perf_metrics
    new = len(res.tokens[0])
    if new != steps + 1:
        raise SystemExit(f"expected {steps + 1} new tokens, got {new}")
    return {"decode_tokens_per_second": 1000.0 / pm.get_tpot().mean, "ttft_ms": pm.get_ttft().mean}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("src")
    e.add_argument("out")
    e.add_argument("weights", choices=["int8", "int4"])
    e.add_argument("--group-size", type=int, default=None)
    e.add_argument("--asym", action="store_true")
    d = sub.add_parser("decode")
    d.add_argument("path")
    d.add_argument("tokens")
    d.add_argument("prompt", type=int)
    d.add_argument("steps", type=int)
    a = ap.parse_args()
    if a.cmd == "export":
        result = export(a.src, a.out, a.weights, a.group_size, a.asym)
    else:
        result = decode(a.path, a.tokens, a.prompt, a.steps)
    print(json.dumps(result))
    sys.stdout.flush()
