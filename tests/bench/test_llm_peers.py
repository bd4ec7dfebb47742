"""gml bench --llm's peers (gml.bench.llm_peers, llm_worker, llm_files) without any peer installed: the
worker protocol and the interleaving through a fake runtime (tests/bench/fake_llm_worker.py; plumbing
only, no timings), missing peers listed with their reason, bad paths and dying workers."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from assets.llm_models import tiny
from gml.bench.llm import bench_llm
from gml.bench.llm_files import _only_gathered, gguf_info, model_info, openvino_info
from gml.bench.llm_peers import PEERS_BY_KEY, PeerError, PeerKind, PeerRequest, PeerWorker
from gml.errors import InputError

FAKE_WORKER = Path(__file__).with_name("fake_llm_worker.py")
# a peer kind whose "module" every interpreter has: the fake runtime stands in for the peer
FAKE = PeerKind("openvino", "Fake peer", "json", "pip install fake", "a folder", "make one", kv_bytes=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny("llama").save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def no_bandwidth_pass(monkeypatch):
    """The 1 GiB read-bandwidth pass is not what these tests check: a fixed number keeps them fast."""
    monkeypatch.setattr("gml.bench.llm.read_bandwidth_gbs", lambda: 10.0)


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    monkeypatch.setenv("FAKE_PEER_LOG", str(path))
    return path


def _models(tmp_path, *names):
    paths = []
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "openvino_model.xml").write_text("<net/>")  # what an IR folder must hold (FAKE's key)
        paths.append(str(tmp_path / n))
    return paths


def test_worker_protocol(tmp_path, log):
    w = PeerWorker("fake", sys.executable, worker=FAKE_WORKER)
    try:
        with pytest.raises(PeerError, match="no model loaded"):
            w.request({"cmd": "run", "prompt": [1, 2], "new_tokens": 3})
        with pytest.raises(PeerError, match="unknown command"):
            w.request({"cmd": "dance"})
        loaded = w.request({"cmd": "load", "model": str(tmp_path / "m8"), "threads": 2, "max_length": 16})
        assert (loaded["precision"], loaded["weight_bytes"], loaded["runtime"]) == ("int8", 1000, "fake (2 threads)")
        ran = w.request({"cmd": "run", "prompt": [1, 2], "new_tokens": 3})
        assert (ran["prefill_seconds"], ran["decode_seconds"], ran["new_tokens"]) == (0.5, 0.25, 3)
        assert json.loads(log.read_text()) == ["m8", [1, 2], 3]
    finally:
        w.close()


def test_peer_rows_run_interleaved_with_gml(folder, tmp_path, log):
    models = _models(tmp_path, "model-int8", "model-int4")
    peer = PeerRequest(FAKE, sys.executable, models, worker=FAKE_WORKER)
    result = bench_llm(str(folder), weights=["int8"], prompt_tokens=6, new_tokens=3, rounds=2, peers=[peer])
    rows = {r.name: r for r in result.rows}
    assert list(rows) == ["HF eager fp32", "GML int8", "Fake peer int8", "Fake peer int4"]
    fake = rows["Fake peer int8"]
    # tok/s from the worker's seconds, as lm.stats counts them: 6 prompt tokens / 0.5 s, 2 steps / 0.25 s
    assert (fake.prefill, fake.decode, fake.weight_bytes) == (12.0, 8.0, 1000)
    assert fake.kv_bytes_per_token == rows["GML int8"].kv_bytes_per_token  # GML int8: an fp16 cache; the peer: 2 bytes
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 2 * 3  # each model: a warm-up and 2 rounds
    prompts = [p for _, p, _ in runs]
    assert all(len(p) == 6 and all(0 <= t < 128 for t in p) for p in prompts)
    by_round = [sorted(runs[i : i + 2]) for i in range(0, 6, 2)]
    for pair in by_round:  # both peer models get the round's prompt; each round a fresh one
        assert [m for m, _, _ in pair] == ["model-int4", "model-int8"] and pair[0][1] == pair[1][1]
    assert len({json.dumps(pair[0][1]) for pair in by_round}) == 3
    assert "not run" not in result.markdown()


def test_missing_peer_or_model_is_listed_not_an_error(folder):
    absent = dataclasses.replace(FAKE, name="Absent peer", module="no_such_peer_module_xyz", install="pip install x")
    no_model = dataclasses.replace(FAKE, name="Idle peer")
    peers = [PeerRequest(absent, sys.executable, []), PeerRequest(no_model, sys.executable, [])]
    result = bench_llm(str(folder), weights=["int4"], prompt_tokens=4, new_tokens=2, rounds=1, peers=peers)
    assert [r.name for r in result.rows] == ["HF eager fp32", "GML int4, int8 activations"]
    why = dict(result.skipped)
    assert "not installed" in why["Absent peer"] and "pip install x" in why["Absent peer"]
    assert "--openvino-python" in why["Absent peer"]
    assert "no model given" in why["Idle peer"] and "--openvino-model" in why["Idle peer"]
    table = result.markdown()
    assert "not run: Absent peer" in table and "not run: Idle peer" in table


def test_default_peers_are_listed(folder):
    result = bench_llm(str(folder), weights=["int4"], prompt_tokens=4, new_tokens=2, rounds=1)
    assert {name for name, _ in result.skipped} == {"llama.cpp", "OpenVINO GenAI", "ONNX Runtime GenAI"}


def test_a_failing_peer_becomes_a_row_note(folder, tmp_path, log):
    models = _models(tmp_path, "bad-model", "crash-model", "ok8")
    peer = PeerRequest(FAKE, sys.executable, models, worker=FAKE_WORKER)
    result = bench_llm(str(folder), weights=["int4"], prompt_tokens=4, new_tokens=2, rounds=1, peers=[peer])
    rows = {r.name: r for r in result.rows}
    bad = rows["Fake peer (bad-model)"]
    assert "did not load" in bad.note and "not a model this runtime reads" in bad.note and bad.decode == 0
    crashed = next(r for n, r in rows.items() if "int4" in n and n.startswith("Fake"))  # crash-model: int4
    assert "failed in its warm-up" in crashed.note and "exited with 3" in crashed.note and crashed.decode == 0
    assert rows["Fake peer int8"].decode > 0  # the others still ran
    assert "| - | - |" in result.markdown()


def test_bad_paths_are_clear_errors(folder, tmp_path):
    from gml.cli import main

    gguf = PEERS_BY_KEY["llamacpp"]
    with pytest.raises(InputError, match="does not exist"):
        bench_llm(str(folder), weights=["int4"], rounds=1, peers=[PeerRequest(gguf, sys.executable, ["/no/x.gguf"])])
    with pytest.raises(InputError, match=r"is not a \.gguf file"):
        bench_llm(str(folder), weights=["int4"], rounds=1, peers=[PeerRequest(gguf, sys.executable, [str(tmp_path)])])
    with pytest.raises(InputError, match="not an executable"):
        bench_llm(str(folder), weights=["int4"], rounds=1, peers=[PeerRequest(gguf, "/no/python", [])])
    ort = PEERS_BY_KEY["ortgenai"]
    with pytest.raises(InputError, match=r"no genai_config\.json in it"):
        bench_llm(str(folder), weights=["int4"], rounds=1, peers=[PeerRequest(ort, sys.executable, [str(tmp_path)])])
    assert main(["bench", str(folder), "--llm", "--openvino-model", str(tmp_path / "nope")]) != 0
    assert main(["bench", str(folder), "--llm", "--llamacpp-preload", str(tmp_path / "no.so")]) != 0


def test_gguf_bytes_leave_out_a_gathered_embedding(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    def write(path, tied):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
        w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), np.float32))
        if not tied:
            w.add_tensor("output.weight", np.zeros((64, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "untied.gguf", tied=False)
    write(tmp_path / "tied.gguf", tied=True)
    assert gguf_info(str(tmp_path / "untied.gguf")) == ("Q8_0", (32 + 64) * 32 * 4)  # token_embd only gathered
    assert gguf_info(str(tmp_path / "tied.gguf")) == ("Q8_0", (64 + 32) * 32 * 4)  # it is the LM head too
    (tmp_path / "junk.gguf").write_bytes(b"not gguf")
    assert model_info("llamacpp", str(tmp_path / "junk.gguf")) == ("junk.gguf", None)


def test_openvino_bytes_and_precision_from_the_ir(tmp_path):
    layers = [("0", "Const", "u8", 640), ("1", "Convert", None, 0), ("2", "Multiply", None, 0),
              ("3", "Gather", None, 0), ("4", "Const", "i4", 320), ("5", "Convert", None, 0),
              ("6", "Const", "f16", 40), ("7", "Multiply", None, 0), ("8", "MatMul", None, 0),
              ("9", "Const", "f32", 4)]  # fmt: skip
    edges = [("0", "1"), ("1", "2"), ("2", "3"), ("4", "5"), ("5", "7"), ("6", "7"), ("7", "8"), ("9", "2")]
    xml = ['<?xml version="1.0"?><net name="m" version="11"><layers>']
    for lid, kind, et, size in layers:
        data = f'<data element_type="{et}" shape="1" offset="0" size="{size}"/>' if et else ""
        xml.append(f'<layer id="{lid}" name="l{lid}" type="{kind}" version="opset1">{data}</layer>')
    xml.append("</layers><edges>")
    xml += [f'<edge from-layer="{a}" from-port="0" to-layer="{b}" to-port="1"/>' for a, b in edges]
    xml.append("</edges></net>")
    (tmp_path / "openvino_model.xml").write_text("".join(xml))
    # the u8 table and its f32 scale only reach a Gather: an embedding, not read per token
    assert openvino_info(str(tmp_path)) == ("int4", 320 + 40)
    # an int8 matrix next to the int4 ones (NNCF's LM head) is named
    xml = (tmp_path / "openvino_model.xml").read_text().replace('type="Gather"', 'type="MatMul"')
    (tmp_path / "openvino_model.xml").write_text(xml)
    precision, nbytes = openvino_info(str(tmp_path))
    assert nbytes == 640 + 320 + 40 + 4 and {precision} & {"int4 (+ 1 int8 matrix)", "int8 (+ 1 int4 matrix)"}


def test_only_gathered_follows_decompression_ops():
    consumers = {"w": [("Cast", "a")], "a": [("Gather", "x"), ("Mul", "b")], "b": [("MatMul", "y")]}
    assert not _only_gathered("w", consumers)  # tied: the LM head reads it
    assert _only_gathered("w", {"w": [("DequantizeLinear", "a")], "a": [("GatherBlockQuantized", "x")]})
    assert not _only_gathered("w", {})  # unused: counted (nothing says it is a table)
