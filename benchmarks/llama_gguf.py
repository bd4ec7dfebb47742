"""The TinyLlama-1.1B-shaped random model of ``gml bench tinyllama --llm`` for GML's peers (issue #26).

    python benchmarks/llama_gguf.py OUT_DIR [--model tinyllama] [--llamacpp-python PY] [--check 8]

writes, from the one model ``gml.bench.llm.random_llm`` builds (seed 0, the weights GML's bench times):

* ``OUT_DIR/hf/``: the model as a Hugging Face folder (``save_pretrained``, fp32) — what
  ``benchmarks/openvino_worker.py export`` reads;
* ``OUT_DIR/<model>-f16.gguf``: the model as llama.cpp's ``convert_hf_to_gguf.py --outtype f16`` would
  write it (:func:`write_llama_gguf`), then ``-q8_0.gguf`` / ``-q4_0.gguf``: llama.cpp's quantize of
  that file (``llamacpp_worker.py quantize``, llama.cpp's default per-tensor rules);
* ``OUT_DIR/<model>-int8.gml`` / ``-int4.gml``: ``gml.llm(model, weights=...).save(...)`` with GML's
  defaults (INT8 in groups of 32; INT4 g32 symmetric with an INT8 LM head), and ``-int8pc.gml``: INT8 per
  output channel (``group_size=None``, the layout of OpenVINO's INT8 weights);
* with ``--openvino-python PY``: ``OUT_DIR/ov-int8`` / ``ov-int4``, OpenVINO IR folders exported from
  ``hf/`` by ``openvino_worker.py export`` in that venv (NNCF INT8 per channel / INT4 g32 symmetric);

and checks that it is one model: llama.cpp's logits of the F16 file on ``--check`` token ids against HF
eager fp32's (F16 weights and F16 activations in llama.cpp's matmuls: close, not equal). Then time them
with ``benchmarks/llm_decode_ab.py`` (the command is printed at the end).

The GGUF layout (arch ``llama``), as the converter writes it: the hyper-parameters under ``llama.*``, the
tensors renamed by ``gguf``'s own name table (``token_embd``, ``blk.N.attn_q`` …, ``output_norm``,
``output``), the Q / K rows of each head permuted from HF's rotate-half order to GGML's interleaved
pairs, 2-D matrices F16 and 1-D norms F32. The model has no tokenizer, so the file gets a stand-in of
TinyLlama's vocabulary layout (SentencePiece ``llama``: ``<unk>``, ``<s>``, ``</s>``, the 256 byte
tokens ``<0x00>``…``<0xFF>``, then placeholder pieces); the benchmarks feed token ids, never text.

Runs in GML's venv with the ``gguf`` package (``pip install -e '.[llm]'``); llama.cpp runs in its own venv
(``--llamacpp-python``, as for ``llm_accuracy.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


#: The GML files written (label -> gml.llm options): the defaults of each width, and INT8 per output
#: channel, the layout of OpenVINO's (NNCF's) INT8 weights.
GML_FILES = {
    "int8": dict(weights="int8"),
    "int4": dict(weights="int4"),
    "int8pc": dict(weights="int8", group_size=None),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half Q / K rows of each head ``[x0..x_{d/2-1}, y0..y_{d/2-1}]`` -> GGML's ``[x0, y0, x1, y1, ..]``
    (``LlamaModel.permute`` in convert_hf_to_gguf.py; K uses the KV head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stand_in_vocab(n: int) -> tuple[list[bytes], list[float], list[int]]:
    """A SentencePiece-shaped vocabulary of ``n`` tokens laid out as TinyLlama's (Llama 2's): tokens, scores,
    GGUF token types. Only its size and special ids matter to the model; the pieces are placeholders."""
    import gguf

    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}".encode() for i in range(len(tokens), n)]
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, [int(t) for t in types]


def write_llama_gguf(model: torch.nn.Module, path: str | Path, name: str = "random-llama") -> None:
    """Write a HF ``LlamaForCausalLM`` to ``path`` as an F16 GGUF (see the module docstring)."""
    import gguf

    cfg = model.config
    if cfg.model_type != "llama":
        raise ValueError(f"write_llama_gguf writes Llama models, not {cfg.model_type!r}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"write_llama_gguf writes the default RoPE only, not {rope['rope_type']!r}")
    arch = gguf.MODEL_ARCH.LLAMA
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    # TextModel.set_gguf_parameters + LlamaModel.set_gguf_parameters
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    # _set_vocab_sentencepiece, with the stand-in vocabulary
    tokens, scores, types = stand_in_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if base == "lm_head" and cfg.tie_word_embeddings:
            continue  # tied: no output.weight, llama.cpp uses token_embd as the head
        gname = names.get_name(base)
        if gname is None:
            raise ValueError(f"no GGUF name for {hf_name!r}")
        data = t.detach().float().numpy()
        if gname.endswith("attn_q"):
            data = _permute(data, cfg.num_attention_heads)
        elif gname.endswith("attn_k"):
            data = _permute(data, cfg.num_key_value_heads)
        w.add_tensor(f"{gname}.{suffix}", data.astype(np.float16) if data.ndim == 2 else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llamacpp(py: str, *args: str) -> dict:
    """Run ``llamacpp_worker.py`` in llama.cpp's venv (its AMX buffer type off: llamacpp_noamx.c)."""
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(tmp) / "libnoamx.so"
        cc = ["gcc", "-O2", "-shared", "-fPIC", str(HERE / "llamacpp_noamx.c"), "-o", str(lib), "-ldl"]
        subprocess.run(cc, check=True)
        env = {**os.environ, "LD_PRELOAD": str(lib)}
        out = subprocess.run([py, str(HERE / "llamacpp_worker.py"), *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"llamacpp_worker {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_logits(model: torch.nn.Module, gguf_path: Path, py: str, n: int) -> float:
    """Largest |llama.cpp logit − HF eager fp32 logit| over ``n`` teacher-forced positions, relative to the
    largest |HF logit|. Prints it per position."""
    gen = torch.Generator().manual_seed(1)
    ids = [1, *torch.randint(3, model.config.vocab_size, (n - 1,), generator=gen).tolist()]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double()
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokens.json"
        tok.write_text(json.dumps([ids]))
        llamacpp(py, "logits", str(gguf_path), str(tok), tmp)
        got = torch.from_numpy(np.load(Path(tmp) / "seq0.npy")).double()
    scale = ref.abs().max().item()
    rel = (got - ref).abs().max(dim=1).values / scale
    same_top1 = (got.argmax(1) == ref.argmax(1)).tolist()
    print(f"llama.cpp F16 vs HF eager fp32, token ids {ids}: largest |logit| {scale:.3f}")
    for i, (r, s) in enumerate(zip(rel.tolist(), same_top1)):
        print(f"  position {i}: max |diff| / max |logit| = {r:.2e}, same top-1: {s}")
    return rel.max().item()


def main() -> None:
    import gml
    from gml.bench.llm import RANDOM_LLMS, random_llm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="tinyllama", choices=sorted(RANDOM_LLMS))
    ap.add_argument("--llamacpp-python", default="/work/venvs/llamacpp/bin/python")
    ap.add_argument("--openvino-python", default=None, help="also export OUT_DIR/ov-int8, ov-int4 (openvino_worker.py)")
    ap.add_argument("--check", type=int, default=8, help="teacher-forced positions compared with HF eager")
    ap.add_argument("--max-length", type=int, default=2048, help="of the saved GML files")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    m = args.model

    model = random_llm(m)
    if not (out / "hf" / "config.json").exists():
        print(f"writing {out / 'hf'}", flush=True)
        model.save_pretrained(out / "hf")
    f16 = out / f"{m}-f16.gguf"
    if not f16.exists():
        print(f"writing {f16}", flush=True)
        write_llama_gguf(model, f16, name=m)
    for q in ("Q8_0", "Q4_0"):
        dst = out / f"{m}-{q.lower()}.gguf"
        if not dst.exists():
            print(f"llama.cpp quantize {q} -> {dst}", flush=True)
            llamacpp(args.llamacpp_python, "quantize", str(f16), str(dst), q)
    for label, kw in GML_FILES.items():
        dst = out / f"{m}-{label}.gml"
        if not dst.exists():
            print(f"gml.llm({kw}).save -> {dst}", flush=True)
            gml.llm(model, max_length=args.max_length, **kw).save(dst)
    worst = check_logits(model, f16, args.llamacpp_python, args.check)
    print(f"worst relative logit difference: {worst:.2e}")
    if worst > 2e-2:
        sys.exit(f"llama.cpp's logits of {f16} are not HF's ({worst:.2e} > 2e-2): the GGUF is not this model")
    peers = f"--llamacpp Q8_0={out}/{m}-q8_0.gguf --llamacpp Q4_0={out}/{m}-q4_0.gguf"
    if args.openvino_python:
        for w in ("int8", "int4"):  # NNCF: INT8 per channel; INT4 in groups of 32 (GML's), symmetric
            dst = out / f"ov-{w}"
            if not (dst / "openvino_model.xml").exists():
                print(f"OpenVINO export {w} -> {dst}", flush=True)
                cmd = [args.openvino_python, str(HERE / "openvino_worker.py"), "export", str(out / "hf"), str(dst), w]
                subprocess.run(cmd, check=True, capture_output=True)
            peers += f" --openvino {w}={dst}"
    models = " ".join(f"--model {label}={out}/{m}-{label}.gml" for label in GML_FILES)
    print(
        f"\npython benchmarks/llm_decode_ab.py --gml new=.venv/bin/python --vocab {model.config.vocab_size} "
        f"--bos 1 {models} {peers}"
    )


if __name__ == "__main__":
    main()
