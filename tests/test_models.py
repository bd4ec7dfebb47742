from __future__ import annotations

import os

import pytest
import torch

from assets.models import SmallCNN
from gml.errors import InputError, ModelLoadError
from gml.models import default_input_shapes, example_inputs, load_model, parse_shapes

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "models.py")


def test_torchvision_by_name_is_random_init_and_eval():
    m = load_model("resnet18")
    assert not m.training
    assert type(m).__name__ == "ResNet"
    assert default_input_shapes(m, "resnet18") == [(1, 3, 224, 224)]


def test_unknown_name_suggests_close_matches():
    with pytest.raises(ModelLoadError, match="did you mean resnet18"):
        load_model("resnet81")


def test_file_class_reference_and_declared_shape():
    m = load_model(f"{ASSETS}:SmallCNN")
    assert type(m).__name__ == "SmallCNN"
    assert default_input_shapes(m, f"{ASSETS}:SmallCNN") == [(1, 3, 32, 32)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"{ASSETS}:Nope", "has no class 'Nope'"),
        ("does/not/exist.py:Model", "does not exist"),
        (f"{ASSETS}:NeedsArgs", "no arguments"),
        (ASSETS, "names a file but no class"),
    ],
)
def test_bad_file_references(spec, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(spec)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/gml-pwned",))


def test_checkpoint_with_pickle_payload_is_refused_not_executed(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": _Payload()}, path)
    if os.path.exists("/tmp/gml-pwned"):
        os.remove("/tmp/gml-pwned")
    with pytest.raises(ModelLoadError, match="Refused to load"):
        load_model(f"{ASSETS}:SmallCNN", weights=str(path))
    assert not os.path.exists("/tmp/gml-pwned")


def test_corrupt_and_truncated_checkpoints(tmp_path):
    good = tmp_path / "good.pt"
    torch.save(SmallCNN().state_dict(), good)
    data = good.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    for name in ("trunc.pt", "junk.pt"):
        with pytest.raises(ModelLoadError, match=r"corrupt or truncated|Refused"):
            load_model(f"{ASSETS}:SmallCNN", weights=str(tmp_path / name))
    m = load_model(f"{ASSETS}:SmallCNN", weights=str(good))
    assert torch.equal(m.conv1.weight, torch.load(good, weights_only=True)["conv1.weight"])


def test_checkpoint_for_other_architecture(tmp_path):
    path = tmp_path / "mlp.pt"
    torch.save({"fc9.weight": torch.zeros(1)}, path)
    with pytest.raises(ModelLoadError, match="does not match the model"):
        load_model(f"{ASSETS}:SmallCNN", weights=str(path))


def test_parse_shapes_and_example_inputs():
    assert parse_shapes("1x3x224x224,1x10") == [(1, 3, 224, 224), (1, 10)]
    with pytest.raises(InputError):
        parse_shapes("1x3xfoo")
    with pytest.raises(InputError):
        parse_shapes("0x3")
    a = example_inputs([(1, 3, 8, 8)], batch=4, seed=1)
    b = example_inputs([(1, 3, 8, 8)], batch=4, seed=1)
    assert a[0].shape == (4, 3, 8, 8) and torch.equal(a[0], b[0])


def test_torchvision_models_with_a_backbone_build_offline(monkeypatch):
    # segmentation/detection builders download ImageNet backbone weights unless told not to
    import torch.hub

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download weights")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_network)
    model = load_model("lraspp_mobilenet_v3_large")
    assert not model.training
    assert default_input_shapes(model, "lraspp_mobilenet_v3_large") == [(1, 3, 224, 224)]


def test_default_shapes_of_video_and_optical_flow_models():
    assert default_input_shapes(torch.nn.Identity(), "r3d_18") == [(1, 3, 16, 112, 112)]
    # S3D and MViT need 224x224 (MViT's patch embedding fixes it; S3D's last pool is 7x7)
    assert default_input_shapes(torch.nn.Identity(), "s3d") == [(1, 3, 16, 224, 224)]
    assert default_input_shapes(torch.nn.Identity(), "mvit_v2_s") == [(1, 3, 16, 224, 224)]
    assert default_input_shapes(torch.nn.Identity(), "raft_small") == [(1, 3, 128, 128)] * 2


def test_example_inputs_follow_their_templates():
    from gml.models import example_inputs

    ids = torch.tensor([[3, 7, 9]])
    mask = torch.tensor([[True, False, True]])
    half = torch.zeros(1, 2, dtype=torch.float64)
    a, b, c = example_inputs([(1, 3), (1, 3), (1, 2)], batch=5, like=[ids, mask, half])
    assert a.dtype == torch.int64 and a.shape == (5, 3) and int(a.min()) >= 3 and int(a.max()) <= 9
    assert b.dtype == torch.bool and c.dtype == torch.float64 and c.shape == (5, 2)
    (plain,) = example_inputs([(2, 4)])  # no template: N(0, 1) float32
    assert plain.dtype == torch.float32
