"""``gml.llm(source, weights=..., max_length=...)``: a decoder-only causal LM on GML's KV cache.

``source`` is a Hugging Face ``*ForCausalLM`` module, a local HF folder (read offline, no remote
code) or a llama.cpp ``.gguf`` file (:mod:`gml.llm.gguf`). :func:`llm` captures it
(:mod:`gml.llm.spec`), stores its matrices as ``weights`` and returns an :class:`LLM` with
``generate`` / ``stream`` / ``logits``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gml.errors import InputError, ModelLoadError, UnsupportedError
from gml.ir.llm_ops import INT4_GROUP_SIZES, INT8_GROUP_SIZES
from gml.kernels.woq import KERNEL_ISAS, detect_kernel, native_kernel_runs
from gml.llm.decode import DecodeStep, native_glue
from gml.llm.gguf import is_gguf_source, load_gguf, load_gguf_tokenizer
from gml.llm.model import KV_DTYPES, Decoder, KVCache, MatrixFormat, default_activations
from gml.llm.sampling import Sampling, next_token
from gml.llm.spec import capture_lm

WEIGHTS = ("fp32", "bf16", "int8", "int4")


def default_kv_cache(weights: str) -> str:
    """The KV cache type when none is asked for: fp32 for fp32 weights (the exact model), else fp16 —
    half the bytes a long-context decode step reads, and an error far below the weights': on
    Gemma-3-270M (INT8 weights, 1,536 positions) mean KL 4.5e-7 against an fp32 cache, vs 2.4e-5 for
    bf16 and ~4e-4 for the INT8 weights themselves (docs/llm.md, "Long contexts")."""
    return "fp32" if weights == "fp32" else "fp16"


ACTIVATIONS = ("fp32", "int8")


@dataclass
class GenerationStats:
    """Timings of the last ``generate`` / ``stream`` call (wall clock)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first one (which comes out of the prefill) per second of decoding."""
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def _load_folder(path: str) -> nn.Module:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(
            f"{path!r} is not a Hugging Face model folder (no config.json)",
            "give a folder saved by save_pretrained (config.json + weights) or a *ForCausalLM module",
        )
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is a dependency of the dev install
        raise ModelLoadError("reading a model folder needs transformers", "pip install transformers") from e
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, dtype=torch.float32, attn_implementation="eager"
        )
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(
            f"could not load {path!r} as a causal LM: {str(e).splitlines()[0]}",
            "give a local folder of a decoder-only *ForCausalLM model (no remote code)",
        ) from e


def load_tokenizer(path: str):
    """The folder's (or GGUF file's) tokenizer, or ``None`` when it has none (token ids still work)."""
    if is_gguf_source(path):
        return load_gguf_tokenizer(path)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, ImportError, TypeError):
        return None


class LLM:
    """A captured decoder LM. Use :func:`gml.llm` to build one."""

    def __init__(
        self, decoder: Decoder, max_length: int, kv_dtype: torch.dtype, tokenizer=None, prefill_chunk: int = 256
    ) -> None:
        self.decoder = decoder
        # A prompt runs through the model in chunks of this many positions (llama.cpp's n_batch): the
        # attention scores of a chunk are [kv_heads, groups * chunk, context] instead of the whole
        # prompt's square, and the MLP's activations a chunk's rows. Measured (benchmarks/llm_memory.py,
        # TinyLlama-shaped, 2,032-token prompt): the unchunked prefill's peak was 1.6-1.9x the weights + KV.
        self.prefill_chunk = prefill_chunk
        self.spec = decoder.spec
        self.max_length = max_length
        self.kv_dtype = kv_dtype
        self.tokenizer = tokenizer
        self.stats = GenerationStats()
        self._cache: KVCache | None = None
        self._step: DecodeStep | None = None  # the decode step bound to self._cache (gml.llm.decode)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"LLM({s.family}, layers={s.num_layers}, hidden={s.hidden_size}, heads={s.num_heads}/{s.num_kv_heads}, "
            f"weights={self.decoder.weights}, lm_head={self.decoder.lm_head_weights}, "
            f"embedding={self.decoder.embed_weights}, max_length={self.max_length})"
        )

    # ------------------------------------------------------------------ inputs
    def _ids(self, input_ids, *, batch_one: bool) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2) or ids.numel() == 0:
            raise InputError(
                f"input_ids must be a non-empty 1-D or [batch, length] integer sequence, got {ids.dtype} "
                f"of shape {tuple(ids.shape)}",
                "pass token ids, e.g. [1, 2, 3] or a LongTensor [1, L]",
            )
        ids = ids.long().reshape(-1, ids.shape[-1])
        if batch_one and ids.shape[0] != 1:
            raise InputError(
                f"generate/stream take one prompt (batch 1), got {ids.shape[0]}",
                "call generate once per prompt",
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})",
                "tokenize with this model's tokenizer",
            )
        if ids.shape[1] > self.max_length:
            raise InputError(
                f"the prompt has {ids.shape[1]} tokens, more than max_length={self.max_length}",
                f"shorten the prompt or build the LLM with gml.llm(..., max_length>={ids.shape[1]})",
            )
        return ids

    def _fresh_cache(self, batch: int) -> KVCache:
        c = self._cache
        if c is None or c.batch != batch:
            c = self._cache = KVCache(self.spec, batch, self.max_length, self.kv_dtype)
        c.length = 0
        return c

    # ------------------------------------------------------------------ API
    def logits(self, input_ids) -> torch.Tensor:
        """Teacher-forced fp32 logits of every position: ``[L, V]`` for 1-D ids, ``[B, L, V]`` for 2-D."""
        ids = self._ids(input_ids, batch_one=False)
        cache = self._fresh_cache(ids.shape[0])
        c = self.prefill_chunk
        out = torch.cat(
            [self.decoder.forward(ids[:, s : s + c], cache, last_only=False) for s in range(0, ids.shape[1], c)], 1
        )
        return out[0] if torch.as_tensor(input_ids).dim() == 1 else out

    def _prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The prompt, chunk by chunk (see ``prefill_chunk``): the last position's logits ``[B, 1, V]``."""
        c = self.prefill_chunk
        for s in range(0, ids.shape[1], c):
            logits = self.decoder.forward(ids[:, s : s + c], cache, last_only=True)
        return logits

    def stream(
        self,
        input_ids,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> Iterator[int]:
        """Yield new token ids one at a time (a stop token is yielded, then the stream ends)."""
        ids = self._ids(input_ids, batch_one=True)
        sampling = Sampling(temperature, top_k, top_p, seed)
        reason = sampling.check()
        if reason is not None:
            raise InputError(reason, "fix the sampling arguments")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "ask for at least one token")
        if ids.shape[1] + max_new_tokens > self.max_length:
            raise InputError(
                f"{ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} exceed max_length={self.max_length}",
                f"ask for <= {self.max_length - ids.shape[1]} new tokens or build the LLM with a larger max_length",
            )
        return self._stream(ids, max_new_tokens, sampling, frozenset(int(t) for t in stop_tokens))

    def _stream(self, ids: torch.Tensor, max_new: int, sampling: Sampling, stops: frozenset[int]) -> Iterator[int]:
        gen = sampling.generator()
        cache = self._fresh_cache(1)
        self.stats = stats = GenerationStats(prompt_tokens=ids.shape[1])
        t0 = time.perf_counter()
        logits = self._prefill(ids, cache)
        token = next_token(logits[:, -1], sampling, gen)
        stats.prefill_seconds = time.perf_counter() - t0
        stats.new_tokens = 1
        yield int(token)
        if int(token) in stops:
            return
        for _ in range(max_new - 1):
            t0 = time.perf_counter()
            logits = self._decode(token[:, None], cache)
            token = next_token(logits[:, -1], sampling, gen)
            stats.decode_seconds += time.perf_counter() - t0
            stats.new_tokens += 1
            yield int(token)
            if int(token) in stops:
                return

    def _decode(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step (``token: [1, 1]``) → logits ``[1, 1, V]``: :class:`DecodeStep` (preallocated
        buffers, native glue; its logits are overwritten by the next step) when the engine has it, else
        ``Decoder.forward``."""
        step = self._step
        if step is None or not step.fits(cache):
            engine = native_glue() if cache.batch == 1 else None
            step = self._step = None if engine is None else DecodeStep(self.decoder, cache, engine)
        if step is None:
            return self.decoder.forward(token, cache, last_only=True)
        return step(token)

    def generate(self, input_ids, max_new_tokens: int = 32, **kwargs) -> list[int]:
        """The new token ids (not the prompt); keyword arguments as :meth:`stream`."""
        return list(self.stream(input_ids, max_new_tokens, **kwargs))

    def weight_bytes(self) -> int:
        return self.decoder.weight_bytes()

    def save(self, path: str | os.PathLike) -> Path:
        """Write this LLM to ``path`` (weights as stored, no pickle: :mod:`gml.llm.store`); read it back
        with ``gml.load(path)`` or ``gml.llm(path)`` on any CPU. Returns the path written."""
        from gml.llm.store import save_llm

        return save_llm(self, path)


def _saved_llm(path: str):
    """The sealed archive when ``path`` is a file ``lm.save`` wrote, else ``None`` (a folder, a model
    file of another kind: those are the capture's business)."""
    from gml import archive
    from gml.llm.store import is_llm_file

    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        if f.read(2) != b"PK":  # not a zip archive (a .gguf, a safetensors file)
            return None
    sealed = archive.open_sealed(Path(path))
    return sealed if is_llm_file(sealed) else None


def load_llm(
    path: str | os.PathLike,
    *,
    max_length: int | None = None,
    kv_cache: str | None = None,
    kernel: str = "auto",
    activations: str | None = None,
    sealed=None,
    target=None,
) -> LLM:
    """An :class:`LLM` from a file ``lm.save`` wrote (:mod:`gml.llm.store` reads and checks it).

    ``max_length`` / ``kv_cache`` default to the saved ones; ``kernel`` and ``activations`` as
    :func:`llm`; with ``kernel="auto"`` a ``target`` (:class:`~gml.ir.target.Target`) given by the
    caller picks the kernel (``gml.load(path, target=...)``), else this process's CPU."""
    from gml import archive
    from gml.kernels.woq import kernel_isa
    from gml.llm.store import read_llm

    p = Path(path)
    if sealed is None:
        if not p.is_file():
            raise ModelLoadError(f"no such file: {p}", hint="give the file lm.save(path) wrote")
        sealed = archive.open_sealed(p)
    if kernel == "auto" and target is not None and detect_kernel() is not None:
        kernel = kernel_isa(target)  # the caller's CPU description, not this process's
    decoder, max_length, kv_cache = read_llm(
        p, sealed, max_length=max_length, kv_cache=kv_cache, kernel=choose_kernel(kernel), activations=activations
    )
    return LLM(decoder, max_length, KV_DTYPES[kv_cache])


def choose_kernel(kernel: str) -> str | None:
    """The woq kernel ISA for the ``kernel=`` argument (``None``: the op's Python reference kernel)."""
    if kernel not in ("auto", "reference", *KERNEL_ISAS):
        raise InputError(f"kernel={kernel!r} is not one of auto, reference, {', '.join(KERNEL_ISAS)}", "use auto")
    chosen = detect_kernel() if kernel == "auto" else (None if kernel == "reference" else kernel)
    if chosen is not None and not native_kernel_runs(chosen):
        raise UnsupportedError(f"this CPU (or engine build) cannot run the {chosen!r} woq kernel", "use kernel='auto'")
    return chosen


def _check_group(label: str, in_features: int, group_size: int | None) -> None:
    if group_size is not None and in_features % group_size:
        raise UnsupportedError(
            f"{label}: {in_features} input features are not a multiple of group_size={group_size}",
            "pick a group_size that divides the hidden and intermediate sizes "
            "(with weights='int8', group_size=None: per output channel, any size)",
        )


def llm(
    source: nn.Module | str | os.PathLike,
    *,
    weights: str | None = None,
    max_length: int | None = None,
    group_size: int | None = 32,
    symmetric: bool = True,
    kv_cache: str | None = None,
    lm_head_weights: str | None = None,
    embed_weights: str | None = None,
    kernel: str = "auto",
    activations: str | None = None,
) -> LLM:
    """Capture a decoder-only causal LM for generation on CPU.

    ``source``: a HF ``*ForCausalLM`` module, a local HF folder, or a file ``lm.save`` wrote (its
    weights are used as stored: ``weights`` / ``group_size`` / ``symmetric`` / ``lm_head_weights``
    must then be left out or match it).

    ``weights``: ``fp32`` (default) | ``bf16`` | ``int8`` (symmetric) | ``int4`` (``symmetric`` or with
    zero points). ``group_size``: INT8 and INT4 weights have a scale per group of ``group_size``
    input features, 32 (default: llama.cpp's Q8_0 / Q4_0 block; measured on Gemma-3-270M, docs/llm.md),
    64 or 128; ``None`` keeps INT8 per output channel (INT4 needs a group). ``lm_head_weights`` defaults to
    ``weights`` (``int8`` when ``weights="int4"``, as llama.cpp's Q4_0 keeps its head 8-bit);
    ``embed_weights`` (the embedding table, quantized a row per token; only the rows
    looked up are expanded) defaults to the LM head's format when the model ties the two — one
    tensor then serves both — else to ``weights``. ``kv_cache``: ``fp32`` | ``bf16`` | ``fp16`` (default:
    ``fp32`` for fp32 weights, else ``fp16``: :func:`default_kv_cache`).
    ``max_length`` (default 2048; a saved file's own) bounds prompt + new tokens; the KV cache is
    preallocated to it. ``kernel`` runs the int8 / int4 matrices: ``auto`` (the native kernel for
    this CPU, :func:`gml.kernels.woq.detect_kernel`; it honours ``ONEDNN_MAX_CPU_ISA``), ``vnni`` |
    ``avx512`` | ``avxvnni`` | ``avx2`` | ``scalar`` (that native kernel) or ``reference`` (the op's
    Python kernel). ``activations``: ``fp32`` or ``int8`` (int8 / int4 weights only: decode steps
    quantize the activations per block of 32 and run integer dot products, as llama.cpp's Q8_0;
    prefill stays fp32); default :func:`~gml.llm.model.default_activations` — ``int8`` for int4
    weights, ``fp32`` otherwise (measured, docs/llm.md); a run-time choice, also for a saved file.
    """
    if activations is not None and activations not in ACTIVATIONS:
        raise InputError(f"activations={activations!r} is not one of {ACTIVATIONS}", "use fp32 or int8")
    if isinstance(source, (str, os.PathLike)):
        saved = _saved_llm(os.fspath(source))
        if saved is not None:
            lm = load_llm(
                source, max_length=max_length, kv_cache=kv_cache, kernel=kernel, activations=activations, sealed=saved
            )
            asked = {"weights": weights, "lm_head_weights": lm_head_weights, "embed_weights": embed_weights}
            held = {
                "weights": lm.decoder.weights,
                "lm_head_weights": lm.decoder.lm_head_weights,
                "embed_weights": lm.decoder.embed_weights,
            }
            for name, value in asked.items():
                if value is not None and value != held[name]:
                    raise InputError(
                        f"{source} holds {name}={held[name]!r}; gml.llm cannot requantize a saved LLM to {value!r}",
                        f"leave {name} out, or build the LLM from its original model with {name}={value!r}",
                    )
            return lm
    weights = weights or "fp32"
    kv_cache = kv_cache or default_kv_cache(weights)
    max_length = 2048 if max_length is None else max_length
    if weights not in WEIGHTS:
        raise InputError(f"weights={weights!r} is not one of {WEIGHTS}", f"pick one of {', '.join(WEIGHTS)}")
    for name, value in (("lm_head_weights", lm_head_weights), ("embed_weights", embed_weights)):
        if value is not None and value not in WEIGHTS:
            raise InputError(f"{name}={value!r} is not one of {WEIGHTS}", f"pick one of {', '.join(WEIGHTS)}")
    if kv_cache not in KV_DTYPES:
        raise InputError(f"kv_cache={kv_cache!r} is not one of {tuple(KV_DTYPES)}", f"use {' or '.join(KV_DTYPES)}")
    if "int4" in (weights, lm_head_weights, embed_weights) and group_size not in INT4_GROUP_SIZES:
        raise InputError(
            f"group_size={group_size} is not one of {INT4_GROUP_SIZES} (int4 weights are group-wise)",
            "use 32, 64 or 128",
        )
    if group_size is not None and group_size not in INT8_GROUP_SIZES:
        raise InputError(
            f"group_size={group_size} is not one of {INT8_GROUP_SIZES}",
            "use 32, 64 or 128 (or group_size=None: int8 weights per output channel)",
        )
    chosen = choose_kernel(kernel)
    if max_length < 1:
        raise InputError(f"max_length must be >= 1, got {max_length}", "give the longest prompt + new tokens")
    tokenizer = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if is_gguf_source(path):  # token ids (load_tokenizer(path) rebuilds the GGUF's tokenizer: slow)
            model = load_gguf(path)
        else:
            model = _load_folder(path)
            tokenizer = load_tokenizer(path)
    elif isinstance(source, nn.Module):
        model = source
    else:
        raise ModelLoadError(
            f"gml.llm takes a *ForCausalLM module, a model folder or a .gguf file, not {type(source).__name__}",
            "pass the module or the folder's / file's path",
        )
    captured = capture_lm(model, max_length)
    if captured.spec.max_positions is not None and max_length > captured.spec.max_positions:
        raise UnsupportedError(
            f"max_length={max_length} exceeds this model's {captured.spec.max_positions} learned positions",
            f"use max_length <= {captured.spec.max_positions}",
        )
    groups = {"int4": group_size, "int8": group_size}  # int8 with group_size=None: per output channel
    for i, layer in enumerate(captured.layers):
        for name in ("qkv", "o", "up", "down"):
            _check_group(f"layer {i} {name}", getattr(layer, name).weight.shape[1], groups.get(weights))
    _check_group("lm_head", captured.lm_head.weight.shape[1], groups.get(lm_head_weights or weights))
    _check_group("embedding table", captured.embed.shape[1], groups.get(embed_weights or "fp32"))
    fmt = MatrixFormat(weights, group_size, symmetric, chosen, activations or default_activations(weights))
    decoder = Decoder.build(captured, fmt, lm_head_weights=lm_head_weights, embed_weights=embed_weights)
    return LLM(decoder, max_length, KV_DTYPES[kv_cache], tokenizer)
