"""One peer LLM runtime of ``gml bench --llm`` in its own process (:mod:`gml.bench.llm_peers` starts it).

    PYTHON path/to/llm_worker.py {llamacpp,openvino,ortgenai}

It runs in whichever interpreter has the peer installed (often its own venv), so it imports only the
standard library, numpy and the peer — never ``gml``. A process per peer also keeps the peers' OpenMP
runtimes and memory apart from GML's and from each other's.

Protocol: one JSON object per line, requests on stdin, replies on stdout (the worker moves the peer's
own output, C libraries' included, to stderr, so stdout carries only replies):

* ``{"cmd": "load", "model": PATH, "threads": T, "max_length": N}`` →
  ``{"ok": true, "runtime": "llama-cpp-python 0.3.36", "vocab_size": V or null, "precision": "Q8_0",
  "weight_bytes": B or null}`` (precision and bytes read per decode step from the model's files:
  :mod:`gml.bench.llm_files`, loaded by path, in this interpreter — where the peer's ``onnx`` lives)
* ``{"cmd": "run", "prompt": [ids], "new_tokens": M}`` →
  ``{"ok": true, "prefill_seconds": s, "decode_seconds": s, "new_tokens": M}``: ``prefill_seconds`` from
  the prompt to the first new token (its logits and the pick), ``decode_seconds`` the ``M - 1`` greedy
  steps after it (each step's LM head and argmax included), as ``gml.llm``'s ``lm.stats`` counts them.
* ``{"cmd": "quit"}`` → the process exits.

Any failure is ``{"ok": false, "error": "..."}`` (the worker keeps serving; a failed load leaves it
without a model). Greedy decoding, batch 1, ``T`` threads, each peer's defaults otherwise:

* ``llamacpp`` (llama-cpp-python): ``Llama(n_ctx=N, n_batch=512, n_threads=T, n_threads_batch=T)``
  (f16 KV cache, no flash attention); the prompt in one ``eval``, then one ``eval`` per token; the
  argmax over the last logits (``llama_get_logits``).
* ``openvino`` (openvino-genai): ``LLMPipeline(DIR, "CPU", INFERENCE_NUM_THREADS=T)`` on token ids,
  ``generate(..., max_new_tokens=M, ignore_eos=True, do_sample=False)``; prefill = its time to first
  token, decode = its mean time per output token × (M − 1) (``perf_metrics``).
* ``ortgenai`` (onnxruntime-genai): ``Model(Config(DIR))`` with ``intra_op_num_threads=T`` overlaid on
  the folder's ``genai_config.json``; ``append_tokens(prompt)`` then ``generate_next_token()`` until M
  tokens (greedy: ``do_sample=False``; the cache at least a sliding window long: Gemma 3's attention
  refuses a shorter one).

:func:`serve` is the loop; a test can serve a fake runtime through it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Runtime(Protocol):
    def load(self, model: str, threads: int, max_length: int) -> dict[str, Any]: ...

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]: ...


class LlamaCpp:
    def load(self, model: str, threads: int, max_length: int) -> dict[str, Any]:
        import llama_cpp
        import numpy as np

        self.np = np
        self.llm = llama_cpp.Llama(
            model_path=model, n_ctx=max_length, n_batch=512, n_threads=threads, n_threads_batch=threads,
            logits_all=False, verbose=False,
        )  # fmt: skip
        self.vocab = self.llm.n_vocab()
        return {"runtime": f"llama-cpp-python {llama_cpp.__version__}", "vocab_size": self.vocab}

    def _next(self) -> int:
        logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))
        return int(logits.argmax())

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        token = self._next()
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([token])
            token = self._next()
        return prefill, time.perf_counter() - t


class OpenVINOGenAI:
    def load(self, model: str, threads: int, max_length: int) -> dict[str, Any]:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        self.np, self.ov = np, ov
        self.pipe = ov_genai.LLMPipeline(model, "CPU", INFERENCE_NUM_THREADS=threads)
        vocab = None
        config = Path(model) / "config.json"
        if config.is_file():
            vocab = json.loads(config.read_text()).get("vocab_size")
        return {"runtime": f"openvino-genai {ov_genai.__version__}", "vocab_size": vocab}

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        ids = self.ov.Tensor(self.np.asarray([prompt], dtype=self.np.int64))
        res = self.pipe.generate(ids, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False)
        got = len(res.tokens[0])
        if got != new_tokens:
            raise RuntimeError(f"asked for {new_tokens} new tokens, OpenVINO GenAI gave {got}")
        pm = res.perf_metrics
        return pm.get_ttft().mean / 1000, pm.get_tpot().mean * (new_tokens - 1) / 1000


class ORTGenAI:
    def load(self, model: str, threads: int, max_length: int) -> dict[str, Any]:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(model)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        cfg = json.loads((Path(model) / "genai_config.json").read_text())["model"]
        # Gemma 3's sliding-window layers refuse a cache shorter than their window
        self.min_cache = (cfg["decoder"].get("sliding_window") or {}).get("window_size", 0)
        vocab = cfg.get("vocab_size")
        return {"runtime": f"onnxruntime-genai {og.__version__}", "vocab_size": vocab}

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        og = self.og
        params = og.GeneratorParams(self.model)
        total = len(prompt) + new_tokens  # min_length: no end-of-sequence token stops it early
        params.set_search_options(max_length=max(total, self.min_cache), min_length=total, do_sample=False)
        gen = og.Generator(self.model, params)
        t = time.perf_counter()
        gen.append_tokens([prompt])  # runs the prompt: the logits of its last position
        gen.generate_next_token()  # picks the first new token (and, if it must, runs the model)
        gen.get_next_tokens()
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(new_tokens - 1):
            gen.generate_next_token()
            gen.get_next_tokens()
        decode = time.perf_counter() - t
        if gen.token_count() < len(prompt) + new_tokens - 1:
            raise RuntimeError(f"ONNX Runtime GenAI stopped after {gen.token_count() - len(prompt)} new tokens")
        return prefill, decode


RUNTIMES: dict[str, type] = {"llamacpp": LlamaCpp, "openvino": OpenVINOGenAI, "ortgenai": ORTGenAI}


def serve(
    runtime: Runtime, info: Callable[[str], tuple[str, int | None]] | None = None, stdin=None, reply=None
) -> None:
    """Answer requests (module docstring) from ``stdin`` until ``quit`` or end of input; ``info(path)``
    gives a loaded model's precision and weight bytes for the load reply."""
    stdin = stdin or sys.stdin
    reply = reply or _reply
    loaded = False
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                return
            if cmd == "load":
                out = runtime.load(str(req["model"]), int(req["threads"]), int(req["max_length"]))
                if info is not None:
                    out["precision"], out["weight_bytes"] = info(str(req["model"]))
                loaded = True
            elif cmd == "run":
                if not loaded:
                    raise RuntimeError("no model loaded")
                prompt, new = [int(t) for t in req["prompt"]], int(req["new_tokens"])
                prefill, decode = runtime.run(prompt, new)
                out = {"prefill_seconds": prefill, "decode_seconds": decode, "new_tokens": new}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            reply({"ok": True, **out})
        except Exception as e:  # a reply, not a crash: the parent turns it into a row note or a gml error
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})


_OUT = None


def _reply(obj: dict[str, Any]) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def _protocol_stdout():
    """Keep the real stdout for replies and point fd 1 (and ``sys.stdout``) at stderr, so that nothing a
    peer prints — from Python or C — lands in the protocol stream."""
    global _OUT
    sys.stdout.flush()
    _OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def main(argv: list[str]) -> None:
    if len(argv) != 1 or argv[0] not in RUNTIMES:
        raise SystemExit(f"usage: llm_worker.py {{{','.join(RUNTIMES)}}}")
    _protocol_stdout()
    spec = importlib.util.spec_from_file_location("gml_llm_files", Path(__file__).with_name("llm_files.py"))
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    serve(RUNTIMES[argv[0]](), info=lambda path: files.model_info(argv[0], path))


if __name__ == "__main__":
    # run as a script: its own folder (gml/bench) must not shadow top-level modules of the peer's venv
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    main(sys.argv[1:])
