"""``gml run --ray``: the same job on Ray Data (``pip install 'gml-lab[ray]'``).

The items of the shards still to do become a Ray dataset of indices; ``map_batches`` runs
:class:`GMLPredictor` actors over it, one per CPU: each actor calls :func:`gml.io.load` on the
``.pt2`` itself — the engine's plan is rebuilt for that actor's CPU — runs one torch thread, and
reads its items with a copy of the driver's reader. Results stream back to the driver, which
writes the shards exactly as the in-process run does (:mod:`gml.batch.shards`): resume and merge
are the same. On a cluster the ``.pt2`` and the inputs must be readable at the same paths from
every node (a shared file system), as with ``ray.data.read_images``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from gml.batch.items import ItemsResult, infer_items
from gml.batch.shards import ShardStore
from gml.errors import GMLError


class GMLPredictor:
    """A Ray Data actor: one GML model, loaded from the ``.pt2`` on the actor's own machine."""

    def __init__(self, saved: str, source: Any, batch_size: int, threads: int = 1) -> None:
        import torch

        from gml.io import load

        torch.set_num_threads(threads)
        self.model = load(saved)  # the engine's plan, built for this actor's CPU
        self.source = source
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows in, rows out: ``index``, ``error`` (empty when read) and ``result`` (the item's
        outputs as an ``.npz`` archive's bytes: one schema whatever the model returns, no pickle)."""
        res = infer_items(self.model, self.source, batch["index"].tolist(), self.batch_size)
        index, error, result = [], [], []
        for i, outs in zip(res.indices, res.outputs):
            buf = io.BytesIO()
            np.savez(buf, *outs)
            index.append(i), error.append(""), result.append(buf.getvalue())
        for i, why in res.skipped:
            index.append(i), error.append(why), result.append(b"")
        return {
            "index": np.array(index, np.int64),
            "error": np.array(error, dtype=object),
            "result": np.array(result, dtype=object),
        }


def _unpack(blob: bytes) -> list[np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return [z[f"arr_{j}"] for j in range(len(z.files))]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise GMLError(
            "--ray needs Ray, which is not installed.", hint="pip install 'gml-lab[ray]' (Ray Data and pyarrow)."
        ) from None
    return ray


def run_on_ray(
    saved: str,
    source: Any,
    store: ShardStore,
    todo: list[int],
    batch_size: int,
    address: str,
    cpus: int | None = None,
) -> tuple[Iterator[ItemsResult], str]:
    """``(results stream, description)`` of the items of shards ``todo`` run on Ray Data."""
    ray = _ray()
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(num_cpus=cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    import logging

    # gml run draws its own progress bar and summary: Ray Data's bars and per-dataset INFO lines off
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
    indices = [i for k in todo for i in store.shard_items(k)]
    where = f"Ray at {address}" if address else "a local Ray"
    desc = f"{where}: {actors} GMLPredictor actor(s), 1 CPU and 1 thread each"
    if not indices:
        return iter(()), desc
    ds = ray.data.from_items([{"index": i} for i in indices], override_num_blocks=max(1, len(indices) // batch_size))
    ds = ds.map_batches(
        GMLPredictor,
        fn_constructor_kwargs={"saved": os.path.abspath(saved), "source": source, "batch_size": batch_size},
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=1,
    )

    def stream() -> Iterator[ItemsResult]:
        for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
            res = ItemsResult()
            for i, why, blob in zip(b["index"].tolist(), b["error"].tolist(), b["result"].tolist()):
                if why:
                    res.skipped.append((i, str(why)))
                else:
                    res.indices.append(i)
                    res.outputs.append(_unpack(blob))
            yield res

    return stream(), desc
