"""``gml bench SOURCE --llm``: a decoder LLM's prefill and decode tokens/s on GML against HF eager and the
peers (llama.cpp, OpenVINO GenAI, ONNX Runtime GenAI), in one interleaved run, next to the machine's
bandwidth ceiling.

Batch-1 decoding reads every weight once per token, so its physical limit is
``tokens/s <= read bandwidth / (weight bytes + KV-cache bytes read per token)``. The read bandwidth is
measured here (the best of a few passes of ``sum`` over 1 GiB); each row says what fraction of its own
ceiling it reaches.

Rows: ``HF eager fp32`` (its own KV cache, ``generate``; when SOURCE is a HF model), ``GML <w>`` for
each of ``weights`` (a saved LLM file: the weights it holds), and a row per peer model given
(:mod:`gml.bench.llm_peers`: each peer in its own worker process, named by the precision its files
state); a peer that is not installed or has no model is listed with why it did not run and how to make
it run. Every row gets one untimed warm-up call, then rounds are interleaved (every row once per round,
rows in a seeded random order, a fresh random prompt per round shared by all rows: no runtime can reuse
the previous round's cache) and each row keeps its best round: compare ratios from one run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gml.bench.llm_peers import PEERS, PeerError, PeerRequest, PeerRow, check_requests, start_peers
from gml.errors import InputError
from gml.llm.model import default_activations

#: Random-weight models by name (nothing is downloaded): TinyLlama-1.1B's shapes.
RANDOM_LLMS = {
    "tinyllama": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
    ),
}  # fmt: skip


@dataclass
class LLMRow:
    name: str
    weight_bytes: int | None
    kv_bytes_per_token: int | None
    prefill: float = 0.0  # best tokens/s over the rounds
    decode: float = 0.0
    note: str = ""


@dataclass
class LLMBench:
    cpu: str
    read_gbs: float
    prompt_tokens: int
    new_tokens: int
    rounds: int
    rows: list[LLMRow] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # peer, why it did not run

    def ceiling(self, row: LLMRow) -> float | None:
        """Decode tokens/s the read bandwidth allows for ``row`` at the benchmark's mean context length."""
        if not row.weight_bytes:
            return None
        context = self.prompt_tokens + self.new_tokens / 2
        per_token = row.weight_bytes + (row.kv_bytes_per_token or 0) * context
        return self.read_gbs * 1e9 / per_token

    def markdown(self) -> str:
        lines = [
            f"CPU: {self.cpu}; read bandwidth {self.read_gbs:.1f} GB/s; batch 1, prompt {self.prompt_tokens} "
            f"tokens, {self.new_tokens} new tokens, best of {self.rounds} interleaved rounds",
            "",
            "| runtime | weight MB read per token | prefill tok/s | decode tok/s | ceiling tok/s | % of ceiling |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            c = self.ceiling(r)
            mb = f"{r.weight_bytes / 1e6:.0f}" if r.weight_bytes else "-"
            ceiling = f"{c:.2f}" if c else "-"
            pct = f"{100 * r.decode / c:.0f}%" if c and r.decode else "-"
            prefill, decode = (f"{r.prefill:.1f}", f"{r.decode:.2f}") if r.decode else ("-", "-")
            name = r.name + (f" ({r.note})" if r.note else "")
            lines.append(f"| {name} | {mb} | {prefill} | {decode} | {ceiling} | {pct} |")
        for peer, why in self.skipped:
            lines.append(f"\nnot run: {peer} — {why}")
        return "\n".join(lines)


def read_bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Best read GB/s of ``sum`` over a ``gib`` GiB fp32 buffer."""
    n = int(gib * (1 << 30)) // 4
    a = torch.ones(n)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = max(best, 4 * n / (time.perf_counter() - t) / 1e9)
    return best


def random_llm(name: str):
    """The random-weight HF Llama ``name`` of :data:`RANDOM_LLMS` (seed 0, HF's initialization, eager
    attention): the same weights on every call, so benchmarks/ can hand them to other runtimes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**RANDOM_LLMS[name])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _hf_module(source: str):
    """The HF module of ``source`` (a random-weight name, a HF folder, a .gguf) or ``None`` (a saved LLM)."""
    if source in RANDOM_LLMS:
        return random_llm(source)
    from gml.llm.api import _load_folder, _saved_llm

    if _saved_llm(source) is not None:
        return None
    if Path(source).is_dir():
        return _load_folder(source)
    from gml.llm.gguf import is_gguf_source, load_gguf

    if is_gguf_source(source):
        return load_gguf(source)
    raise InputError(
        f"gml bench --llm cannot read {source!r}",
        "give a local Hugging Face folder, a .gguf file, a file lm.save wrote, or a random-weight model: "
        + ", ".join(RANDOM_LLMS),
    )


def _hf_weight_bytes(model) -> int:
    """Bytes of the matrices HF reads per decode step: every 2-D parameter (counted once) but the
    embedding tables, which are gathered a row at a time (a table tied to the LM head is read whole)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    tables.discard(id(head.weight) if head is not None else None)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2 and id(p) not in tables)


def _time_hf(model, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    with torch.no_grad():
        t = time.perf_counter()
        model(prompt, use_cache=True)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    # generate = one prefill + (new - 1) decode steps
    return prompt.shape[1] / prefill, (new - 1) / max(total - prefill, 1e-9)


def _time_gml(lm, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    lm.generate(prompt, new)
    s = lm.stats
    return s.prefill_tokens_per_second, s.decode_tokens_per_second


def _kv_elements_per_token(lm) -> int:
    s = lm.spec
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim


def _kv_bytes_per_token(lm) -> int:
    return _kv_elements_per_token(lm) * torch.tensor([], dtype=lm.kv_dtype).element_size()


def bench_llm(
    source: str,
    *,
    weights: list[str],
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    rounds: int = 3,
    seed: int = 0,
    threads: int | None = None,
    kernel: str = "auto",
    activations: tuple[str, ...] = ("default",),
    peers: list[PeerRequest] | None = None,
    progress: Callable[[str], None] | None = None,
) -> LLMBench:
    """Time ``source`` and the ``peers``' models (see the module docstring) and return the table's rows.
    ``peers``: one request per peer runtime (default: each in this interpreter, no model: listed as not run)."""
    if new_tokens < 2:
        raise InputError(f"--new-tokens must be >= 2 to time decoding, got {new_tokens}", "use --new-tokens 32")
    peers = [PeerRequest(kind) for kind in PEERS] if peers is None else peers
    check_requests(peers)  # a bad path is an error before anything is built
    if threads:  # for this call only (a caller's process keeps its own setting)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return bench_llm(
                source, weights=weights, prompt_tokens=prompt_tokens, new_tokens=new_tokens, rounds=rounds,
                seed=seed, kernel=kernel, activations=activations, peers=peers, progress=progress,
            )  # fmt: skip
        finally:
            torch.set_num_threads(before)
    say = progress or (lambda _msg: None)
    peer_rows: list[PeerRow] = []
    try:
        return _bench(
            source, weights, prompt_tokens, new_tokens, rounds, seed, kernel, activations, peers, peer_rows, say
        )
    finally:
        for p in peer_rows:
            p.worker.close()


def _bench(source, weights, prompt_tokens, new_tokens, rounds, seed, kernel, activations, peers, peer_rows, say):
    import gml
    from gml.bench.roofline import cpu_name
    from gml.runtime.target import resolve

    threads = torch.get_num_threads()
    cpu = f"{cpu_name()} (oneDNN ISA {resolve(None).isa}), {threads} thread(s)"
    say("measuring the read bandwidth")
    read = read_bandwidth_gbs()
    max_length = prompt_tokens + new_tokens
    hf = _hf_module(source)
    runs: dict[str, Callable[[list[int]], tuple[float, float]]] = {}
    rows: dict[str, LLMRow] = {}
    lms = {}
    def acts_of(w: str) -> list[str]:
        """The activations to time for weights ``w`` ("default": gml.llm's own choice for them); int8
        activations apply to int8 / int4 weights only (decode steps; prefill stays fp32)."""
        if w not in ("int8", "int4"):
            return ["fp32"]
        return list(dict.fromkeys(default_activations(w) if a == "default" else a for a in activations))

    if hf is None:  # a saved LLM: the weights it holds
        base = gml.llm(source, max_length=max_length, kernel=kernel, activations="fp32")
        w = base.decoder.weights
        for act in acts_of(w):
            name = f"GML {w}" + (", int8 activations" if act == "int8" else "")
            again = act != "fp32"
            lms[name] = gml.llm(source, max_length=max_length, kernel=kernel, activations=act) if again else base
    else:
        for w in weights:
            for act in acts_of(w):
                name = f"GML {w}" + (", int8 activations" if act == "int8" else "")
                say(f"building {name}")
                lms[name] = gml.llm(hf, weights=w, max_length=max_length, kernel=kernel, activations=act)
    first = next(iter(lms.values()))
    vocab = first.spec.vocab_size
    if hf is not None:
        rows["HF eager fp32"] = LLMRow("HF eager fp32", _hf_weight_bytes(hf), _kv_bytes_per_token(first))
        runs["HF eager fp32"] = lambda ids: _time_hf(hf, torch.tensor([ids]), new_tokens)
    for name, lm in lms.items():
        rows[name] = LLMRow(name, lm.weight_bytes(), _kv_bytes_per_token(lm))
        runs[name] = lambda ids, lm=lm: _time_gml(lm, torch.tensor([ids]), new_tokens)
    loaded, failed, skipped = start_peers(peers, threads, max_length, say)
    peer_rows.extend(loaded)
    kv_elems = _kv_elements_per_token(first)  # the same model: GML's shapes, the peer's cache type
    for p in loaded:
        rows[p.name] = LLMRow(p.name, p.weight_bytes, kv_elems * p.kv_bytes, note=p.note)
        if p.vocab_size and p.vocab_size != vocab:
            rows[p.name].note += f"; vocabulary {p.vocab_size}, GML's {vocab}: not the same model?"
            vocab = min(vocab, p.vocab_size)
        runs[p.name] = lambda ids, p=p: p.run(ids, new_tokens)
    for name, why in failed:
        rows[name] = LLMRow(name, None, None, note=why)
    gen = torch.Generator().manual_seed(seed)

    def prompt() -> list[int]:
        return torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()

    for r in range(rounds + 1):  # round 0: one untimed call each (first-call allocations, plan builds)
        ids = prompt()
        order = list(runs)
        random.Random(seed + r).shuffle(order)
        for name in order:
            say(f"round {r}/{rounds}: {name}" if r else f"warm-up: {name}")
            try:
                p, d = runs[name](ids)
            except PeerError as e:
                rows[name].note = f"failed in {'round ' + str(r) if r else 'its warm-up'}: {e}"
                del runs[name]
                continue
            if r:
                row = rows[name]
                row.prefill, row.decode = max(row.prefill, p), max(row.decode, d)
    return LLMBench(cpu, read, prompt_tokens, new_tokens, rounds, list(rows.values()), skipped)
