"""Seal and check the files :mod:`gml.io` writes — before anything in them is unpickled.

A saved model is a zip archive (``torch.export.save`` or ``torch.save`` writes it). Two different
threats need two different checks, and neither replaces the other:

* **Damage** (a truncated download, a flipped bit): :func:`seal` appends a manifest member
  (``gml-manifest.json``) holding the SHA-256 and size of every other member; :func:`open_sealed`
  recomputes them and refuses the file on any difference, on a member the manifest does not list, on
  a listed member that is missing, and on a zip that does not parse. Zip's own CRC-32 protects the
  manifest itself.
* **A hostile author** can write a consistent manifest, so digests prove nothing about safety. For
  the ``torch.export`` format, :func:`check_export_members` therefore admits only what GML's own
  save writes, member by member: JSON, raw tensor bytes, an *empty* sample-inputs member (GML strips
  the example inputs, which torch would otherwise pickle), and payload configs in which no entry asks
  for pickle. Every road inside ``torch.export.load`` that unpickles (``use_pickle`` weights and
  constants, torchbind and opaque objects, the legacy constants file, sample inputs, which torch
  retries with ``weights_only=False``) starts at a member this check refuses.

Pickled files (``format="pickle"``) are sealed the same way against damage, but only a caller who
opted in (``trust_pickle=True``) gets past :func:`gml.io.load`'s refusal to unpickle them.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.export.pt2_archive import constants as pt2

from gml.errors import ModelLoadError

MANIFEST = "gml-manifest.json"
_CHUNK = 1 << 20
#: What zipfile raises on a damaged archive (NotImplementedError: a flipped "version needed" field;
#: RuntimeError: a flipped "encrypted" flag bit, "password required for extraction"; ValueError
#: includes json.JSONDecodeError and zipfile's bad-offset variants).
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    ValueError,
    UnicodeDecodeError,
    NotImplementedError,
    KeyError,
    RecursionError,
    RuntimeError,
)


def _digest(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    h = hashlib.sha256()
    with z.open(info) as f:  # zipfile checks the member's CRC-32 as it reads
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _prefix(names: list[str]) -> str:
    """The archive's top-level folder (``torch.save`` and ``torch.export.save`` put every member in one)."""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) != 1 or not all("/" in n for n in names):
        raise ModelLoadError("the archive's members are not in one top-level folder, as torch writes them")
    return tops.pop() + "/"


def seal(path: Path, header: dict[str, Any]) -> None:
    """Append the manifest: ``header`` plus the SHA-256 and size of every member already in ``path``."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        prefix = _prefix([i.filename for i in infos])
        members = {i.filename[len(prefix) :]: {"sha256": _digest(z, i), "size": i.file_size} for i in infos}
    manifest = {**header, "members": members}
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(prefix + MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


@dataclass(frozen=True)
class Sealed:
    """A sealed archive whose every member matched its digest: the manifest's header and members."""

    path: Path
    prefix: str
    header: dict[str, Any]
    members: frozenset[str]


def _damaged(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is damaged: {what}; nothing in it was loaded",
        hint="the file was truncated or altered after gml.io.save wrote it: copy or write it again",
    )


def open_sealed(path: Path) -> Sealed | None:
    """Check ``path`` against its manifest; ``None`` for a readable zip that has no manifest.

    Raises :class:`ModelLoadError` for a file that is not a zip, a zip that does not parse (truncated),
    and any member that differs from, is missing from, or is not listed in the manifest.
    """
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from e
    if head[:2] != b"PK":
        raise ModelLoadError(
            f"{path} is not a model file written by gml.io.save (not a zip archive)",
            hint="gml.io.load reads the .pt2 files gml.io.save and `gml optimize --out` write",
        )
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                raise _damaged(path, "a member name appears twice")
            prefix = _prefix(names)
            if prefix + MANIFEST not in names:
                return None
            if z.getinfo(prefix + MANIFEST).file_size > MAX_JSON_BYTES:
                raise _damaged(path, "its manifest is larger than any gml.io.save writes")
            manifest = json.loads(z.read(prefix + MANIFEST))
            listed = manifest.get("members") if isinstance(manifest, dict) else None
            if not isinstance(listed, dict):
                raise _damaged(path, "its manifest has no member list")
            present = {n[len(prefix) :] for n in names} - {MANIFEST}
            if present != set(listed):
                extra, missing = sorted(present - set(listed)), sorted(set(listed) - present)
                raise _damaged(path, f"members not in its manifest {extra[:3]}, missing members {missing[:3]}")
            for info in infos:
                rel = info.filename[len(prefix) :]
                if rel == MANIFEST:
                    continue
                want = listed[rel]
                if not isinstance(want, dict) or info.file_size != want.get("size") or _digest(z, info) != want.get(
                    "sha256"
                ):
                    raise _damaged(path, f"member {rel!r} does not match its recorded digest")
    except ModelLoadError:
        raise
    except ZIP_ERRORS as e:
        if "CRC-32" in str(e):  # zipfile's own check of a member's bytes
            raise _damaged(path, f"a member fails its CRC-32 check ({e})") from e
        raise _damaged(path, f"the zip archive does not parse ({type(e).__name__}: {e})") from e
    header = {k: v for k, v in manifest.items() if k != "members"}
    return Sealed(path, prefix, header, frozenset(listed))


# --------------------------------------------------------------------------------------------------
# What a torch.export archive written by gml.io.save may contain
# --------------------------------------------------------------------------------------------------

_MODEL = "model"


def _export_patterns() -> list[re.Pattern[str]]:
    esc = re.escape
    return [
        re.compile(esc(p))
        for p in (
            pt2.ARCHIVE_FORMAT_PATH,
            pt2.ARCHIVE_VERSION_PATH,
            ".data/version",
            ".data/serialization_id",
            "byteorder",
            pt2.MODELS_FILENAME_FORMAT.format(_MODEL),
            pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(_MODEL),
            pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(_MODEL),
            pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(_MODEL),
        )
    ] + [
        re.compile(esc(pt2.WEIGHTS_DIR + pt2.WEIGHT_FILENAME_PREFIX) + r"\d+"),
        re.compile(esc(pt2.CONSTANTS_DIR + pt2.TENSOR_CONSTANT_FILENAME_PREFIX) + r"\d+"),
    ]


def _refused(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} was refused: {what}; gml never unpickles a saved model without trust_pickle=True",
        hint="gml.io.save never writes such a member: the file was not written by gml, or was altered on purpose",
    )


#: Bound on a JSON member's declared size: a model.json of a large GML model is a few MB.
MAX_JSON_BYTES = 256 << 20
_PAYLOADS = (
    (pt2.WEIGHTS_CONFIG_FILENAME_FORMAT, pt2.WEIGHTS_DIR),
    (pt2.CONSTANTS_CONFIG_FILENAME_FORMAT, pt2.CONSTANTS_DIR),
)


def _read_json(z: zipfile.ZipFile, sealed: Sealed, rel: str) -> Any:
    info = z.getinfo(sealed.prefix + rel)
    if info.file_size > MAX_JSON_BYTES:
        raise _refused(sealed.path, f"{rel} declares {info.file_size} bytes")
    try:
        return json.loads(z.read(info))
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
        raise _refused(sealed.path, f"{rel} is not JSON ({type(e).__name__})") from None


def check_export_members(sealed: Sealed) -> None:
    """Refuse a ``torch.export`` archive holding a member GML's save never writes, or anything
    ``torch.export.load`` would unpickle."""
    patterns = _export_patterns()
    for rel in sorted(sealed.members):
        if not any(p.fullmatch(rel) for p in patterns):
            raise _refused(sealed.path, f"unexpected member {rel!r}")
    with zipfile.ZipFile(sealed.path) as z:
        if z.getinfo(sealed.prefix + pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(_MODEL)).file_size:
            raise _refused(sealed.path, "it carries pickled sample inputs")


def read_export_program(sealed: Sealed) -> tuple[Any, Any]:
    """The exported program of a sealed ``torch.export`` archive, checked field by field
    (:mod:`gml.program_check`) before torch builds anything from it (a refused field raises
    :class:`ModelLoadError` naming it), and the :class:`gml.memory.MappedFile` its weights are views of."""
    from gml import program_check

    check_export_members(sealed)
    with zipfile.ZipFile(sealed.path) as z:
        program = _read_json(z, sealed, pt2.MODELS_FILENAME_FORMAT.format(_MODEL))
        configs = []
        for config, directory in _PAYLOADS:
            sizes = {
                i.filename[len(sealed.prefix + directory) :]: i.file_size
                for i in z.infolist()
                if i.filename.startswith(sealed.prefix + directory) and not i.filename.endswith(".json")
            }
            name = config.format(_MODEL)
            configs.append(_read_json(z, sealed, name))
            program_check.check_payloads(configs[-1], sizes, name)
    program_check.check_program(program)
    program_check.check_state_matches_graph(program, configs)
    return _deserialize(sealed, program_check.sanitized(program), configs)


def _deserialize(sealed: Sealed, program: dict[str, Any], configs: list[Any]) -> tuple[Any, Any]:
    """torch.export's own deserializer, given the checked program and the tensors of the checked
    payload configs (weights, then constants) over a mapping of the file (:class:`gml.memory.MappedFile`):
    a weight costs resident memory only once read, and the engine's load hands those pages back."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

    from gml.memory import MappedFile

    mapped = MappedFile(sealed.path)
    with zipfile.ZipFile(sealed.path) as z, open(sealed.path, "rb") as f:
        state_dict, constants = (
            _payload_tensors(z, f, sealed.prefix + directory, config, mapped)
            for config, (_, directory) in zip(configs, _PAYLOADS, strict=True)
        )
    artifact = _dict_to_dataclass(schema.ExportedProgram, program)
    return ExportedProgramDeserializer().deserialize(artifact, state_dict, constants, None), mapped


def _payload_tensors(z: zipfile.ZipFile, f: Any, directory: str, config: Any, mapped: Any) -> dict[str, Any]:
    """Each entry of a payload config (checked: plain tensors inside their members,
    :func:`gml.program_check.check_payloads`) as a strided view of its member's bytes: over the
    file mapping where the member is stored uncompressed at an aligned offset (as torch's writer
    stores it), else over a copy of its bytes."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    flat: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for fqn, entry in config["config"].items():
        meta = entry["tensor_meta"]
        dtype = _SERIALIZE_TO_TORCH_DTYPE[meta["dtype"]]
        name = entry["path_name"]
        if name not in flat:
            info = z.getinfo(directory + name)
            itemsize = torch.empty(0, dtype=dtype).element_size()
            offset = _stored_offset(f, info)
            if offset is not None and offset % itemsize == 0 and info.file_size % itemsize == 0:
                flat[name] = mapped.tensor(offset, info.file_size // itemsize, dtype)
            else:
                data = bytearray(z.read(info))
                flat[name] = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        sizes = [s["as_int"] for s in meta["sizes"]]
        strides = [s["as_int"] for s in meta["strides"]]
        base = flat[name]  # as_strided's offset counts from the start of the storage, not of ``base``
        t = torch.as_strided(base, sizes, strides, base.storage_offset() + meta["storage_offset"]["as_int"])
        out[fqn] = torch.nn.Parameter(t, requires_grad=meta["requires_grad"]) if entry["is_param"] else t
    return out


def _stored_offset(f: Any, info: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed member's bytes start in the archive (after its local header); None for a
    compressed member. The local header is the one zipfile read (and the manifest's digest covered)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def looks_pickled(path: Path) -> bool:
    """A zip written by ``torch.save`` (its object graph is a pickle, ``data.pkl``)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/data.pkl") for n in z.namelist())
    except ZIP_ERRORS:
        return False


__all__ = [
    "MANIFEST",
    "ZIP_ERRORS",
    "Sealed",
    "check_export_members",
    "looks_pickled",
    "open_sealed",
    "read_export_program",
    "seal",
]
