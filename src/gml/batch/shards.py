"""Shards: how ``gml run`` writes its outputs so that a killed run resumes without losing or
repeating an input.

The inputs (sorted ids, :mod:`gml.data`) are cut into shards of ``shard_size`` consecutive items.
Shard ``k``'s outputs go to ``OUTPUT.parts/part-0000k.{parquet,npz}``, written whole to a temporary
name in the same directory, fsynced, then renamed (``os.replace`` is atomic on POSIX): a shard file
either exists complete or not at all. ``OUTPUT.parts/plan.json`` records what the shards cut
(item count, shard size, a hash of the ids and of the model file), so a restart over other inputs
or another model is refused instead of mixing outputs. A restarted run skips the shards that exist,
and when every shard exists they are merged, again through a temporary file and a rename, into
``OUTPUT``; the parts directory is removed last. Killed at any point, a rerun finishes the job with
every input written exactly once.

Formats: Parquet (``pyarrow``; columns ``id`` and ``output`` — ``output_0``, ``output_1``, ... for
several outputs — each row's values flattened, their shape in the schema metadata ``gml.shapes``)
or numpy (``OUTPUT`` = output 0 stacked ``(N, ...)``, ``OUTPUT.ids.npy`` the ids in the same order,
``OUTPUT.output1.npy``... for more outputs; shards are ``.npz`` archives of ``.npy`` arrays).
Inputs that could not be read are listed with the reason in ``OUTPUT.skipped.json``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from gml.errors import GMLError

FORMATS = ("parquet", "npy")


def has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def output_format(path: str) -> str:
    low = path.lower()
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".npy"):
        return "npy"
    raise GMLError(
        f"--output {path}: the name must end in .parquet or .npy (the format written).",
        hint=f"e.g. --output {os.path.splitext(path)[0]}.parquet",
    )


@dataclass
class ShardResult:
    """What one shard holds: the ids and outputs of the items read, and the items skipped."""

    ids: list[str] = field(default_factory=list)
    outputs: list[list[np.ndarray]] = field(default_factory=list)  # per output: one array per item
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (id, why)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class ShardStore:
    """The shard files of one output (module docstring)."""

    def __init__(self, output: str, fmt: str, ids: list[str], shard_size: int, model_sha: str) -> None:
        if fmt not in FORMATS:
            raise GMLError(f"unknown output format {fmt!r}.", hint=f"use one of {', '.join(FORMATS)}.")
        if shard_size < 1:
            raise GMLError(f"--shard-size {shard_size} is not positive.")
        self.output = output
        self.fmt = fmt
        self.ids = ids
        self.shard_size = shard_size
        self.parts = output + ".parts"
        self.plan = {
            "items": len(ids),
            "shard_size": shard_size,
            "ids_sha": _sha("\n".join(ids).encode()),
            "model_sha": model_sha,
            "format": fmt,
        }
        self.ext = "parquet" if fmt == "parquet" else "npz"

    @property
    def n_shards(self) -> int:
        return (len(self.ids) + self.shard_size - 1) // self.shard_size

    def shard_items(self, k: int) -> range:
        return range(k * self.shard_size, min(len(self.ids), (k + 1) * self.shard_size))

    def shard_path(self, k: int) -> str:
        return os.path.join(self.parts, f"part-{k:05d}.{self.ext}")

    def prepare(self) -> list[int]:
        """Create or check the parts directory; remove temporaries of a killed run; the shards to do."""
        plan_path = os.path.join(self.parts, "plan.json")
        if os.path.isdir(self.parts):
            try:
                with open(plan_path) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                old = None
            if old != self.plan:
                what = [k for k in self.plan if old is None or old.get(k) != self.plan[k]]
                raise GMLError(
                    f"{self.parts} holds an interrupted run of another job (it differs in: {', '.join(what)}); "
                    "resuming it would mix outputs.",
                    hint=f"delete {self.parts} to start over, or write to another --output.",
                )
            for tmp in glob.glob(os.path.join(self.parts, ".tmp-*")):
                os.remove(tmp)
        else:
            os.makedirs(self.parts)
            _atomic_write(plan_path, json.dumps(self.plan, indent=1).encode())
        return [k for k in range(self.n_shards) if not os.path.exists(self.shard_path(k))]

    def write(self, k: int, shard: ShardResult) -> None:
        """Write shard ``k`` atomically (temporary file, fsync, rename)."""
        tmp = os.path.join(self.parts, f".tmp-{os.getpid()}-{k:05d}.{self.ext}")
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(_table(shard), tmp)
        else:
            arrays = {"ids": np.array(shard.ids, dtype=str)}
            for j, outs in enumerate(shard.outputs):
                arrays[f"output{j}"] = np.stack(outs) if outs else np.zeros((0,), np.float32)
            arrays["skipped_ids"] = np.array([s[0] for s in shard.skipped], dtype=str)
            arrays["skipped_why"] = np.array([s[1] for s in shard.skipped], dtype=str)
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        _fsync(tmp)
        os.replace(tmp, self.shard_path(k))

    def merge(self) -> tuple[int, list[tuple[str, str]]]:
        """Merge every shard into ``output`` (+ the skipped list); ``(items written, skipped)``."""
        skipped: list[tuple[str, str]] = []
        written = 0
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            tables = []
            for k in range(self.n_shards):
                t = pq.read_table(self.shard_path(k))
                skipped += [tuple(s) for s in json.loads((t.schema.metadata or {}).get(b"gml.skipped", b"[]"))]
                tables.append(t.replace_schema_metadata(None) if t.num_rows == 0 else t)
            full = [t for t in tables if t.num_rows] or tables[:1]
            table = pa.concat_tables(full, promote_options="default") if full else pa.table({"id": []})
            meta = next((t.schema.metadata for t in tables if t.num_rows), None) or {}
            table = table.replace_schema_metadata({k: v for k, v in meta.items() if k != b"gml.skipped"})
            written = table.num_rows
            tmp = os.path.join(self.parts, ".tmp-merged.parquet")
            pq.write_table(table, tmp)
            _fsync(tmp)
            os.replace(tmp, self.output)
        else:
            ids: list[np.ndarray] = []
            outs: dict[int, list[np.ndarray]] = {}
            for k in range(self.n_shards):
                with np.load(self.shard_path(k), allow_pickle=False) as z:
                    ids.append(z["ids"])
                    for name in z.files:
                        if name.startswith("output") and len(z["ids"]):
                            outs.setdefault(int(name[6:]), []).append(z[name])
                    skipped += list(zip(z["skipped_ids"].tolist(), z["skipped_why"].tolist()))
            all_ids = np.concatenate(ids) if ids else np.array([], dtype=str)
            written = len(all_ids)
            base = self.output[: -len(".npy")]
            targets = {self.output: np.concatenate(outs[0]) if 0 in outs else np.zeros((0,), np.float32)}
            for j in sorted(outs):
                if j:
                    targets[f"{base}.output{j}.npy"] = np.concatenate(outs[j])
            targets[f"{base}.ids.npy"] = all_ids
            for path, array in targets.items():  # all written before any is renamed into place
                tmp = os.path.join(self.parts, f".tmp-merged-{os.path.basename(path)}")
                with open(tmp, "wb") as f:
                    np.save(f, array, allow_pickle=False)
                _fsync(tmp)
            for path in targets:
                os.replace(os.path.join(self.parts, f".tmp-merged-{os.path.basename(path)}"), path)
        report = self.output + ".skipped.json"
        if skipped:
            _atomic_write(report, json.dumps([{"id": i, "error": why} for i, why in skipped], indent=1).encode())
        elif os.path.exists(report):
            os.remove(report)
        shutil.rmtree(self.parts)
        return written, skipped


def _table(shard: ShardResult):  # -> pyarrow.Table
    import pyarrow as pa

    columns: dict[str, object] = {"id": pa.array(shard.ids, pa.string())}
    shapes = []
    names = ["output"] if len(shard.outputs) == 1 else [f"output_{j}" for j in range(len(shard.outputs))]
    for name, outs in zip(names, shard.outputs):
        if outs:
            stacked = np.stack(outs)
            shapes.append(list(stacked.shape[1:]))
            flat = stacked.reshape(len(outs), -1)
            values = pa.array(flat.reshape(-1))
            columns[name] = pa.FixedSizeListArray.from_arrays(values, flat.shape[1])
    meta = {b"gml.skipped": json.dumps(shard.skipped).encode()}
    if shapes:
        meta[b"gml.shapes"] = json.dumps(dict(zip(names, shapes))).encode()
    if len(columns) == 1 and shard.outputs:  # nothing read in this shard: no output columns
        columns = {"id": pa.array([], pa.string())}
    return pa.table(columns).replace_schema_metadata(meta)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
