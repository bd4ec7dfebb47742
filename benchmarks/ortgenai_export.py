"""Build ONNX Runtime GenAI models for ``gml bench --llm --ortgenai-model DIR``; runs in a venv with
``onnxruntime-genai onnx onnx_ir transformers torch`` (not GML's). Offline: nothing is downloaded.

    python benchmarks/ortgenai_export.py SRC OUT_DIR {int4,int8} [--block-size 32] [--accuracy-level 4]

SRC is a local Hugging Face folder or a ``.gguf`` file (loaded by transformers' GGUF loader as fp32, as
``gml.llm`` does, and saved as a HF folder first, with the tokenizer transformers rebuilds from it; ``--save-hf
DIR`` keeps that folder). The model builder
(``python -m onnxruntime_genai.models.builder -e cpu -p int4|int8``) writes MatMulNBits weights
(symmetric, blocks of ``--block-size`` along K; default 32, GML's and Q4_0's / Q8_0's block) with
``accuracy_level`` 4 (the activations quantized to int8 for the dot products; the builder's CPU default);
the embedding table stays fp32 (``Gather``; only the looked-up rows are read). Gemma 3 folders written by
transformers 5 nest their RoPE per layer type, which the builder (0.18) does not read: it is run with the
config flattened back (``_builder``).

The builder insists on a tokenizer. A folder without one (the random-weight TinyLlama-shaped model of
``benchmarks/llama_gguf.py``) is staged through a temporary folder of symlinks plus a placeholder
word-level tokenizer of the model's vocabulary size: the benchmark runs on token ids, so the tokenizer is
never used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _stage(src: Path, tmp: Path) -> Path:
    """A folder the builder accepts: ``src`` itself, or symlinks to it plus a placeholder tokenizer."""
    if src.is_file():  # a .gguf: through a HF folder, with the tokenizer transformers rebuilds from it
        import torch

        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, local_files_only=True, dtype=torch.float32
        )
        model.hf_quantizer = None  # the weights are fp32 now; transformers would refuse to save a "gguf" model
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True).save_pretrained(tmp)
        return tmp
    if any((src / n).exists() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return src
    from tokenizers import Tokenizer, models

    from transformers import PreTrainedTokenizerFast

    for f in src.iterdir():
        (tmp / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        tmp
    )
    return tmp


def _builder(argv: list[str]) -> None:
    """Run the model builder with transformers 5's per-layer-type RoPE (Gemma 3's ``rope_parameters:
    {full_attention: ..., sliding_attention: ...}``) given back in the flat form the builder (0.18) reads:
    ``rope_theta`` global, ``rope_local_base_freq`` local."""
    import runpy

    import transformers

    load = transformers.AutoConfig.from_pretrained

    def flat_rope(*args, **kwargs):
        config = load(*args, **kwargs)
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict) and "full_attention" in rope:
            config.rope_local_base_freq = rope.get("sliding_attention", rope["full_attention"])["rope_theta"]
            config.rope_theta = rope["full_attention"]["rope_theta"]
            config.rope_parameters = dict(rope["full_attention"])
        return config

    transformers.AutoConfig.from_pretrained = flat_rope
    sys.argv = ["builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")


def main() -> None:
    if sys.argv[1:2] == ["--builder"]:
        return _builder(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("precision", choices=["int4", "int8"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--accuracy-level", type=int, default=4)
    ap.add_argument("--save-hf", type=Path, help="a .gguf SRC: keep the HF folder made from it here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ortgenai-stage-") as tmp, tempfile.TemporaryDirectory() as cache:
        stage = Path(tmp)
        if a.save_hf and a.src.is_file():
            a.save_hf.mkdir(parents=True, exist_ok=True)
            stage = a.save_hf
        folder = _stage(a.src.resolve(), stage)
        cmd = [sys.executable, __file__, "--builder", "-i", str(folder), "-o", str(a.out),
               "-p", a.precision, "-e", "cpu", "-c", cache, "--extra_options", f"block_size={a.block_size}",
               f"accuracy_level={a.accuracy_level}", "hf_remote=false", "hf_token=false"]  # fmt: skip
        print(" ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
