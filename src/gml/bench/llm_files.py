"""What a peer's model files say: the weights' precision and the bytes a decode step reads.

Imports only the standard library (``onnx`` when it is there), never ``gml``: the peer workers
(:mod:`gml.bench.llm_worker`) load this file by path in the peer's own interpreter.

Bytes read per decode step are counted as ``gml.llm`` counts its own (``lm.weight_bytes()``): every
weight tensor, its scales included, except an embedding table that is only gathered (a row per token;
a table that is also the LM head is read whole and counts).

* GGUF (llama.cpp): the header's tensor list (``general.file_type`` names the precision, e.g. Q8_0); a
  tensor's bytes are the distance to the next tensor's data offset. ``token_embd.weight`` is left out when
  the file has its own ``output.weight``.
* OpenVINO IR folder: ``openvino_model.xml``'s ``Const`` layers (their ``size``); a constant whose
  every path through decompression ops (Convert, Subtract, Multiply, Reshape, ...) ends in a ``Gather``
  is an embedding table. The precision: the integer type of most compressed matrices, the others named
  (NNCF keeps the LM head of an int4 model in int8: ``int4 (+ 1 int8 matrix)``); a float type by bytes
  when nothing is compressed.
* ONNX Runtime GenAI folder: with ``onnx``, ``model.onnx``'s initializers (shapes × element sizes, the
  data not read), the same rule for ``Gather`` / ``GatherBlockQuantized``; the precision from its
  ``MatMulNBits`` nodes (bits, block size, ``accuracy_level`` 4 = int8 activations). Without ``onnx``:
  unknown.
"""

from __future__ import annotations

import json
import struct
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple


class ModelInfo(NamedTuple):
    precision: str
    weight_bytes: int | None


GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}  # fmt: skip
#: ops a weight passes through on its way to its real consumer (decompression, layout)
_PASS = {"Convert", "Subtract", "Multiply", "Reshape", "Unsqueeze", "Squeeze", "Transpose", "Cast",
         "DequantizeLinear", "Mul", "Sub"}  # fmt: skip
_GATHER = {"Gather", "GatherBlockQuantized"}


def _only_gathered(start: str, consumers: dict[str, list[tuple[str, str]]]) -> bool:
    """Whether every path from value ``start`` through :data:`_PASS` ops ends in a gather."""
    ends, todo, seen = set(), [start], set()
    while todo:
        v = todo.pop()
        for op, out in consumers.get(v, []):
            if op in _PASS and out not in seen:
                seen.add(out)
                todo.append(out)
            elif op not in _PASS:
                ends.add(op)
    return bool(ends) and ends <= _GATHER


# --- GGUF -------------------------------------------------------------------------------------------

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string(self) -> str:
        return self.f.read(self.take("Q")).decode("utf-8", "replace")

    def value(self, t: int):
        if t in _SCALARS:
            return self.take(_SCALARS[t])
        if t == 8:
            return self.string()
        if t == 9:
            inner, n = self.take("I"), self.take("Q")
            if inner in _SCALARS:  # skip without decoding (vocabularies are large)
                self.f.seek(n * struct.calcsize("<" + _SCALARS[inner]), 1)
                return None
            return [self.value(inner) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {t}")


def gguf_info(path: str) -> ModelInfo:
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        r.take("I")  # version
        n_tensors, n_kv = r.take("Q"), r.take("Q")
        kv, align = {}, 32
        for _ in range(n_kv):
            key = r.string()
            kv[key] = r.value(r.take("I"))
        align = int(kv.get("general.alignment", align))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.take("Q") for _ in range(r.take("I"))]
            r.take("I")  # ggml type
            tensors.append((r.take("Q"), name, dims))
        data_start = -(-f.tell() // align) * align
    tensors.sort()
    ends = [off for off, _, _ in tensors[1:]] + [size - data_start]
    nbytes = {name: end - off for (off, name, _), end in zip(tensors, ends)}
    if "output.weight" in nbytes:
        nbytes.pop("token_embd.weight", None)
    ftype = kv.get("general.file_type")
    precision = GGUF_FILE_TYPES.get(ftype, f"file type {ftype}") if ftype is not None else Path(path).stem
    return ModelInfo(precision, sum(nbytes.values()))


# --- OpenVINO IR ------------------------------------------------------------------------------------

_OV_BITS = {"i4": "int4", "u4": "int4", "i8": "int8", "u8": "int8", "f16": "fp16", "bf16": "bf16", "f32": "fp32"}


def openvino_info(folder: str) -> ModelInfo:
    xml = Path(folder) / "openvino_model.xml"
    root = ET.parse(xml).getroot()
    types, consts = {}, {}
    for layer in root.iter("layer"):
        types[layer.get("id")] = layer.get("type")
        data = layer.find("data")
        if layer.get("type") == "Const" and data is not None and data.get("size"):
            consts[layer.get("id")] = (int(data.get("size")), data.get("element_type", "?"))
    consumers: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for e in root.iter("edge"):
        to = e.get("to-layer")
        consumers[e.get("from-layer")].append((types.get(to, "?"), to))
    total, ints, floats = 0, Counter(), Counter()
    for lid, (size, et) in consts.items():
        if not _only_gathered(lid, consumers):
            total += size
            if _OV_BITS.get(et, "").startswith("int"):
                ints[_OV_BITS[et]] += 1  # compressed matrices (their zero points too), counted
            elif et in _OV_BITS:
                floats[_OV_BITS[et]] += size
    if ints:
        (main, _), *rest = ints.most_common()
        precision = main + "".join(f" (+ {n} {bits} matri{'x' if n == 1 else 'ces'})" for bits, n in rest)
    else:
        precision = max(floats, key=floats.get) if floats else "?"
    return ModelInfo(precision, total)


# --- ONNX Runtime GenAI -----------------------------------------------------------------------------


def ortgenai_info(folder: str) -> ModelInfo:
    cfg = json.loads((Path(folder) / "genai_config.json").read_text())
    name = cfg["model"]["decoder"].get("filename", "model.onnx")
    try:
        import onnx
        from onnx import helper
    except ImportError:
        return ModelInfo(Path(folder).name, None)
    model = onnx.load(str(Path(folder) / name), load_external_data=False)
    consumers: dict[str, list[tuple[str, str]]] = defaultdict(list)
    attrs = Counter()
    for node in model.graph.node:
        for i in node.input:
            consumers[i].append((node.op_type, node.output[0] if node.output else ""))
        if node.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            attrs[(a.get("bits"), a.get("block_size"), a.get("accuracy_level", 0))] += 1
    total = 0
    for init in model.graph.initializer:
        if _only_gathered(init.name, consumers):
            continue
        n = 1
        for d in init.dims:
            n *= d
        total += n * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    if attrs:
        bits, block, level = attrs.most_common(1)[0][0]
        precision = f"int{bits} (block {block}" + (
            ", int8 activations)" if level == 4 else f", accuracy level {level})"
        )
    else:
        precision = Path(folder).name
    return ModelInfo(precision, total)


INFO = {"llamacpp": gguf_info, "openvino": openvino_info, "ortgenai": ortgenai_info}


def model_info(kind: str, path: str) -> ModelInfo:
    """The precision and bytes read per decode step of peer ``kind``'s model at ``path`` (unknown bytes:
    ``None``; a file it cannot read: its name and ``None``)."""
    try:
        return INFO[kind](path)
    except (OSError, ValueError, KeyError, ET.ParseError, struct.error):
        return ModelInfo(Path(path).name, None)
