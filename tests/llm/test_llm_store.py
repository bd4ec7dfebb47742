"""lm.save / gml.load for decoder LLMs (gml.llm.store): round trips, no pickle, hostile files.

A hostile author can write a consistent manifest, so every hostile case below re-seals the file it
altered: the loader's own checks, not the digests, must refuse it."""

from __future__ import annotations

import json
import math
import pickle
import random
import zipfile
from pathlib import Path

import pytest
import torch

import gml
from assets.llm_models import tiny
from gml import archive
from gml.errors import GMLError, InputError, ModelLoadError
from gml.llm.api import LLM

PROMPT = [5, 17, 3, 99, 42, 8, 64, 23, 11, 7]


@pytest.fixture(scope="module")
def saved_int4(tmp_path_factory) -> tuple[LLM, Path]:
    lm = gml.llm(tiny("qwen2"), weights="int4", symmetric=False, max_length=64)  # zero points, q/k/v biases
    path = lm.save(tmp_path_factory.mktemp("llm") / "qwen2.gml")
    return lm, path


@pytest.mark.parametrize(
    ("family", "weights", "kwargs"),
    [
        ("llama", "fp32", {}),
        ("gemma3", "bf16", {"kv_cache": "bf16"}),  # tied head in bf16, sandwich + q/k norms, two RoPE tables
        ("gpt2", "int8", {}),  # learned positions, LayerNorm biases, Conv1D; int8 in groups of 32
        ("llama", "int8", {"group_size": None}),  # int8 per output channel
        ("qwen3", "int8", {"group_size": 64, "lm_head_weights": "fp32"}),
        ("phi3", "int4", {"group_size": 64}),
        ("mistral", "int8", {"lm_head_weights": "fp32"}),
    ],
)
def test_round_trip_gives_the_same_logits_and_tokens(tmp_path, family, weights, kwargs):
    lm = gml.llm(tiny(family), weights=weights, max_length=48, **kwargs)
    path = lm.save(tmp_path / "m.gml")
    back = gml.load(path)
    assert isinstance(back, LLM)
    assert (back.decoder.weights, back.decoder.lm_head_weights) == (lm.decoder.weights, lm.decoder.lm_head_weights)
    assert back.max_length == 48 and back.kv_dtype == lm.kv_dtype
    assert back.weight_bytes() == lm.weight_bytes()
    assert torch.equal(back.logits(PROMPT), lm.logits(PROMPT))
    assert back.generate(PROMPT, 12) == lm.generate(PROMPT, 12)


def test_a_file_from_before_int8_groups_loads_per_channel(tmp_path):
    """Files written before INT8 had groups have no ``int8_group_size`` and hold INT8 per output channel:
    they load as such. A grouped file stripped of the key is refused (its scales' shapes disagree), not
    misread."""
    model = tiny("gemma3")
    per_channel = gml.llm(model, weights="int8", group_size=None, max_length=32)
    path = per_channel.save(tmp_path / "pc.gml")
    old = _rewrite(path, tmp_path / "old.gml", edit_meta=lambda meta: meta.pop("int8_group_size"))
    back = gml.load(old)
    assert all(op.qweight.group_size == op.in_features for layer in back.decoder.layers for op in layer.linears())
    assert torch.equal(back.logits(PROMPT), per_channel.logits(PROMPT))
    grouped = gml.llm(model, weights="int8", max_length=32).save(tmp_path / "g.gml")
    stripped = _rewrite(grouped, tmp_path / "stripped.gml", edit_meta=lambda meta: meta.pop("int8_group_size"))
    with pytest.raises(ModelLoadError, match="scales"):
        gml.load(stripped)


def test_tied_head_is_stored_once(tmp_path):
    model = tiny("gemma3")
    assert model.config.tie_word_embeddings
    lm = gml.llm(model, weights="fp32", max_length=32)
    path = lm.save(tmp_path / "m.gml")
    with zipfile.ZipFile(path) as z:
        names = [n.split("/", 1)[1] for n in z.namelist()]
    assert "tensors/embed.weight.bin" in names and not any(n.startswith("tensors/lm_head") for n in names)
    back = gml.load(path)
    assert back.decoder.lm_head.weight is back.decoder.embed


def test_load_never_unpickles(saved_int4, monkeypatch):
    lm, path = saved_int4

    def refuse(*a, **k):
        raise AssertionError("the LLM loader unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert torch.equal(gml.load(path).logits(PROMPT), lm.logits(PROMPT))


def test_gml_llm_reads_a_saved_file_with_its_own_options(saved_int4):
    path = saved_int4[1]
    back = gml.llm(path, max_length=20, kv_cache="bf16")
    assert back.max_length == 20 and back.kv_dtype == torch.bfloat16 and back.decoder.weights == "int4"
    with pytest.raises(InputError, match="cannot requantize a saved LLM"):
        gml.llm(path, weights="int8")
    with pytest.raises(InputError, match="position tables cover"):
        gml.llm(path, max_length=65)


def test_reference_kernel_on_load_equals_native(saved_int4):
    lm, path = saved_int4
    ref = gml.llm(path, kernel="reference")
    assert all(op.kernel is None for layer in ref.decoder.layers for op in layer.linears())
    torch.testing.assert_close(ref.logits(PROMPT), lm.logits(PROMPT), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# hostile files
# --------------------------------------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, edit_meta=None, edit_members=None) -> Path:
    """Copy ``src`` with its llm.json edited by ``edit_meta(meta)`` and its members by
    ``edit_members(dict rel -> bytes)``, then seal it again (a consistent manifest)."""
    with zipfile.ZipFile(src) as z:
        prefix = z.namelist()[0].split("/", 1)[0] + "/"
        members = {n[len(prefix) :]: z.read(n) for n in z.namelist() if not n.endswith(archive.MANIFEST)}
    if edit_meta is not None:
        meta = json.loads(members["llm.json"])
        edit_meta(meta)
        members["llm.json"] = json.dumps(meta).encode()
    if edit_members is not None:
        edit_members(members)
    with zipfile.ZipFile(dst, "w") as z:
        for rel, data in members.items():
            z.writestr(prefix + rel, data)
    archive.seal(dst, {"format": "gml-llm-1", "torch": torch.__version__})
    return dst


def _set(path: list, value):
    def edit(meta):
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


HOSTILE = {
    "negative layers": (_set(["spec", "num_layers"], -1), "num_layers"),
    "layers as a string": (_set(["spec", "num_layers"], "2"), "num_layers"),
    "bool for an int": (_set(["spec", "hidden_size"], True), "hidden_size"),
    "heads not a multiple of kv heads": (_set(["spec", "num_kv_heads"], 3), "multiple of num_kv_heads"),
    "huge vocab": (_set(["spec", "vocab_size"], 1 << 40), "vocab_size"),
    "unknown family": (_set(["spec", "family"], "__import__('os')"), "family"),
    "NaN eps": (_set(["spec", "norm_eps"], math.nan), "norm_eps"),
    "extra spec field": (_set(["spec", "exec"], "print(1)"), "exactly the fields"),
    "a shape bigger than the spec": (_set(["tensors", "embed.qweight", "shape"], [100000, 32]), "embed"),
    "a dtype the spec does not allow": (_set(["tensors", "embed.qweight", "dtype"], "int8"), "embed"),
    "a path in a tensor name": (_set(["tensors", "../../etc/passwd"], {"dtype": "uint8", "shape": [1]}), "unexpected"),
    "windows of the wrong length": (_set(["spec", "sliding_windows"], [None]), "sliding_windows"),
    "int4 with a bad group": (_set(["group_size"], 48), "group_size"),
    "int8 with a bad group": (_set(["int8_group_size"], 48), "int8_group_size 48 is not one of"),
    "int8 group as a string": (_set(["int8_group_size"], "32"), "int8_group_size must be an integer"),
    "int8 per channel, scales grouped": (_set(["int8_group_size"], None), "lm_head.scales|embed.scales"),
    "a tied int4 head": (_set(["tied_lm_head"], True), "tensors|tied"),
    "max_length past the RoPE table": (_set(["max_length"], 10**6), "max_length"),
    "another format": (_set(["format"], "gml-llm-99"), "format"),
    "rotary dim past head dim": (_set(["spec", "rotary_dim"], 4096), "rotary_dim"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_field_is_refused_with_a_reason(saved_int4, tmp_path, case):
    edit, reason = HOSTILE[case]
    bad = _rewrite(saved_int4[1], tmp_path / "bad.gml", edit_meta=edit)
    with pytest.raises(ModelLoadError, match=reason) as e:
        gml.load(bad)
    assert "not a valid GML LLM file" in str(e.value)


def _member(name: str, fn):
    def edit(members):
        members[name] = fn(members[name])

    return edit


@pytest.mark.parametrize(
    ("case", "edit", "reason"),
    [
        ("short tensor", _member("tensors/embed.qweight.bin", lambda b: b[:-4]), "bytes"),
        ("long tensor", _member("tensors/embed.qweight.bin", lambda b: b + b"\0" * 4), "bytes"),
        ("NaN scale", _member("tensors/layers.0.qkv.scales.bin", lambda b: b"\xff\xff\xff\x7f" + b[4:]), "NaN"),
        ("zero point 200", _member("tensors/layers.0.o.zeros.bin", lambda b: b"\xc8" + b[1:]), "zero points"),
        ("an extra member", lambda m: m.__setitem__("tensors/evil.pkl", b"cos\nsystem\n"), "unexpected|members"),
        ("a json that is not json", lambda m: m.__setitem__("llm.json", b"{nope"), "does not parse"),
    ],
)
def test_hostile_member_is_refused(saved_int4, tmp_path, case, edit, reason):
    bad = _rewrite(saved_int4[1], tmp_path / "bad.gml", edit_members=edit)
    with pytest.raises(ModelLoadError, match=reason):
        gml.load(bad)


def test_a_flipped_byte_is_damage(saved_int4, tmp_path):
    data = bytearray(saved_int4[1].read_bytes())
    data[len(data) // 2] ^= 0x40
    bad = tmp_path / "flipped.gml"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError):
        gml.load(bad)


def _leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list) and node and not isinstance(node[0], (int, float)):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def test_random_json_mutations_load_or_refuse_cleanly(saved_int4, tmp_path):
    """Every leaf of llm.json replaced by hostile values: the loader either refuses with a GML error
    or returns an LLM that runs (e.g. another finite attention scale is a valid model)."""
    src = saved_int4[1]
    with zipfile.ZipFile(src) as z:
        meta = json.loads(z.read(next(n for n in z.namelist() if n.endswith("/llm.json"))))
    leaves = list(_leaves(meta))
    values = [-1, 0, 1, 3, 2**31, 2**62, 1.5, -0.0, math.inf, "x", "", None, True, [], {}, [1, 2], [-5, 7]]
    rng = random.Random(20261127)
    for i in range(120):
        path, value = rng.choice(leaves), rng.choice(values)
        bad = _rewrite(src, tmp_path / f"m{i}.gml", edit_meta=_set(list(path), value))
        try:
            lm = gml.load(bad)
        except GMLError:
            continue
        logits = lm.logits(PROMPT[: min(len(PROMPT), lm.max_length)])
        assert torch.isfinite(logits).all(), (path, value)


def test_generate_cli_runs_and_saves(tmp_path, capsys):
    from gml.cli import main

    folder = tmp_path / "hf"
    tiny("llama").save_pretrained(folder)
    out = tmp_path / "m.gml"
    assert main(["generate", str(folder), "--weights", "int8", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                 "--max-length", "16", "--save", str(out)]) == 0  # fmt: skip
    first = capsys.readouterr().out
    assert main(["generate", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    again = capsys.readouterr().out
    assert first.splitlines()[0] == again.splitlines()[0]  # the same four token ids
    assert main(["generate", str(out), "--prompt", "hi"]) != 0  # no tokenizer in the file
    captured = capsys.readouterr()
    assert "--tokenizer" in captured.out + captured.err


@pytest.mark.parametrize("command", [["inspect"], ["bench"], ["run", "--input", "x.npy", "--output", "y.npy"]])
def test_graph_commands_refuse_an_llm_file_naming_generate(saved_int4, capsys, command):
    from gml.cli import main

    assert main([command[0], str(saved_int4[1]), *command[1:]]) != 0
    captured = capsys.readouterr()
    assert "gml generate" in captured.out + captured.err
