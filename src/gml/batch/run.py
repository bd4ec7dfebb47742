"""``gml run``: batch inference of a saved model over a folder / file of inputs.

The job: load ``SAVED.pt2`` (:func:`gml.io.load`: the engine's plan rebuilt for this CPU), open
the inputs with the same readers as calibration (:func:`gml.data.open_data`, in the lenient mode
where an unreadable input is an item to skip, not a reason to stop), cut them into shards
(:mod:`gml.batch.shards`), and for every shard not yet written: read its items, stack them into
batches of ``batch_size``, run the model, write the shard atomically. In process by default;
``ray_address`` runs the same items on Ray Data (:mod:`gml.batch.on_ray`), each actor loading the
``.pt2`` itself. Either way the shards, the resume and the merge are the same code.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gml.batch.items import ItemsResult, infer_items, infer_samples, read_items  # noqa: F401
from gml.batch.shards import ShardResult, ShardStore, file_sha, has_pyarrow, output_format
from gml.errors import GMLError, InputError


@dataclass
class RunReport:
    output: str
    fmt: str
    items: int
    written: int
    skipped: list[tuple[str, str]]
    shards: int
    shards_done_before: int
    seconds: float
    runner: str
    source: str
    notes: list[str] = field(default_factory=list)
    #: seconds from the start of the run to the first results (Ray: actors starting, loading the model)
    first_result_s: float | None = None

    @property
    def items_per_s(self) -> float:
        return (self.written + len(self.skipped)) / self.seconds if self.seconds else float("nan")


def load_saved(path: str, engine: bool = True) -> tuple[Any, tuple[torch.Tensor, ...], list[bool]]:
    """``(model on the engine, example inputs, per-input "has a dynamic non-batch dim")``;
    ``engine=False``: the graph on the Python executor (the Ray driver only needs its input shapes)."""
    from gml.io import attach_loaded_runtime, is_saved_model, load, placeholder_inputs

    if not is_saved_model(path):
        raise GMLError(
            f"{path} is not a model saved by gml.",
            hint="save one first: gml quantize MODEL --out model.pt2 (or gml optimize MODEL --out model.pt2).",
        )
    gm = load(path, runtime="torch", graph=True)
    example = placeholder_inputs(gm)
    dynamic = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            shape = getattr(val, "shape", ())
            dynamic.append(any(not isinstance(d, int) for d in list(shape)[1:]))
    return (attach_loaded_runtime(gm, "engine") if engine else gm), example, dynamic


def run_batch(
    saved: str,
    input_path: str,
    output: str,
    *,
    batch_size: int = 8,
    shard_size: int = 256,
    options: Any = None,
    preprocess_model: str | None = None,
    ray_address: str | None = None,
    ray_cpus: int | None = None,
    progress: bool = True,
    console: Any = None,
) -> RunReport:
    """Run ``saved`` over every input in ``input_path`` into ``output`` (module docstring).

    ``ray_address``: ``None`` runs in this process; ``""`` starts a local Ray (``ray_cpus`` CPUs,
    default all) and ``"host:port"`` / ``"auto"`` joins a cluster. ``preprocess_model``: a
    torchvision name or ``timm:NAME`` whose image preprocessing to use (a ``.pt2`` does not record it).
    """
    import time

    from gml.data.loader import DataOptions, open_data

    if batch_size < 1:
        raise GMLError(f"--batch-size {batch_size} is not positive.", hint="e.g. --batch-size 8")
    fmt = output_format(output)
    notes = []
    if fmt == "parquet" and not has_pyarrow():
        fallback = output[: -len(".parquet")] + ".npy"
        notes.append(f"pyarrow is not installed: writing {fallback} (numpy) instead of Parquet")
        output, fmt = fallback, "npy"
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise GMLError(f"--output {output}: the directory {parent} does not exist.", hint=f"mkdir -p {parent}")
    if os.path.exists(output) and not os.path.isdir(output + ".parts"):
        raise GMLError(
            f"--output {output} exists (a finished run).", hint="delete it to run again, or choose another --output."
        )
    options = options or DataOptions()
    model, example, dynamic = load_saved(saved, engine=ray_address is None)  # Ray: each actor loads its own
    if options.seq_len is None and any(dynamic) and not example[0].is_floating_point():
        from gml.models_hf import DEFAULT_SEQ

        options = DataOptions(image=options.image, tokenizer=options.tokenizer, seq_len=DEFAULT_SEQ)
        notes.append(f"the saved model takes any sequence length: lines are padded to {DEFAULT_SEQ} (--seq-len)")
    pre_model = None
    if preprocess_model and preprocess_model.startswith("timm:"):
        from gml.models import load_model

        pre_model = load_model(preprocess_model)
    source = open_data(input_path, example, model=pre_model, spec=preprocess_model, options=options, strict=False)
    ids = [source.item_id(i) for i in range(len(source))]
    if len(set(ids)) != len(ids):
        raise InputError(f"{input_path}: two inputs have the same id.", hint="give each input a distinct file name.")
    store = ShardStore(output, fmt, ids, shard_size, file_sha(saved))
    todo = store.prepare()
    done_before = store.n_shards - len(todo)
    t0 = time.perf_counter()
    if ray_address is None:
        results = _local(model, source, store, todo, batch_size)
        runner = f"in process, {torch.get_num_threads()} threads"
    else:
        from gml.batch.on_ray import run_on_ray

        results, runner = run_on_ray(saved, source, store, todo, batch_size, ray_address, ray_cpus)
    first = _collect(results, store, todo, progress, console)
    seconds = time.perf_counter() - t0
    written, skipped = store.merge()
    return RunReport(
        output, fmt, len(ids), written, skipped, store.n_shards, done_before, seconds, runner, source.describe(), notes,
        first_result_s=None if first is None else first - t0,
    )  # fmt: skip


def _local(model: Any, source: Any, store: ShardStore, todo: list[int], batch_size: int) -> Iterator[ItemsResult]:
    """Shard by shard; a thread reads (decodes, preprocesses) the next shard while the model runs
    on this one (torch and torchvision's decoders release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gml-read") as pool:
        ahead = pool.submit(read_items, source, list(store.shard_items(todo[0]))) if todo else None
        for n in range(len(todo)):
            samples = ahead.result()  # type: ignore[union-attr]
            if n + 1 < len(todo):
                ahead = pool.submit(read_items, source, list(store.shard_items(todo[n + 1])))
            yield infer_samples(model, samples, batch_size)


def _collect(
    results: Iterable[ItemsResult], store: ShardStore, todo: list[int], progress: bool, console: Any
) -> float | None:
    """Gather results by shard and write each shard, its items in input order, as soon as all its
    items are in (Ray returns them in any order); the ``perf_counter`` time of the first results."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    done: dict[int, list[tuple[int, list[np.ndarray]]]] = {k: [] for k in todo}
    bad: dict[int, list[tuple[int, str]]] = {k: [] for k in todo}
    remaining = {k: len(store.shard_items(k)) for k in todo}
    total = len(store.ids)
    columns = [TextColumn("gml run"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    bar = Progress(*columns, console=console, transient=True, disable=not progress)
    first = None
    with bar:
        task = bar.add_task("run", total=total, completed=total - sum(remaining.values()))
        for res in results:
            first = first if first is not None else time.perf_counter()
            touched = set()
            for i, outs in zip(res.indices, res.outputs):
                done[i // store.shard_size].append((i, outs))
            for i, why in res.skipped:
                bad[i // store.shard_size].append((i, why))
            for i in [*res.indices, *(i for i, _ in res.skipped)]:
                remaining[i // store.shard_size] -= 1
                touched.add(i // store.shard_size)
            bar.advance(task, len(res.indices) + len(res.skipped))
            for k in sorted(touched):
                if remaining[k] == 0:
                    items = sorted(done.pop(k), key=lambda t: t[0])
                    shard = ShardResult(
                        ids=[store.ids[i] for i, _ in items],
                        outputs=[list(col) for col in zip(*(outs for _, outs in items))],
                        skipped=[(store.ids[i], why) for i, why in sorted(bad.pop(k))],
                    )
                    store.write(k, shard)
                    del remaining[k]
    if remaining:
        raise GMLError(f"{len(remaining)} shard(s) got no results; rerun to finish them.")
    return first
