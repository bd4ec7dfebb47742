"""Saved models: a hostile file never runs code, a damaged file never loads with other numbers.

The hostile files are built the way an attacker would: from a real ``gml.io.save`` output, with a
payload member swapped in *and the manifest rewritten to match*, so only the member checks stand
between the payload and ``torch.export.load`` (the digests alone prove nothing about an author).
"""

from __future__ import annotations

import io as _io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from archive_edit import program, rewrite, with_program
from gml import io as gio
from gml.capture import capture
from gml.errors import ModelLoadError
from gml.passes.manager import PassManager
from gml.passes.pipeline import fp32_passes

SENTINEL = Path(f"/tmp/gml-archive-pwned-{os.getpid()}")


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {SENTINEL}",))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    return m.eval(), torch.randn(1, 3, 4, 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    model, x = _model()
    gm = PassManager(fp32_passes(), strict=True).run(capture(model, (x,)), [(x,)]).graph_module
    path = gio.save(gm, tmp_path_factory.mktemp("saved") / "m.pt2")
    with torch.no_grad():
        return path, x, gio.load(path)(x)


@pytest.fixture(autouse=True)
def _no_sentinel():
    SENTINEL.unlink(missing_ok=True)
    yield
    assert not SENTINEL.exists(), "a payload in the file ran"


def _payload_bytes(protocol: int | str) -> bytes:
    if protocol == "torch.save":
        buf = _io.BytesIO()
        torch.save({"x": _Payload()}, buf)
        return buf.getvalue()
    return pickle.dumps(_Payload(), protocol=int(protocol))


def _weights_config(members: dict[str, bytes]) -> str:
    return next(n for n in members if n.endswith("_weights_config.json"))


def _set_config(members: dict[str, bytes], name: str, **change) -> None:
    config = json.loads(members[name])
    first = next(iter(config["config"].values()))
    first.update(change)
    members[name] = json.dumps(config).encode()


PROTOCOLS = [0, 2, 4, 5, "torch.save"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pickled_sample_inputs_are_refused_not_run(saved, tmp_path, protocol):
    path, _, _ = saved

    def edit(m):
        m[next(n for n in m if "sample_inputs" in n)] = _payload_bytes(protocol)

    bad = rewrite(path, tmp_path / "bad.pt2", edit)
    with pytest.raises(ModelLoadError, match="was refused: it carries pickled sample inputs"):
        gio.load(bad)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_weight_marked_use_pickle_is_refused_not_run(saved, tmp_path, protocol):
    path, _, _ = saved

    def edit(m):
        name = _weights_config(m)
        _set_config(m, name, use_pickle=True)
        first = next(iter(json.loads(m[name])["config"].values()))
        m["data/weights/" + first["path_name"]] = _payload_bytes(protocol)

    bad = rewrite(path, tmp_path / "bad.pt2", edit)
    with pytest.raises(ModelLoadError, match="asks for a pickled payload"):
        gio.load(bad)


@pytest.mark.parametrize(
    ("member", "expect"),
    [
        ("data/constants/model.pt", "unexpected member"),  # the legacy constants file torch unpickles
        ("data/constants/custom_obj_0", "unexpected member"),  # torchbind objects
        ("data/constants/opaque_obj_0", "unexpected member"),  # pickle.loads
        ("models/other.json", "unexpected member"),
    ],
)
def test_other_unpickled_members_are_refused(saved, tmp_path, member, expect):
    path, _, _ = saved
    bad = rewrite(path, tmp_path / "bad.pt2", lambda m: m.__setitem__(member, _payload_bytes(2)))
    with pytest.raises(ModelLoadError, match=expect):
        gio.load(bad)


def test_a_constant_config_pointing_at_an_object_is_refused(saved, tmp_path):
    path, _, _ = saved

    def edit(m):
        name = next(n for n in m if n.endswith("_constants_config.json"))
        m[name] = json.dumps(
            {"config": {"c": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": False}}}
        ).encode()
        m["data/constants/tensor_0"] = _payload_bytes(2)

    with pytest.raises(ModelLoadError, match="is not a plain tensor"):
        gio.load(rewrite(path, tmp_path / "bad.pt2", edit))


def test_declared_input_shapes_too_big_to_check_are_refused_before_anything_is_allocated(saved, tmp_path):
    """The load check runs the graph on inputs of the shapes the file declares: a width of 33,554,440
    (found by a fuzzer) made it allocate and convolve 1.6 G elements for minutes."""
    path, _, _ = saved
    prog = program(path)
    graph = prog["graph_module"]["graph"]
    name = prog["graph_module"]["signature"]["input_specs"][-1]["user_input"]["arg"]["as_tensor"]["name"]
    graph["tensor_values"][name]["sizes"][2] = {"as_int": 33_554_440}
    with pytest.raises(ModelLoadError, match="more than the 134,217,728 a saved model may declare"):
        gio.load(with_program(path, tmp_path / "huge.pt2", prog))


def test_a_swapped_member_with_a_stale_manifest_is_damaged(saved, tmp_path):
    path, _, _ = saved

    def edit(m):
        m[next(n for n in m if "sample_inputs" in n)] = _payload_bytes(2)

    with pytest.raises(ModelLoadError, match=r"is damaged: member .* does not match its recorded digest"):
        gio.load(rewrite(path, tmp_path / "bad.pt2", edit, reseal=False))


def test_trust_pickle_does_not_open_the_door_for_export_files(saved, tmp_path):
    path, _, _ = saved

    def edit(m):
        m[next(n for n in m if "sample_inputs" in n)] = _payload_bytes(2)

    with pytest.raises(ModelLoadError, match="was refused"):
        gio.load(rewrite(path, tmp_path / "bad.pt2", edit), trust_pickle=True)


def test_truncated_files_are_damaged_and_get_no_pickle_advice(saved, tmp_path):
    path, _, _ = saved
    data = path.read_bytes()
    for cut in (10, len(data) // 3, len(data) // 2, len(data) - 30):
        bad = tmp_path / f"cut{cut}.pt2"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="is damaged") as err:
            gio.load(bad)
        assert "trust_pickle" not in (err.value.hint or "") + str(err.value)


def _data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where a member's bytes start: after its *local* header, whose extra field (torch's alignment
    padding) can differ in length from the central directory's."""
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def _regions(path: Path) -> dict[str, list[int]]:
    """Byte offsets per region of the file: each member's local header and data, the central directory."""
    data = path.read_bytes()
    regions: dict[str, list[int]] = {}
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        for info in infos:
            start = info.header_offset
            data_start = _data_offset(data, info)
            kind = info.filename.rsplit("/", 1)[-1]
            regions[f"header:{kind}"] = list(range(start, data_start))
            regions[f"data:{kind}"] = list(range(data_start, data_start + info.compress_size))
        cd_start = max(_data_offset(data, i) + i.compress_size for i in infos)
    regions["central directory + end record"] = list(range(cd_start, len(data)))
    return {k: v for k, v in regions.items() if v}


def test_every_bit_flip_is_refused_or_loads_identical(saved, tmp_path):
    """Flip bits in every region (headers, weights, graph JSON, configs, manifest, directory)."""
    path, x, expected = saved
    data = path.read_bytes()
    flipped = refused = 0
    for region, offsets in _regions(path).items():
        step = max(1, len(offsets) // 6)  # up to ~7 offsets per region, first and last included
        for off in sorted({*offsets[::step], offsets[-1]}):
            for bit in (0, 7):
                bad = bytearray(data)
                bad[off] ^= 1 << bit
                f = tmp_path / "flip.pt2"
                f.write_bytes(bytes(bad))
                flipped += 1
                try:
                    out = gio.load(f)(x)
                except ModelLoadError:
                    refused += 1
                    continue
                assert torch.equal(out, expected), f"{region} offset {off} bit {bit} loaded with other numbers"
    assert flipped > 100 and refused > flipped // 2, (flipped, refused)


def test_not_a_zip_and_directories_get_their_own_message(tmp_path):
    (tmp_path / "junk.pt2").write_bytes(b"hello world" * 10)
    with pytest.raises(ModelLoadError, match="not a zip archive"):
        gio.load(tmp_path / "junk.pt2")
    with pytest.raises(ModelLoadError, match="is a directory"):
        gio.load(tmp_path)


def test_a_plain_torch_save_file_is_refused_as_pickled(tmp_path):
    torch.save({"x": _Payload()}, tmp_path / "p.pt")
    with pytest.raises(ModelLoadError, match="was refused: it is a pickled model"):
        gio.load(tmp_path / "p.pt")


def test_sealed_pickle_files_check_their_digests_before_unpickling(saved, tmp_path):
    model, x = _model()
    path = gio.save(capture(model, (x,)), tmp_path / "m.pkl", format="pickle")
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    data[_data_offset(bytes(data), info) + 5] ^= 0x40
    (tmp_path / "bad.pkl").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="is damaged"):
        gio.load(tmp_path / "bad.pkl", trust_pickle=True)
    with torch.no_grad():
        assert torch.equal(gio.load(path, trust_pickle=True, runtime="torch")(x), model(x))


@pytest.fixture(scope="module")
def saved_int8(tmp_path_factory) -> Path:
    import gml

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).eval()
    res = gml.quantize(model, 2, example_inputs=(torch.randn(1, 3, 4, 4),), per_layer=False)
    path = tmp_path_factory.mktemp("saved_int8") / "int8.pt2"
    res.save(str(path))
    return path


@pytest.mark.parametrize("protocol", [2, "torch.save"])
def test_int8_files_with_a_pickled_member_are_refused_not_run(saved_int8, tmp_path, protocol):
    """The INT8 format (gml ops, int8 weights as constants) goes through the same member checks."""
    loaded = gio.load(saved_int8)  # the clean file loads, onto the engine where it is built
    assert loaded.runtime.path in ("engine", "torch")

    def weights(m):
        name = _weights_config(m) if any(n.endswith("_weights_config.json") for n in m) else None
        config = json.loads(m[name])["config"] if name else {}
        if not config:  # the INT8 graph keeps its tensors as constants
            name = next(n for n in m if n.endswith("_constants_config.json"))
        _set_config(m, name, use_pickle=True)

    def sample_inputs(m):
        m[next(n for n in m if "sample_inputs" in n)] = _payload_bytes(protocol)

    for edit, expect in ((weights, "asks for a pickled payload"), (sample_inputs, "carries pickled sample inputs")):
        bad = rewrite(saved_int8, tmp_path / "bad.pt2", edit)
        with pytest.raises(ModelLoadError, match=expect):
            gio.load(bad)
        with pytest.raises(ModelLoadError, match="was refused"):
            gio.load(bad, trust_pickle=True, runtime="torch")
