"""gml bench's bf16 rows: the --precision bf16 default list and the gml-bf16 builder's refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gml.bench import variants as v
from gml.errors import InputError
from gml.ir.target import Target
from gml.kernels import bf16 as kb


def test_precision_bf16_lists_gml_bf16_against_openvino_bf16():
    names = v.resolve_variants(None, precision="bf16")
    assert names[0] == "eager" and "gml-bf16" in names and "ov-bf16" in names
    assert v.resolve_variants("default", precision="bf16") == names
    assert "gml-bf16" not in v.resolve_variants(None)  # fp32 defaults unchanged
    assert v.VARIANTS["gml-bf16"].precision == "bf16"
    with pytest.raises(InputError, match="unknown precision"):
        v.resolve_variants(None, precision="int4")


def _ctx(tmp_path: Path) -> v.BuildContext:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    return v.BuildContext(model, (x,), [(x,)], 1, tmp_path)


def test_gml_bf16_is_skipped_not_mislabelled_without_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(
        kb, "bf16_unavailable_reason", lambda target=None: "no bf16 (simulated)"
    )
    with pytest.raises(v.VariantSkipped, match="no bf16 \\(simulated\\)"):
        v.build_gml_bf16(_ctx(tmp_path))


@pytest.mark.skipif(not kb.bf16_available(), reason="no native bf16")
def test_gml_bf16_builds_and_notes_its_precision(tmp_path):
    built = v.build_gml_bf16(_ctx(tmp_path))
    assert any("precision: bf16" in n for n in built.notes)
    out = built.run(built.native(_ctx(tmp_path).example))
    assert out.dtype == torch.float32


def test_openvino_bf16_is_skipped_not_mislabelled_without_bf16(tmp_path):
    # OpenVINO reads bf16 from CPUID: on an AVX2 target its "bf16" row would be f32 (or, under
    # ONEDNN_MAX_CPU_ISA on a bf16 CPU, fail to build); the row is skipped with the reason first,
    # before OpenVINO is imported, so this holds without the [bench] extra
    ctx = _ctx(tmp_path)
    ctx.target = Target("avx2")
    with pytest.raises(v.VariantSkipped, match=r"no native bf16 on this target \(avx2\).*ov-fp32"):
        v.VARIANTS["ov-bf16"].build(ctx)
