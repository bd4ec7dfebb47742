"""What a result keeps (issue #28): structure, not RSS. The result of gml.optimize / gml.quantize /
gml.load holds no reference to the caller's model, torch.ao's prepared graph, the calibration
batches or the pass manager's snapshots once the call returns, and no second dense copy (nor the
Python executor's packed copy) of a weight the engine holds reordered; a rollback snapshot shares
the module's tensors instead of copying them."""

from __future__ import annotations

import gc
import json
import weakref
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import gml
from assets.models import SmallCNN
from gml import archive
from gml.bench.memory import reachable_storages
from gml.errors import PassFailure
from gml.memory import module_tensors
from gml.passes import manager
from gml.passes.base import GraphPass, PassResult
from gml.passes.manager import PassManager, Snapshot


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


@pytest.fixture
def snapshots(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to the module of every rollback snapshot the pass manager takes."""
    taken: list[weakref.ref] = []
    init = Snapshot.__init__

    def record(self: Snapshot, gm: fx.GraphModule, **kw: Any) -> None:
        init(self, gm, **kw)
        taken.append(weakref.ref(self.module))

    monkeypatch.setattr(manager.Snapshot, "__init__", record)
    return taken


def _gone(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


# --- snapshots ---------------------------------------------------------------------------------


def test_snapshot_shares_every_tensor_and_copies_the_graph() -> None:
    gm = fx.symbolic_trace(SmallCNN().eval())
    snap = Snapshot(gm)
    ids = {id(t) for t in module_tensors(gm)}
    assert ids and {id(t) for t in module_tensors(snap.module)} == ids  # the very same tensors
    assert snap.module.graph is not gm.graph and snap.module.conv1 is not gm.conv1
    assert snap.written() == 0
    with torch.no_grad():
        gm.conv1.weight.mul_(2)  # what a pass must not do (INVARIANTS.md 11)
    gm.fc.weight.data = torch.zeros_like(gm.fc.weight)
    assert snap.written() == 2
    full = Snapshot(gm, share=False)
    assert not {id(t) for t in module_tensors(full.module)} & ids


class _ReplaceConvWeight(GraphPass):
    """Replaces (never writes) the first conv's weight, as a folding pass does."""

    name = "replace_conv_weight"

    def call(self, gm: fx.GraphModule) -> PassResult:
        gm.conv1.weight = nn.Parameter(gm.conv1.weight.detach() * 1.0, requires_grad=False)
        return PassResult(gm, modified=True)


def test_an_accepted_pass_frees_the_tensor_it_replaced_without_a_garbage_collection() -> None:
    """The snapshot of an accepted pass is emptied at once (gml.memory.release): the weight the
    pass replaced is freed by reference counting, not left to the next full collection."""
    gm = fx.symbolic_trace(SmallCNN().eval())
    old = weakref.ref(gm.conv1.weight)
    kept = gm.fc.weight
    gc.disable()
    try:
        out = PassManager([_ReplaceConvWeight()]).run(gm, [(torch.randn(1, 3, 8, 8),)])
        assert out.report.records[0].status == "applied"
        assert old() is None, "the replaced weight is still reachable (the snapshot holds it)"
    finally:
        gc.enable()
    assert out.graph_module.fc.weight is kept  # the live module's tensors are untouched


def test_release_leaves_the_modules_it_is_told_to_keep() -> None:
    from gml.memory import release, shared_copy

    gm = fx.symbolic_trace(SmallCNN().eval())
    sub = fx.GraphModule(gm, gm.graph)  # shares gm's submodules, as a region's subgraph does
    copy_ = shared_copy(gm)
    release(sub, keep=[gm])
    release(copy_, keep=[gm])
    assert gm.conv1.weight is not None and {id(t) for t in module_tensors(gm)}
    assert not module_tensors(copy_) and not dict(copy_.named_children())


def test_a_timed_region_shares_the_twins_weights_and_is_emptied_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost policy times a region's fp32 side on a copy sharing the float twin's weights (no
    deep copy), and empties every graph it built for that region once it is timed."""
    from gml.quant import cost_policy
    from gml.quant.frontend import prepare_reference

    x = torch.randn(1, 3, 16, 16)
    q = gml.quantize(SmallCNN().eval(), 2, example_inputs=(x,), cost_policy="off", per_layer=False)
    ref = prepare_reference(SmallCNN().eval(), (x,), 2, progress=False)
    twin = _storages(module_tensors(ref.float_module))
    copies: list[fx.GraphModule] = []
    shared = cost_policy.shared_copy

    def recording_copy(module: Any) -> Any:
        out = shared(module)
        copies.append(out)
        return out

    monkeypatch.setattr(cost_policy, "shared_copy", recording_copy)
    cost = cost_policy.MeasuredCost(q.module, ref.float_module, (x,), rounds=1)
    regions = cost_policy.find_regions(q.module, cost.values)
    assert regions
    twin_tensors_before = {id(t) for t in module_tensors(ref.float_module)}
    timed: list[Any] = []
    fp32_fn = cost._fp32_fn

    def spy(region: Any) -> Any:
        fn = fp32_fn(region)
        timed.append(list(cost._scratch))
        dense = [t for t in module_tensors(copies[-1]) if not t.is_mkldnn]  # (a fused kernel's packs are new)
        assert copies and _storages(dense) <= twin, "the region's fp32 copy duplicated weights"
        return fn

    monkeypatch.setattr(cost, "_fp32_fn", spy)
    assert cost(regions[0]).int8_ms is not None
    assert timed and all(not module_tensors(gm) for gm in timed[0]), "a timing graph still holds tensors"
    assert not cost._scratch
    assert {id(t) for t in module_tensors(ref.float_module)} == twin_tensors_before  # the twin is intact


class _ScaleInPlace(GraphPass):
    """Writes the first conv's weight in place, then fails."""

    name = "scale_in_place"

    def call(self, gm: fx.GraphModule) -> PassResult:
        with torch.no_grad():
            gm.conv1.weight.mul_(3)
        raise RuntimeError("boom")


class _DeclaredScaleInPlace(_ScaleInPlace):
    name = "declared_scale_in_place"
    writes_tensors = True


def test_a_pass_that_wrote_a_shared_weight_cannot_pretend_to_roll_back() -> None:
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(PassFailure, match="in place"):
        PassManager([_ScaleInPlace()]).run(fx.symbolic_trace(model), [(x,)])


def test_a_pass_declaring_writes_tensors_gets_a_full_snapshot_and_rolls_back() -> None:
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 8, 8)
    gm = fx.symbolic_trace(model)
    before = gm.conv1.weight.clone()
    out = PassManager([_DeclaredScaleInPlace()]).run(gm, [(x,)])
    assert out.report.records[0].status == "rolled back"
    torch.testing.assert_close(out.graph_module.conv1.weight, before, rtol=0, atol=0)


# --- what results hold -------------------------------------------------------------------------


def test_optimize_result_holds_one_copy_of_each_weight(snapshots: list[weakref.ref]) -> None:
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16)
    user = weakref.ref(model)
    res = gml.optimize(model, x)
    del model
    assert _gone([user]), "the result keeps the caller's model alive"
    assert snapshots and _gone(snapshots), "a pass snapshot outlived the call"
    with torch.no_grad():
        res.executable(x)
    held = reachable_storages(res)
    # every tensor the result reaches is a tensor of its module (shared by the engine's segments)
    # or the example input; no packed (opaque mkldnn) copy is left where the engine runs the graph
    assert set(held.storages) <= _storages(module_tensors(res.module)) | _storages(res.example_inputs)
    if res.engine is not None:
        assert not held.opaque, f"{len(held.opaque)} packed weight copies next to the engine's"


def test_quantize_result_releases_model_prepared_graph_calibration_and_snapshots(
    monkeypatch: pytest.MonkeyPatch, snapshots: list[weakref.ref]
) -> None:
    from gml.quant import frontend

    prepared: list[weakref.ref] = []
    prepare = frontend.prepare

    def record(*args: Any, **kw: Any) -> fx.GraphModule:
        gm = prepare(*args, **kw)
        prepared.append(weakref.ref(gm))
        return gm

    monkeypatch.setattr(frontend, "prepare", record)
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    calib = [(torch.randn(2, 3, 16, 16),) for _ in range(3)]
    kept = [weakref.ref(model)] + [weakref.ref(b[0]) for b in calib]
    res = gml.quantize(model, calib, example_inputs=x)
    del model, calib
    assert res.scheme == "static" and res.reference is None
    assert prepared and _gone(prepared), "the result keeps torch.ao's prepared graph alive"
    assert _gone(kept), "the result keeps the caller's model or calibration batches alive"
    assert snapshots and _gone(snapshots)
    with torch.no_grad():
        res.executable(x)
    held = reachable_storages(res)
    assert set(held.storages) <= _storages(module_tensors(res.module)) | _storages([x])
    if res.engine is not None:
        assert not held.opaque and not held.packed_objects


def test_quantize_keep_intermediates_keeps_the_reference_graph() -> None:
    torch.manual_seed(0)
    res = gml.quantize(SmallCNN().eval(), 2, example_inputs=torch.randn(1, 3, 16, 16), keep_intermediates=True)
    assert isinstance(res.reference, fx.GraphModule)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(x))


def test_transformer_scheme_result_drops_its_fp32_graph() -> None:
    torch.manual_seed(0)
    model = _Encoder().eval()
    user = weakref.ref(model)
    res = gml.quantize(model, 2, example_inputs=torch.randn(2, 8, 32))
    del model
    assert res.scheme == "transformer"
    assert res.reference is None and res.frontend.fp32_module is None
    assert _gone([user])


def test_transformer_scheme_returning_fp32_holds_no_int8_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the whole-model guard returns gml.optimize's fp32 model, the result (its ``frontend``
    report included) reaches no int8 weight of the INT8 model it did not return."""
    from gml.quant import cost_policy

    monkeypatch.setattr(cost_policy, "guard_whole_model", lambda *a, **k: (2.0, 1.0))  # INT8 "slower"
    torch.manual_seed(0)
    res = gml.quantize(_Encoder().eval(), 2, example_inputs=torch.randn(2, 8, 32), cost_policy="measure")
    assert res.scheme == "transformer" and res.cost.all_fp32
    assert res.frontend.module is None and res.frontend.fp32_module is None
    held = reachable_storages(res)
    int8 = [t for t in module_tensors(res.module) if t.dtype == torch.int8]
    assert not int8
    assert set(held.storages) <= _storages(module_tensors(res.module)) | _storages(res.frontend.example_inputs)


def test_loaded_int8_model_holds_one_copy_of_each_weight(tmp_path: Any) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 16, 16)
    path = str(tmp_path / "m.pt2")
    gml.quantize(SmallCNN().eval(), 2, example_inputs=x).save(path)
    loaded = gml.load(path)
    with torch.no_grad():
        loaded(x)
    held = reachable_storages(loaded)
    assert set(held.storages) <= _storages(module_tensors(loaded))
    if loaded.runtime.path != "torch":
        assert not held.opaque and not held.packed_objects


def _saved_cnn(tmp_path: Any) -> tuple[str, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1, 3, 16, 16)
    path = str(tmp_path / "m.pt2")
    gml.quantize(SmallCNN().eval(), 2, example_inputs=x).save(path)
    return path, x


def test_loaded_weights_are_views_of_the_file_mapping_and_paged_out_after_the_engine_build(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded model's weights are read from the file on demand (gml.memory.MappedFile), not copied
    into the heap; once the engine holds its own copy the mapping's pages are handed back, and the
    Python executor still reads the right weights afterwards (from the file again)."""
    from gml.memory import MappedFile

    path, x = _saved_cnn(tmp_path)
    paged: list[MappedFile] = []
    page_out = MappedFile.page_out
    monkeypatch.setattr(MappedFile, "page_out", lambda self: paged.append(self) or page_out(self))
    graph = gml.load(path, runtime="torch")  # no engine: the weights stay resident, nothing paged out
    assert not paged
    mapping = {t.untyped_storage().data_ptr() for t in module_tensors(graph) if t.numel() > 64}
    assert len(mapping) == 1, "the weights are views of one storage: the mapped file"
    loaded = gml.load(path)
    with torch.no_grad():
        want = graph(x)
        assert torch.equal(loaded(x), want)
    if loaded.runtime.path != "torch":
        assert len(paged) == 1 and paged[0].path == path
        segment = loaded.segments()[0]
        with torch.no_grad():  # the segment's Python executor reads the paged-out weights again
            x2 = torch.randn(2, 3, 16, 16)  # the batch dimension is dynamic in a saved model
            assert torch.equal(segment.reference(x2)[0], graph(x2))
            torch.testing.assert_close(loaded(x2), graph(x2), rtol=0, atol=1e-4)  # a new plan, built from them
            assert torch.equal(loaded(x), want)


def test_a_file_whose_members_are_compressed_or_unaligned_loads_the_same(tmp_path: Any) -> None:
    """A member another zip writer compressed, or stored at an offset its dtype cannot be read at in
    place (Python's zipfile does not align members as torch's writer does), is copied instead of
    mapped: the same model."""
    from archive_edit import members

    path, x = _saved_cnn(tmp_path)
    prefix, found = members(Path(path))
    manifest = json.loads(found.pop(archive.MANIFEST))
    other = tmp_path / "rezipped.pt2"
    with zipfile.ZipFile(other, "w") as z:
        for name, data in found.items():
            kind = zipfile.ZIP_DEFLATED if name.startswith("data/weights/") else zipfile.ZIP_STORED
            z.writestr(prefix + name, data, compress_type=kind)
    archive.seal(other, {k: v for k, v in manifest.items() if k != "members"})
    with torch.no_grad():
        assert torch.equal(gml.load(str(other), runtime="torch")(x), gml.load(path, runtime="torch")(x))


# --- handing memory back -----------------------------------------------------------------------


def test_returns_memory_trims_only_after_a_call_that_grew_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection costs more than a small model's whole load: a call that grew the process by
    less than TRIM_MIN_GROWTH does not trim; one that grew it more trims on return, and a nested call
    trims on entry when the outer call has grown the process that much."""
    import gml.memory as memory

    trims: list[str] = []
    monkeypatch.setattr(memory, "trim_malloc", lambda: trims.append("trim") or True)
    grow = memory.TRIM_MIN_GROWTH * 2

    @memory.returns_memory
    def small() -> int:
        return 1

    @memory.returns_memory
    def big(inner: bool) -> torch.Tensor:
        held = torch.ones(grow // 4)  # written, so resident
        trims.append("before inner")
        if inner:
            small()
        return held

    # earlier tests' garbage freed by an automatic collection during big() would shrink the process
    # by more than big() grows it (seen after the quant tests): collect now, none during the calls
    gc.collect()
    heap_trim = memory._malloc_trim()  # the real one (trim_malloc is the recorder here)
    if heap_trim is not None:
        heap_trim(0)
    gc.disable()
    try:
        _trims_as_documented(small, big, trims)
    finally:
        gc.enable()


def _trims_as_documented(small: Any, big: Any, trims: list[str]) -> None:
    small()
    assert trims == []
    kept = big(False)
    assert trims == ["before inner", "trim"]
    trims.clear()
    del kept
    big(True)
    assert trims == ["before inner", "trim", "trim"]  # the nested call's entry, then the outer's return


@pytest.mark.parametrize("guard", ["int8", "fp32"])
def test_quantize_result_holds_no_packed_copy_next_to_its_engine(monkeypatch: pytest.MonkeyPatch, guard: str) -> None:
    """The accuracy report runs the returned module on the Python executor, which packs its weights
    again; with the engine running the model those packs were a second copy of every weight (the
    fp32 model the whole-model guard returns: 2x its weights, found by benchmarks/memory.py)."""
    import gml.quant.cost_policy as cp
    from gml.kernels import int8_ops

    times = (1.0, 3.0) if guard == "int8" else (3.0, 1.0)  # (INT8 ms, fp32 ms)
    monkeypatch.setattr(cp, "guard_whole_model", lambda *a, **k: times)
    x = torch.randn(1, 3, 16, 16)
    q = gml.quantize(SmallCNN().eval(), [(x,)] * 2, per_layer=False, cost_policy="measure")
    assert q.precision == guard
    if q.engine is None:
        pytest.skip(f"the engine does not run this model here: {q.runtime}")
    held = reachable_storages(q)
    assert not held.opaque, f"{len(held.opaque)} packed weight copies next to the engine's"
    assert not any(int8_ops._PACKS.get(t) for t in module_tensors(q.module))
