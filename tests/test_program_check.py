"""A saved model's ``model.json`` is data: no field of it can run code (issue #24, gml.program_check).

The hostile files are built as an attacker would: from a real ``gml.io.save`` output, with
``model.json`` edited *and the manifest re-sealed*, so only the field checks stand between the
edit and torch.fx's code generator, sympy's ``eval`` and the guard compiler.

The property test mutates every string, number and list of ``model.json`` of a real fp32 and a real
INT8 model (``GML_MUTATIONS`` of them, 2,000 by default, every field at least once) and asserts that
loading each gives a clear ``gml`` error or a model that loads — never a crash, a file written, a
process spawned or code compiled that GML's own code generation would not write (an audit hook
watches ``os.system``, ``subprocess.Popen``, exec/spawn/fork, opening a file for writing, and every
``compile`` of source that is not an installed module's file).
"""

from __future__ import annotations

import ast
import copy
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import archive_edit as ae
import gml
from gml import program_check
from gml.errors import GMLError, ModelLoadError

SENTINEL = Path(f"/tmp/gml-program-pwned-{os.getpid()}")
RUN = f"__import__('os').system('touch {SENTINEL}')"
INJECTIONS = [
    f"*[True for _ in [{RUN}]]) or dict(b",  # the issue's kwarg name
    RUN,
    f"x\r{RUN}",
    f"x\n{RUN}",
    f"L['x'].size()[0] == {RUN}",
    f"Symbol('s0', positive={RUN})",
    "torch._C._set_grad_enabled",
    "torch.ops.aten.from_file.default",
    "builtins.eval",
    "os.system",
    "__class__",
    "a" * 5000,
    "",
]


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU()
    )
    head = nn.Sequential(conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return {"cnn": (head.eval(), torch.randn(2, 3, 12, 12))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    out = {}
    d = tmp_path_factory.mktemp("programs")
    for name, (model, x) in _models().items():
        gml.optimize(model, x).save(str(d / f"{name}_fp32.pt2"))
        q = gml.quantize(model, 4, example_inputs=x, cost_policy="off")
        assert q.precision == "int8"
        q.save(str(d / f"{name}_int8.pt2"))
        out[f"{name}_fp32"], out[f"{name}_int8"] = d / f"{name}_fp32.pt2", d / f"{name}_int8.pt2"
    return out


@pytest.fixture(autouse=True)
def _no_sentinel():
    SENTINEL.unlink(missing_ok=True)
    yield
    assert not SENTINEL.exists(), "a payload in the file ran"


def _nodes(program: dict[str, Any]) -> list[dict[str, Any]]:
    return program["graph_module"]["graph"]["nodes"]


# --------------------------------------------------------------------------------------------------
# the attacks the issue names, one by one
# --------------------------------------------------------------------------------------------------


def test_the_issues_kwarg_name_injection_is_refused(saved, tmp_path):
    program = ae.program(saved["cnn_fp32"])
    node = _nodes(program)[0]
    node["target"] = "torch._C._set_grad_enabled"
    node["inputs"] = [{"name": INJECTIONS[0], "arg": {"as_bool": True}, "kind": 2}]
    with pytest.raises(ModelLoadError, match="refused"):
        gml.load(ae.with_program(saved["cnn_fp32"], tmp_path / "a.pt2", program))
    # the same name on an op that is allowed
    program = ae.program(saved["cnn_fp32"])
    _nodes(program)[0]["inputs"][0]["name"] = INJECTIONS[0]
    with pytest.raises(ModelLoadError, match="not a plain identifier"):
        gml.load(ae.with_program(saved["cnn_fp32"], tmp_path / "b.pt2", program))


@pytest.mark.parametrize(
    "where",
    ["node name", "tensor name", "parameter name", "guard", "range symbol", "stack trace", "target"],
)
def test_code_in_any_named_field_is_refused_or_inert(saved, tmp_path, where):
    program = ae.program(saved["cnn_int8"])
    gm = program["graph_module"]
    if where == "node name":
        _nodes(program)[1]["name"] = RUN
    elif where == "tensor name":
        _nodes(program)[1]["outputs"][0]["as_tensor"]["name"] = RUN
    elif where == "parameter name":
        spec = next(s for s in gm["signature"]["input_specs"] if "parameter" in s or "buffer" in s)
        body = next(iter(spec.values()))
        body[next(k for k in body if k.endswith("_name"))] = f"a.{RUN}"
    elif where == "guard":
        program["guards_code"] = [f"L['x'].size()[0] == {RUN}"]
    elif where == "range symbol":
        program["range_constraints"] = {RUN: {"min_val": 1, "max_val": 4}}
    elif where == "stack trace":  # free text: dropped before torch sees it
        _nodes(program)[1]["metadata"]["stack_trace"] = f'File "x.py", line 1, in f\n    y\r{RUN}\n'
    elif where == "target":
        _nodes(program)[1]["target"] = "torch.ops.aten.from_file.default"
    path = ae.with_program(saved["cnn_int8"], tmp_path / "m.pt2", program)
    if where == "stack trace":
        gml.load(path)  # loads: the metadata never reaches generated code
    else:
        with pytest.raises(ModelLoadError, match="refused"):
            gml.load(path)


def test_a_sympy_expression_that_would_run_code_is_refused():
    with pytest.raises(program_check.Refused, match="shape expression"):
        program_check.STRING_RULES[("SymExpr", "expr_str")](RUN, "x")
    for ok in ["s0 + 1", "Mul(Integer(32), Symbol('s53', positive=True, integer=True))", "Max(1, FloorDiv(s0, 2))"]:
        program_check.STRING_RULES[("SymExpr", "expr_str")](ok, "x")


def test_a_guard_is_a_shape_comparison_and_nothing_else():
    rule = program_check.STRING_RULES[("ExportedProgram", "guards_code")]
    rule("L['input_ids'].size()[1] <= 512", "g")
    rule("L['attention_mask'].size()[1] == L['input_ids'].size()[1]", "g")
    # timm LeViT's: torch writes torch.sym_max (the guard's namespace holds torch)
    rule("(256 * (L['x'].size()[3] // 16)) != (128 * torch.sym_max(1, L['x'].size()[2] // 16))", "g")
    for bad in [RUN, "L['x'].__class__", "L[x].size()[0] == 1", "(lambda: 1)() == 1", "L['x'].size()[0] == 'a'",
                "torch.load('x') == 1", "torch.sym_max(1, x=2) == 1", "torch.sym_max(1, L['x'].__class__) == 1",
                "os.sym_max(1, 2) == 1", "torch.sym_max.__globals__ == 1"]:  # fmt: skip
        with pytest.raises(program_check.Refused):
            rule(bad, "g")


def test_a_qconv_stride_of_zero_is_refused_before_any_kernel_sees_it(saved, tmp_path):
    program = ae.program(saved["cnn_int8"])
    qconv = next(n for n in _nodes(program) if n["target"] == "torch.ops.gml.qconv.default")
    stride = next(a for a in qconv["inputs"] if a["name"] == "stride")
    stride["arg"]["as_ints"] = [0, 0]
    with pytest.raises(ModelLoadError, match="stride must hold integers in"):
        gml.load(ae.with_program(saved["cnn_int8"], tmp_path / "m.pt2", program))


@pytest.mark.parametrize("key", ["cnn_fp32", "cnn_int8"])
@pytest.mark.parametrize("runtime", ["engine", "torch"])
def test_a_program_edited_so_it_no_longer_runs_on_its_example_is_refused_at_load(saved, tmp_path, key, runtime):
    """Every field passes its own check (a flatten's start dim is any dim), but the program no longer
    runs on the inputs it was saved (exported) with: the file was altered. Before, it loaded on the
    torch path and its first call raised torch's ``mat1 and mat2 shapes cannot be multiplied`` (an
    INT8 file was also saved without its example: it ran on batch 1, where that edit still runs)."""
    program = ae.program(saved[key])
    flatten = next(n for n in _nodes(program) if n["target"] == "torch.ops.aten.flatten.using_ints")
    next(a for a in flatten["inputs"] if a["name"] == "start_dim")["arg"]["as_int"] = 0
    refused = r"does not run on the inputs it was saved with: .* of shape \(2, 3, 12, 12\)"
    with pytest.raises(ModelLoadError, match=refused):
        gml.load(ae.with_program(saved[key], tmp_path / "m.pt2", program), runtime=runtime)


def test_a_tensor_reaching_past_its_member_is_refused(saved, tmp_path):
    _, members = ae.members(saved["cnn_fp32"])
    name = next(n for n in members if n.endswith("_weights_config.json"))
    config = json.loads(members[name])
    entry = next(iter(config["config"].values()))
    entry["tensor_meta"]["storage_offset"] = {"as_int": 1 << 20}
    edit = {name: json.dumps(config).encode()}
    path = ae.with_program(saved["cnn_fp32"], tmp_path / "m.pt2", ae.program(saved["cnn_fp32"]), **edit)
    with pytest.raises(ModelLoadError, match="reaches"):
        gml.load(path)


def test_a_member_larger_than_its_tensors_need_is_refused_before_it_is_read(saved, tmp_path):
    """A member that holds far more than the graph needs (a zip bomb inflates to such a member) is
    refused from the sizes the archive declares, before torch allocates it."""
    _, found = ae.members(saved["cnn_fp32"])
    weight = next(n for n in found if n.startswith("data/weights/weight_"))
    path = ae.with_program(
        saved["cnn_fp32"], tmp_path / "m.pt2", ae.program(saved["cnn_fp32"]), **{weight: bytes(64 << 20)}
    )
    with pytest.raises(ModelLoadError, match="its tensors need"):
        gml.load(path)


def test_saved_models_still_load_and_run(saved):
    _, x = _models()["cnn"]
    for path in saved.values():
        m = gml.load(path)
        assert torch.isfinite(m(x)).all()


# --------------------------------------------------------------------------------------------------
# the property: every field mutated
# --------------------------------------------------------------------------------------------------


def _leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Paths to every string, number, bool and list in a JSON value (lists themselves included)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        yield path
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _get(value: Any, path: tuple) -> Any:
    for p in path:
        value = value[p]
    return value


def _set(value: Any, path: tuple, new: Any) -> None:
    _get(value, path[:-1])[path[-1]] = new


def _mutant(leaf: Any, rng: random.Random, strings: list[str]) -> Any:
    if isinstance(leaf, bool):
        return not leaf
    if isinstance(leaf, int):
        return rng.choice([0, -1, 1, leaf + 1, leaf - 1, 1 << 40, -(1 << 63), (1 << 63) - 1, leaf * 1000])
    if isinstance(leaf, float):
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e308, leaf * 1000])
    if isinstance(leaf, str):
        return rng.choice([*INJECTIONS, rng.choice(strings), leaf + "x", leaf.upper()])
    if isinstance(leaf, list):
        choices: list[Any] = [[], leaf * 2, leaf[::-1], leaf[1:], [{"as_none": True}], [RUN]]
        return rng.choice(choices)
    return rng.choice(INJECTIONS)


class _Audit:
    """An audit hook that records what must never happen while a hostile file loads."""

    SPAWN = ("os.system", "subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "pty.spawn")

    def __init__(self) -> None:
        self.active = False
        self.events: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event.startswith(self.SPAWN):
            self.events.append(f"{event}{args!r:.200}")
        elif event == "open" and len(args) > 1 and isinstance(args[1], str) and set(args[1]) & set("wax+"):
            self.events.append(f"open for writing {args[0]!r:.200}")
        elif (
            event == "compile"
            and args
            and isinstance(args[0], str | bytes)
            and not _is_module_file(args[1:2])
            and not _parse_only(sys._getframe(1))
        ):
            self.active = False  # _foreign_code's own ast.parse raises a compile event
            try:
                reason = _foreign_code(args[0] if isinstance(args[0], str) else args[0].decode(errors="replace"))
            finally:
                self.active = True
            if reason:
                self.events.append(f"compile of {reason}: {str(args[0])[:200]!r}")


def _parse_only(frame: Any) -> bool:
    """``ast.parse`` (the checker reading a guard or expression): compiles to a tree, runs nothing."""
    code = frame.f_code if frame is not None else None
    return code is not None and code.co_name == "parse" and code.co_filename.endswith(f"{os.sep}ast.py")


def _is_module_file(filename: tuple) -> bool:
    """An import compiling an installed module's source (not code generated at run time)."""
    name = filename[0] if filename else None
    return isinstance(name, str) and name.endswith(".py") and Path(name).is_file()


#: what a payload needs and generated code never names (fx does use getattr(self, "0") for odd attributes)
_FORBIDDEN_NAMES = {"__import__", "eval", "exec", "open", "compile", "globals", "__builtins__", "os", "subprocess"}


def _foreign_code(source: str) -> str | None:
    """Why ``source`` is not code GML's or torch.fx's generator writes for a checked graph, or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # not Python (a regex, a sympy string already rejected...): nothing compiled runs
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _FORBIDDEN_NAMES:
            return f"the name {node.id}"
        if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp):
            return "a comprehension"
        if isinstance(node, ast.Attribute) and node.attr in ("system", "popen", "__subclasses__", "__globals__"):
            return f"the attribute {node.attr}"
    return None


@pytest.fixture(scope="module")
def audit() -> _Audit:
    hook = _Audit()
    sys.addaudithook(hook)  # cannot be removed: it stays inactive outside the property test
    return hook


def test_mutating_any_field_gives_a_gml_error_or_a_model_never_code(saved, tmp_path, audit, monkeypatch):
    """Every mutant is refused (a GMLError) or loads; one the engine runs, called at another batch,
    runs or raises a GMLError (the first call of a shape names it: gml.runtime.compile.run_first_call)."""
    # gml.load hands memory back after each call (a full gc.collect: slow in a test process this big);
    # what is tested here is what a file can do, not what a load keeps
    monkeypatch.setattr(gml.memory, "trim_malloc", lambda: True)
    total = int(os.environ.get("GML_MUTATIONS", "2000"))
    rng = random.Random(20261127)
    outcomes = {"refused": 0, "loaded": 0}
    per_file = total // len(saved)
    for key, src in saved.items():
        program = ae.program(src)
        paths = list(_leaves(program))
        strings = [s for p in paths if isinstance(s := _get(program, p), str)]
        rng.shuffle(paths)
        for i in range(per_file):
            path = paths[i % len(paths)]
            mutated = copy.deepcopy(program)
            _set(mutated, path, _mutant(_get(mutated, path), rng, strings)) if path else None
            dst = ae.with_program(src, tmp_path / "m.pt2", mutated)
            audit.active = True
            try:
                # every 4th load also builds the native engine's plan (the slow part); the checks that
                # keep a hostile argument from it run before either runtime sees the graph
                model = gml.load(dst, runtime="engine" if i % 4 == 0 else "torch")
                outcomes["loaded"] += 1
                # a call at another batch than the load check's, where the engine runs it (a program
                # can fail there; the graph itself, on the torch path, raises what torch raises), and
                # one at the example's shape on either path
                with torch.no_grad():
                    if i % 8 == 0 and not isinstance(model, torch.fx.GraphModule):
                        model(torch.randn(3, 3, 12, 12))
                    elif i % 8 == 1:  # at the saved example's shape, it runs on either path (load checked it)
                        model(torch.randn(2, 3, 12, 12))
            except GMLError:
                outcomes["refused"] += 1
            except Exception as e:  # a raw error: a check is missing
                raise AssertionError(f"{key}: mutating {path} gave {type(e).__name__}: {e}") from e
            finally:
                audit.active = False
            assert not audit.events, f"{key}: mutating {path}: {audit.events[:3]}"
            assert not SENTINEL.exists()
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == per_file * len(saved)
