"""``gml generate``: a local folder, token ids in, token ids and tokens/s out; bad input is a clear error."""

from __future__ import annotations

import pytest

import gml
from assets.llm_models import tiny
from gml.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = tiny("llama")
    model.save_pretrained(path)
    return path, model


def test_generate_prints_tokens_and_rates(folder, capsys):
    path, model = folder
    assert main(["generate", str(path), "--weights", "int8", "--prompt-ids", "5,17,3", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    expected = gml.llm(model, weights="int8", max_length=9).generate([5, 17, 3], 6)
    assert out[0] == " ".join(map(str, expected))
    assert "prefill" in out[-1] and "decode" in out[-1] and "tok/s" in out[-1]
    args = ["generate", str(path), "--weights", "int4", "--activations", "int8", "--prompt-ids", "5,17,3"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    expected = gml.llm(model, weights="int4", activations="int8", max_length=9).generate([5, 17, 3], 6)
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, expected))
    args = ["generate", str(path), "--weights", "int4", "--zero-points", "--prompt-ids", "5,17,3"]
    assert main([*args, "--max-new-tokens", "6"]) == 0  # int4 with zero points
    expected = gml.llm(model, weights="int4", symmetric=False, max_length=9).generate([5, 17, 3], 6)
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, expected))
    assert main(["generate", str(path), "--zero-points", "--prompt-ids", "5,17,3"]) == 5  # not int4
    assert "--zero-points applies to int4 weights" in capsys.readouterr().out
    args = ["generate", str(path), "--weights", "int8", "--group-size", "channel", "--prompt-ids", "5,17,3"]
    assert main([*args, "--max-new-tokens", "6"]) == 0  # int8 per output channel
    expected = gml.llm(model, weights="int8", group_size=None, max_length=9).generate([5, 17, 3], 6)
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, expected))


def test_generate_text_prompt_without_tokenizer(folder, capsys):
    path, _ = folder
    assert main(["generate", str(path), "--prompt", "hello"]) == 5
    assert "has no tokenizer" in capsys.readouterr().out


def test_generate_bad_ids(folder, capsys):
    path, _ = folder
    assert main(["generate", str(path), "--prompt-ids", "1,x"]) == 5
    assert "comma-separated list of integers" in capsys.readouterr().out
    assert main(["generate", str(path), "--prompt-ids", "1,100000"]) == 5
    assert "outside the vocabulary" in capsys.readouterr().out
