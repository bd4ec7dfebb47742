"""gml bench --llm (gml.bench.llm): rows, the bandwidth ceiling, the CPU line, and its errors."""

from __future__ import annotations

import pytest
import torch

import gml
from assets.llm_models import tiny
from gml.bench.llm import LLMBench, LLMRow, bench_llm
from gml.errors import InputError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny("llama").save_pretrained(path)
    return path


def test_bench_llm_times_hf_and_every_weight_format(folder):
    result = bench_llm(str(folder), weights=["fp32", "int4"], prompt_tokens=8, new_tokens=3, rounds=1)
    # gml.llm's own activations by default: int8 for int4 weights
    assert [r.name for r in result.rows] == ["HF eager fp32", "GML fp32", "GML int4, int8 activations"]
    assert all(r.prefill > 0 and r.decode > 0 for r in result.rows)
    fp32, int4 = result.rows[1], result.rows[2]
    assert result.rows[0].weight_bytes == fp32.weight_bytes > int4.weight_bytes
    assert result.ceiling(int4) > result.ceiling(fp32) > 0  # fewer bytes per token, higher ceiling
    table = result.markdown()
    assert "CPU:" in table and "oneDNN ISA" in table and "% of ceiling" in table
    assert "not run: llama.cpp" in table  # every peer is named with why it did not run


def test_bench_llm_adds_int8_activation_rows_for_quantized_weights(folder):
    result = bench_llm(
        str(folder), weights=["fp32", "int8"], activations=("fp32", "int8"), prompt_tokens=8, new_tokens=3, rounds=1
    )
    names = [r.name for r in result.rows]
    assert names == ["HF eager fp32", "GML fp32", "GML int8", "GML int8, int8 activations"]


def test_bench_llm_on_a_saved_llm_times_the_weights_it_holds(folder, tmp_path):
    path = gml.llm(str(folder), weights="int8", max_length=32).save(tmp_path / "m.gml")
    result = bench_llm(str(path), weights=["fp32"], prompt_tokens=8, new_tokens=3, rounds=1)
    assert [r.name for r in result.rows] == ["GML int8"]


def test_ceiling_is_bandwidth_over_bytes_per_token():
    b = LLMBench("cpu", read_gbs=10.0, prompt_tokens=100, new_tokens=0, rounds=1)
    row = LLMRow("x", weight_bytes=10**9, kv_bytes_per_token=0)
    assert b.ceiling(row) == pytest.approx(10.0)
    row.kv_bytes_per_token = 10**7  # 100 tokens of context: another GB per token
    assert b.ceiling(row) == pytest.approx(5.0)


def test_bench_llm_errors(folder, capsys):
    from gml.cli import main

    with pytest.raises(InputError, match="cannot read"):
        bench_llm("resnet18", weights=["fp32"], rounds=1)
    assert main(["bench", str(folder), "--llm", "--llm-weights", "int3"]) != 0
    assert main(["bench", str(folder), "--llm", "--json", "x.json"]) != 0
    assert main(["bench", str(folder), "--llm", "--llm-activations", "int4"]) != 0
    out = capsys.readouterr()
    assert "int3" in out.out + out.err and "--md" in out.out + out.err


def test_threads_apply_to_the_call_only(folder):
    """``threads=`` times with that many threads and leaves the caller's setting as it was (it leaked
    into the rest of a test session)."""
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    result = bench_llm(str(folder), weights=["fp32"], prompt_tokens=8, new_tokens=3, rounds=1, threads=want)
    assert f"{want} thread(s)" in result.cpu
    assert torch.get_num_threads() == before
