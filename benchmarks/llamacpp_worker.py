"""llama.cpp side of benchmarks/llm_accuracy.py; runs in the venv that has llama-cpp-python (not GML's).

    python llamacpp_worker.py quantize IN.gguf OUT.gguf {Q8_0,Q4_0,F32}
    python llamacpp_worker.py logits MODEL.gguf TOKENS.json OUT_DIR      # OUT_DIR/seq{i}.npy, float32 [L, V]
    python llamacpp_worker.py tokenize MODEL.gguf TEXTS.json             # prints token ids (JSON)

Decoding speed is timed by ``gml bench --llm`` / ``llm_decode_ab.py`` through ``gml.bench.llm_worker``.
Only numpy and llama_cpp are imported (this file must not need GML). 2 threads (or GML_LLAMACPP_THREADS),
llama-cpp-python's defaults otherwise (f16 KV cache, no flash attention). Results go to stdout as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import llama_cpp
import numpy as np

FTYPES = {
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
}
THREADS = int(os.environ.get("GML_LLAMACPP_THREADS", "2"))  # llm_accuracy.py --threads


def quantize(src: str, dst: str, ftype: str) -> dict:
    """llama.cpp's quantize (``llama-quantize --allow-requantize``): every tensor is dequantized to fp32 and
    quantized to ``ftype`` with llama.cpp's default per-tensor rules (1-D norms stay F32)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = THREADS
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")
    return {"ok": True}


def _load(path: str, n_ctx: int, logits_all: bool) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        logits_all=logits_all,
        verbose=False,
    )


def logits(path: str, tokens_json: str, out_dir: str) -> dict:
    """Teacher-forced logits of every position of each token sequence (one context per sequence)."""
    seqs = json.loads(Path(tokens_json).read_text())
    llm = _load(path, max(len(s) for s in seqs), logits_all=True)
    for i, seq in enumerate(seqs):
        llm.reset()
        llm.eval(seq)
        np.save(f"{out_dir}/seq{i}.npy", np.ascontiguousarray(llm.scores[: len(seq)], dtype=np.float32))
    return {"sequences": len(seqs)}


def tokenize(path: str, texts_json: str) -> dict:
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    texts = json.loads(Path(texts_json).read_text())
    return {"ids": [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]}


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "quantize":
        out = quantize(*rest)
    elif cmd == "logits":
        out = logits(*rest)
    elif cmd == "tokenize":
        out = tokenize(*rest)
    else:
        raise SystemExit(__doc__)
    print(json.dumps(out))
