"""``lm.save(path)`` / ``gml.load(path)`` for :class:`~gml.llm.api.LLM`: a file with no code in it.

The file is a zip archive sealed like every file :mod:`gml.io` writes (:mod:`gml.archive`: a manifest
of every member's SHA-256 and size, checked before anything is read). Inside one top-level folder::

    llm.json                 what the model is: format, spec (ModelSpec's fields), intermediate size,
                             storage (weights, lm_head_weights, embed_weights, group_size, symmetric,
                             int8_group_size), max_length, kv_cache, tied LM head, and every
                             tensor's dtype and shape
    tensors/<name>.bin       one tensor's raw little-endian bytes, C order

Nothing is unpickled and no name in the file is looked up as code. The loader treats every field as
hostile: :func:`expected_tensors` derives the *complete* list of tensors (name, dtype, shape) from the
validated spec and storage alone, and the file must hold exactly that list — no other name, no other
dtype, no other shape, each member exactly ``numel * itemsize`` bytes. Shapes are therefore never
taken from the file, so no kernel can be told to read past a buffer. Floating-point tensors must be
finite; int4 zero points must lie in ``[0, 15]``.

The weights are stored in the ``woq_linear`` format (not a CPU's repacked layout): the file is the
same on every CPU, and :func:`gml.llm.api.load_llm` picks this machine's kernel (:mod:`gml.kernels.woq`), as
:func:`gml.llm` does. ``group_size`` is the INT4 matrices' group; ``int8_group_size`` the INT8 ones' (32 /
64 / 128, or ``null``: per output channel). Files written before INT8 had groups lack
``int8_group_size`` and hold INT8 per output channel: they load as such.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from gml import archive
from gml.errors import InputError, ModelLoadError
from gml.files import write_atomically
from gml.ir.llm_ops import INT4_GROUP_SIZES, INT8_GROUP_SIZES, QuantizedWeight, check_format
from gml.llm.model import KV_DTYPES, Decoder, Layer, LinearOp, default_activations
from gml.llm.spec import FAMILIES, LayerWeights, ModelSpec, Norm

FORMAT = "gml-llm-1"  # the manifest's format, which gml.io.load dispatches on
_FOLDER = "gml-llm"
_JSON = "llm.json"
_WEIGHTS = ("fp32", "bf16", "int8", "int4")
_KV = tuple(KV_DTYPES)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "uint8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_ROPE_KEYS = ("full_attention", "sliding_attention")
_NORMS = ("attn_in_norm", "mlp_in_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
_LINEARS = ("qkv", "o", "up", "down")
#: Sizes past these are not a model this loader admits (they bound every allocation the spec implies).
_MAX_DIM = 1 << 24
_MAX_LAYERS = 4096
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------------
# the tensors a valid file holds, derived from its spec
# --------------------------------------------------------------------------------------------------


def _group(meta: dict[str, Any], storage: str, in_f: int) -> int:
    """The group size of a matrix with ``in_f`` input features stored as ``storage`` (int8 | int4)."""
    if storage == "int4":
        return meta["group_size"]
    return meta["int8_group_size"] or in_f  # None: per output channel


def _linear_entries(
    name: str, out_f: int, in_f: int, storage: str, meta: dict[str, Any]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if storage in ("fp32", "bf16"):
        return {f"{name}.weight": (torch.float32 if storage == "fp32" else torch.bfloat16, (out_f, in_f))}
    bits, g = (8 if storage == "int8" else 4), _group(meta, storage, in_f)
    symmetric = meta["symmetric"]
    out = {
        f"{name}.qweight": ((torch.int8, (out_f, in_f)) if bits == 8 else (torch.uint8, (out_f, in_f // 2))),
        f"{name}.scales": (torch.float32, (out_f, in_f // g)),
    }
    if bits == 4 and not symmetric:
        out[f"{name}.zeros"] = (torch.uint8, (out_f, in_f // g))
    return out


def expected_tensors(meta: dict[str, Any], spec: ModelSpec) -> tuple[dict, dict]:
    """``(required, optional)``: name -> ``(dtype, shape)`` of every tensor a file with this validated
    spec and storage holds (``optional``: biases, which a family may or may not have)."""
    h, d, v = spec.hidden_size, spec.head_dim, spec.vocab_size
    inter = meta["intermediate_size"]
    storage, head_storage = meta["weights"], meta["lm_head_weights"]
    fp = torch.float32
    req: dict[str, tuple[torch.dtype, tuple[int, ...]]] = _linear_entries("embed", v, h, meta["embed_weights"], meta)
    opt: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    if spec.learned_positions:
        req["positions"] = (fp, (spec.max_positions, h))
    layer_norm = spec.norm == "layer"

    def norm(name: str, size: int) -> None:
        req[f"{name}.weight"] = (fp, (size,))
        if layer_norm:
            req[f"{name}.bias"] = (fp, (size,))

    norm("final_norm", h)
    shapes = {
        "qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * d, h),
        "o": (h, spec.num_heads * d),
        "up": ((2 if spec.gated_mlp else 1) * inter, h),
        "down": (h, inter),
    }
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        norm(p + "attn_in_norm", h)
        norm(p + "mlp_in_norm", h)
        if spec.qk_norm:
            norm(p + "q_norm", d)
            norm(p + "k_norm", d)
        if spec.sandwich_norms:
            norm(p + "attn_out_norm", h)
            norm(p + "mlp_out_norm", h)
        for name, (o, k) in shapes.items():
            req.update(_linear_entries(p + name, o, k, storage, meta))
            opt[p + name + ".bias"] = (fp, (o,))
    if not meta["tied_lm_head"]:
        req.update(_linear_entries("lm_head", v, h, head_storage, meta))
    opt["lm_head.bias"] = (fp, (v,))
    for key in meta["rope"]:
        req[f"rope.{key}.cos"] = (fp, (meta["rope_length"], spec.rotary_dim))
        req[f"rope.{key}.sin"] = (fp, (meta["rope_length"], spec.rotary_dim))
    return req, opt


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


def _linear_tensors(name: str, op: LinearOp) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if op.qweight is not None:
        out[f"{name}.qweight"] = op.qweight.qweight
        out[f"{name}.scales"] = op.qweight.scales
        if op.qweight.zeros is not None:
            out[f"{name}.zeros"] = op.qweight.zeros
    else:
        out[f"{name}.weight"] = op.weight
    if op.bias is not None:
        out[f"{name}.bias"] = op.bias
    return out


def _norm_tensors(name: str, n: Norm | None) -> dict[str, torch.Tensor]:
    if n is None:
        return {}
    return {f"{name}.weight": n.weight} | ({} if n.bias is None else {f"{name}.bias": n.bias})


def _storage_of(op: LinearOp) -> tuple[str, int | None, bool]:
    """``(storage, group, symmetric)``: group ``None`` for fp32 / bf16 and for an INT8 matrix with one group
    per row (per output channel — or a group of exactly its width: the same tensors either way)."""
    if op.qweight is None:
        return ("bf16" if op.weight.dtype == torch.bfloat16 else "fp32"), None, True
    q = op.qweight
    one_group = q.bits == 8 and q.group_size == q.in_features
    return ("int8" if q.bits == 8 else "int4"), (None if one_group else q.group_size), q.zeros is None


def save_llm(lm: Any, path: str | Path) -> Path:
    """Write ``lm`` (an :class:`~gml.llm.api.LLM`) to ``path`` (see the module docstring)."""
    dec: Decoder = lm.decoder
    spec = dec.spec
    table = dec.embed
    table_op = LinearOp(qweight=table) if isinstance(table, QuantizedWeight) else LinearOp(weight=table)
    tied = dec.lm_head.bias is None and (dec.lm_head.weight is table or dec.lm_head.qweight is table)
    tensors = _linear_tensors("embed", table_op)
    if dec.positions is not None:
        tensors["positions"] = dec.positions
    tensors |= _norm_tensors("final_norm", dec.final_norm)
    groups: dict[str, set[int]] = {"int8": set(), "int4": set()}  # the group(s) of each width
    symmetric = True
    quantized: list[QuantizedWeight] = []

    def note(op: LinearOp) -> str:
        nonlocal symmetric
        storage, g, sym = _storage_of(op)
        if g is not None:
            groups[storage].add(g)
        if op.qweight is not None:
            quantized.append(op.qweight)
        symmetric = sym and symmetric
        return storage

    note(table_op)
    for i, layer in enumerate(dec.layers):
        for n in _NORMS:
            tensors |= _norm_tensors(f"layers.{i}.{n}", getattr(layer.w, n))
        for n in _LINEARS:
            op = getattr(layer, n)
            tensors |= _linear_tensors(f"layers.{i}.{n}", op)
            note(op)
    head_storage = note(dec.lm_head)
    group = next(iter(groups["int4"]), 32)
    int8_group = next(iter(groups["int8"]), None)
    meta_groups = {"group_size": group, "int8_group_size": int8_group}
    if any(q.group_size != _group(meta_groups, f"int{q.bits}", q.in_features) for q in quantized):
        # gml.llm builds one group size per width; a model put together otherwise cannot be described
        raise ValueError(f"lm.save stores one group size per weight width, this model has {groups}")
    if not tied:
        tensors |= _linear_tensors("lm_head", dec.lm_head)
    rope_length = 0
    for key, (cos, sin) in dec.rope.items():
        tensors[f"rope.{key}.cos"], tensors[f"rope.{key}.sin"] = cos, sin
        rope_length = cos.shape[0]
    spec_json = asdict(spec)
    spec_json["sliding_windows"] = list(spec.sliding_windows)
    meta = {
        "format": FORMAT,
        "spec": spec_json,
        "intermediate_size": dec.layers[0].down.in_features if dec.layers else 1,
        "weights": dec.weights,
        "lm_head_weights": head_storage,
        "embed_weights": dec.embed_weights,
        "group_size": group,
        "int8_group_size": int8_group,
        "symmetric": symmetric,
        "tied_lm_head": tied,
        "max_length": lm.max_length,
        "kv_cache": next(name for name, t in KV_DTYPES.items() if t == lm.kv_dtype),
        "rope": sorted(dec.rope),
        "rope_length": rope_length,
        "tensors": {
            name: {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for name, t in sorted(tensors.items())
        },
    }

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr(f"{_FOLDER}/{_JSON}", json.dumps(meta, indent=1))
            for name, t in sorted(tensors.items()):
                raw = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
                with z.open(f"{_FOLDER}/tensors/{name}.bin", "w", force_zip64=True) as f:
                    f.write(memoryview(raw))
        archive.seal(tmp, {"format": FORMAT, "torch": torch.__version__})

    return write_atomically(path, write, what="saved LLM")


# --------------------------------------------------------------------------------------------------
# load: validate every field, then read exactly the tensors the spec implies
# --------------------------------------------------------------------------------------------------


def _bad(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is not a valid GML LLM file: {what}; nothing in it was loaded",
        hint="write the file again with lm.save(path) from this gml version",
    )


def _int(path: Path, name: str, v: Any, lo: int, hi: int = _MAX_DIM) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(path, f"{name} must be an integer in [{lo}, {hi}], got {v!r}"[:300])
    return v


def _float(path: Path, name: str, v: Any, lo: float = 0.0, hi: float = math.inf) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not lo < v < hi:
        raise _bad(path, f"{name} must be a finite number in ({lo}, {hi}), got {v!r}"[:300])
    return float(v)


def _choice(path: Path, name: str, v: Any, allowed: tuple) -> Any:
    if not isinstance(v, str) or v not in allowed:
        raise _bad(path, f"{name} must be one of {allowed}, got {v!r}"[:300])
    return v


def _bool(path: Path, name: str, v: Any) -> bool:
    if type(v) is not bool:
        raise _bad(path, f"{name} must be true or false, got {v!r}"[:300])
    return v


def _spec(path: Path, raw: Any) -> ModelSpec:
    names = [f.name for f in fields(ModelSpec)]
    if not isinstance(raw, dict) or sorted(raw) != sorted(names):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise _bad(path, f"its spec must have exactly the fields {names}, got {got}"[:400])
    r = raw
    layers = _int(path, "num_layers", r["num_layers"], 1, _MAX_LAYERS)
    heads = _int(path, "num_heads", r["num_heads"], 1)
    kv = _int(path, "num_kv_heads", r["num_kv_heads"], 1)
    head_dim = _int(path, "head_dim", r["head_dim"], 1)
    if heads % kv:
        raise _bad(path, f"num_heads {heads} is not a multiple of num_kv_heads {kv}")
    rotary = _int(path, "rotary_dim", r["rotary_dim"], 0, head_dim)
    if rotary % 2:
        raise _bad(path, f"rotary_dim {rotary} is odd")
    learned = _bool(path, "learned_positions", r["learned_positions"])
    max_pos = None if r["max_positions"] is None else _int(path, "max_positions", r["max_positions"], 1)
    if learned != (max_pos is not None):
        raise _bad(path, "learned_positions and max_positions disagree")
    if learned == (rotary > 0):
        raise _bad(path, "a model has either learned positions or RoPE (rotary_dim > 0)")
    windows = r["sliding_windows"]
    if not isinstance(windows, list) or len(windows) != layers:
        raise _bad(path, f"sliding_windows must list one entry per layer ({layers})")
    windows = tuple(None if w is None else _int(path, "a sliding window", w, 1, 1 << 31) for w in windows)
    cap = r["final_logit_softcap"]
    return ModelSpec(
        family=_choice(path, "family", r["family"], tuple(FAMILIES)),
        vocab_size=_int(path, "vocab_size", r["vocab_size"], 1),
        hidden_size=_int(path, "hidden_size", r["hidden_size"], 1),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        norm=_choice(path, "norm", r["norm"], ("rms", "layer")),
        norm_eps=_float(path, "norm_eps", r["norm_eps"], 0.0, 1.0),
        norm_plus_one=_bool(path, "norm_plus_one", r["norm_plus_one"]),
        activation=_choice(path, "activation", r["activation"], ("silu", "gelu", "gelu_tanh", "relu")),
        gated_mlp=_bool(path, "gated_mlp", r["gated_mlp"]),
        attn_scale=_float(path, "attn_scale", r["attn_scale"]),
        embed_scale=_float(path, "embed_scale", r["embed_scale"]),
        rotary_dim=rotary,
        learned_positions=learned,
        qk_norm=_bool(path, "qk_norm", r["qk_norm"]),
        sandwich_norms=_bool(path, "sandwich_norms", r["sandwich_norms"]),
        sliding_windows=windows,
        final_logit_softcap=None if cap is None else _float(path, "final_logit_softcap", cap),
        max_positions=max_pos,
    )


_META_KEYS = (
    "format", "spec", "intermediate_size", "weights", "lm_head_weights", "embed_weights", "group_size", "symmetric",
    "tied_lm_head", "max_length", "kv_cache", "rope", "rope_length", "tensors",
)  # fmt: skip
#: Keys a file may lack: a file written before INT8 had groups holds INT8 per output channel.
_OPTIONAL_META = {"int8_group_size": None}


def _meta(path: Path, raw: Any) -> tuple[dict[str, Any], ModelSpec]:
    if not isinstance(raw, dict) or sorted(set(raw) - set(_OPTIONAL_META)) != sorted(_META_KEYS):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        want = f"{sorted(_META_KEYS)} (and optionally {sorted(_OPTIONAL_META)})"
        raise _bad(path, f"{_JSON} must have exactly the keys {want}, got {got}"[:400])
    raw = _OPTIONAL_META | raw
    if raw["format"] != FORMAT:
        raise _bad(path, f"{_JSON} has format {raw['format']!r}, this gml reads {FORMAT!r}"[:300])
    spec = _spec(path, raw["spec"])
    m = dict(raw)
    m["intermediate_size"] = _int(path, "intermediate_size", raw["intermediate_size"], 1)
    m["weights"] = _choice(path, "weights", raw["weights"], _WEIGHTS)
    m["lm_head_weights"] = _choice(path, "lm_head_weights", raw["lm_head_weights"], _WEIGHTS)
    m["embed_weights"] = _choice(path, "embed_weights", raw["embed_weights"], _WEIGHTS)
    m["group_size"] = _int(path, "group_size", raw["group_size"], 1)
    if raw["int8_group_size"] is not None:
        m["int8_group_size"] = _int(path, "int8_group_size", raw["int8_group_size"], 1)
    m["symmetric"] = _bool(path, "symmetric", raw["symmetric"])
    m["tied_lm_head"] = _bool(path, "tied_lm_head", raw["tied_lm_head"])
    m["kv_cache"] = _choice(path, "kv_cache", raw["kv_cache"], _KV)
    rope = raw["rope"]
    if not isinstance(rope, list) or len(set(map(str, rope))) != len(rope) or not all(k in _ROPE_KEYS for k in rope):
        raise _bad(path, f"rope must list distinct layer types out of {_ROPE_KEYS}"[:300])
    if bool(rope) != (spec.rotary_dim > 0):
        raise _bad(path, "RoPE tables are present exactly when rotary_dim > 0")
    if any(w is not None for w in spec.sliding_windows) and len(rope) > 1 and "sliding_attention" not in rope:
        raise _bad(path, "sliding layers have no RoPE table")  # pragma: no cover - covered by the key rule
    if len(rope) > 1 and "full_attention" not in rope:
        raise _bad(path, "two RoPE tables need one for full_attention")
    m["rope_length"] = _int(path, "rope_length", raw["rope_length"], 0 if not rope else 1)
    positions = spec.max_positions if spec.learned_positions else m["rope_length"]
    m["max_length"] = _int(path, "max_length", raw["max_length"], 1, positions)
    if m["tied_lm_head"] and m["lm_head_weights"] != m["embed_weights"]:
        raise _bad(path, "a tied LM head is the embedding table: lm_head_weights must equal embed_weights")
    storages = (m["weights"], m["lm_head_weights"], m["embed_weights"])
    widths = (("int4", "group_size", INT4_GROUP_SIZES), ("int8", "int8_group_size", INT8_GROUP_SIZES))
    for width, key, allowed in widths:
        if width not in storages or m[key] is None:  # int8_group_size None: per output channel, any width
            continue
        if m[key] not in allowed:
            raise _bad(path, f"{width} {key} {m[key]} is not one of {allowed}")
        # every matrix width (the check is a superset for matrices stored otherwise)
        for what, k in (("hidden_size", spec.hidden_size), ("intermediate_size", m["intermediate_size"])):
            if k % m[key]:
                raise _bad(path, f"{what} {k} is not a multiple of {key} {m[key]}")
        if (spec.num_heads * spec.head_dim) % m[key]:
            raise _bad(path, f"num_heads * head_dim is not a multiple of {key} {m[key]}")
    return m, spec


def _check_tensor_list(path: Path, m: dict[str, Any], spec: ModelSpec, members: frozenset[str]) -> dict:
    """name -> (dtype, shape) of the file's tensors, once they are exactly what the spec implies."""
    required, optional = expected_tensors(m, spec)
    listed = m["tensors"]
    if not isinstance(listed, dict):
        raise _bad(path, "its tensor list is not a mapping")
    names = set(listed)
    missing = sorted(set(required) - names)
    unknown = sorted(names - set(required) - set(optional))
    if missing or unknown:
        raise _bad(path, f"tensors missing {missing[:3]}, unexpected {[n[:80] for n in unknown[:3]]}")
    want = {n: required.get(n) or optional[n] for n in names}
    for name, (dtype, shape) in want.items():
        entry = listed[name]
        if (
            not isinstance(entry, dict)
            or entry.get("dtype") != _DTYPE_NAMES[dtype]
            or entry.get("shape") != list(shape)
            or sorted(entry) != ["dtype", "shape"]
        ):
            want_text = f"{_DTYPE_NAMES[dtype]} {list(shape)}"
            raise _bad(path, f"tensor {name!r} must be {want_text}, the file says {entry!r}"[:300])
    files = {f"tensors/{n}.bin" for n in names} | {_JSON}
    if set(members) != files:
        extra = sorted(set(members) - files)[:3]
        raise _bad(path, f"its members do not match its tensor list (unexpected {[e[:80] for e in extra]})")
    return want


def _read_tensor(path: Path, z: zipfile.ZipFile, prefix: str, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
    info = z.getinfo(f"{prefix}tensors/{name}.bin")
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if info.file_size != nbytes:
        raise _bad(path, f"tensor {name!r} has {info.file_size} bytes, its shape needs {nbytes}")
    if nbytes:
        # straight into the tensor, a chunk at a time: ZipExtFile.readinto would read the whole member
        # into a temporary bytes object first (a second copy of the largest tensor at the peak)
        buf = memoryview(t.view(torch.uint8).reshape(-1).numpy())
        done = 0
        with z.open(info) as f:
            while done < nbytes and (chunk := f.read(min(_CHUNK, nbytes - done))):
                buf[done : done + len(chunk)] = chunk
                done += len(chunk)
        if done != nbytes:  # pragma: no cover - the size was checked against the zip directory
            raise _bad(path, f"tensor {name!r} is short")
    if t.is_floating_point():
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), _CHUNK):  # chunks: no tensor-sized bool temporary
            if not bool(torch.isfinite(flat[i : i + _CHUNK]).all()):
                raise _bad(path, f"tensor {name!r} holds NaN or infinity")
    if name.endswith(".zeros") and int(t.max()) > 15:
        raise _bad(path, f"int4 zero points of {name!r} must lie in [0, 15]")
    return t


def is_llm_file(sealed: archive.Sealed | None) -> bool:
    return sealed is not None and sealed.header.get("format") == FORMAT


def read_llm(
    path: str | Path,
    sealed: archive.Sealed,
    *,
    max_length: int | None = None,
    kv_cache: str | None = None,
    kernel: str | None = None,
    activations: str | None = None,
) -> tuple[Decoder, int, str]:
    """``(decoder, max_length, kv_cache)`` of an LLM file written by :func:`save_llm` whose seal
    ``sealed`` was checked; see the module docstring. :func:`gml.llm.api.load_llm` wraps it.

    ``max_length`` (default: the saved one) may not exceed the positions the file's RoPE / learned
    position tables cover. ``kv_cache`` defaults to the saved one; ``kernel`` is the woq kernel ISA
    chosen for this CPU (``None``: the reference kernel); ``activations`` (``fp32`` | ``int8``; ``None``:
    :func:`~gml.llm.model.default_activations` of the file's weights) as :func:`gml.llm`: a run-time
    choice, not stored.
    """
    path = Path(path)
    if not is_llm_file(sealed):
        raise ModelLoadError(f"{path} is not an LLM file written by lm.save", hint="give the file lm.save(path) wrote")
    chosen = kernel
    with zipfile.ZipFile(path) as z:
        prefix = sealed.prefix
        if z.getinfo(prefix + _JSON).file_size > archive.MAX_JSON_BYTES:
            raise _bad(path, f"{_JSON} is larger than any lm.save writes")
        try:
            raw = json.loads(z.read(prefix + _JSON))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise _bad(path, f"{_JSON} does not parse ({type(e).__name__})") from e
        m, spec = _meta(path, raw)
        want = _check_tensor_list(path, m, spec, sealed.members)
        t = {name: _read_tensor(path, z, prefix, name, dt, shape) for name, (dt, shape) in want.items()}
    limit = spec.max_positions if spec.learned_positions else m["rope_length"]
    if max_length is None:
        max_length = m["max_length"]
    if not isinstance(max_length, int) or not 1 <= max_length <= limit:
        raise InputError(
            f"max_length={max_length!r} is outside what this file's position tables cover [1, {limit}]",
            f"use max_length <= {limit}, or build the LLM again from its source with a larger max_length",
        )
    kv_cache = m["kv_cache"] if kv_cache is None else kv_cache
    activations = activations or default_activations(m["weights"])
    if kv_cache not in _KV:
        raise InputError(f"kv_cache={kv_cache!r} is not one of {_KV}", "use one of " + ", ".join(_KV))

    def linear(name: str, storage: str) -> LinearOp:
        bias = t.get(f"{name}.bias")
        if storage in ("fp32", "bf16"):
            return LinearOp(weight=t[f"{name}.weight"], bias=bias, kernel=chosen, activations=activations)
        q = t[f"{name}.qweight"]
        bits = 8 if storage == "int8" else 4
        k = q.shape[1] * (2 if bits == 4 else 1)
        group = _group(m, storage, k)
        reason = check_format(bits, group, k)
        if reason is not None:  # pragma: no cover - _meta checked the group against every matrix width
            raise _bad(path, f"{name}: {reason}")
        qw = QuantizedWeight(q, t[f"{name}.scales"], t.get(f"{name}.zeros"), bits, group)
        return LinearOp(qweight=qw, bias=bias, kernel=chosen, activations=activations)

    def norm(name: str) -> Norm | None:
        w = t.get(f"{name}.weight")
        return None if w is None else Norm(w, t.get(f"{name}.bias"))

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        norms = {n: norm(p + n) for n in _NORMS}
        lw = LayerWeights(qkv=None, o=None, up=None, down=None, **norms)  # type: ignore[arg-type]
        layers.append(Layer(lw, *(linear(p + n, m["weights"]) for n in _LINEARS)))
    table = linear("embed", m["embed_weights"])
    lm_head = table if m["tied_lm_head"] else linear("lm_head", m["lm_head_weights"])
    rope = {key: (t[f"rope.{key}.cos"], t[f"rope.{key}.sin"]) for key in m["rope"]}
    decoder = Decoder(
        spec,
        embed=table.weight if table.weight is not None else table.qweight,
        positions=t.get("positions"),
        layers=layers,
        final_norm=norm("final_norm"),
        lm_head=lm_head,
        rope=rope,
        weights=m["weights"],
        lm_head_weights=m["lm_head_weights"],
        embed_weights=m["embed_weights"],
    )
    return decoder, max_length, kv_cache
