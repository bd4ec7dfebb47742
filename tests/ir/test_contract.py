"""gml.ir is the contract: it imports no other gml package, gml has no import circle (counting
imports inside functions), each vocabulary fact is defined once, and docs/ir.md shows the op
schemas as they are."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gml

SRC = Path(gml.__file__).parent
ROOT = SRC.parent.parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """gml modules ``path`` imports (``top_level_only``: at import time, not inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # look into top-level try/if blocks too, but not into defs
        stack, nodes = list(tree.body), []
        while stack:
            n = stack.pop()
            nodes.append(n)
            if isinstance(n, ast.Try | ast.If):
                stack.extend(n.body + n.orelse + [h for x in getattr(n, "handlers", []) for h in x.body])
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith("gml")}
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("gml") and n.level == 0:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path, top_level_only) if m in files and m != name}
    return graph


def test_ir_imports_no_other_gml_package():
    for path in (SRC / "ir").rglob("*.py"):
        bad = {m for m in _imports(path, top_level_only=False) if not (m == "gml.ir" or m.startswith("gml.ir."))}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle_between_modules():
    # imports at any level, inside functions too: a function-level import that closes a circle is
    # still a circle (the two modules cannot be understood, tested or moved apart), it only defers
    # the failure to run time. Package __init__ re-exports are excluded: they import their children
    # by design.
    graph = _graph(top_level_only=False)
    graph = {k: {m for m in v if not k.startswith(m + ".") and not m.startswith(k + ".")} for k, v in graph.items()}
    assert _cycle(graph) is None, " → ".join(_cycle(graph) or [])


def test_the_circle_check_sees_imports_inside_functions(tmp_path):
    # the check itself: a circle closed by an import inside a function is found (the
    # runtime translate <-> transformer_rules circle was one, invisible to a module-level check)
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from gml.b import g\n")
    b.write_text("def g():\n    from gml.a import f\n    return f\n")
    graph = {
        "gml.a": _imports(a, top_level_only=False) & {"gml.b"},
        "gml.b": _imports(b, top_level_only=False) & {"gml.a"},
    }
    assert _cycle(graph) == ["gml.a", "gml.b", "gml.a"]
    assert _imports(b, top_level_only=True) == set()


def test_engine_switches_are_read_from_the_environment_in_one_place():
    # options are values carried from the API (gml.runtime.options.EngineOptions); the GML_*
    # variables only set their defaults there, never deep in the runtime or the quantizer
    names = ("GML_WINOGRAD", "GML_ATTENTION", "GML_COST_POLICY")
    readers = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(re.search(rf"[\"']{n}[\"']", p.read_text()) for n in names)
    )
    assert readers == ["runtime/options.py"]


def test_kernel_interface_imports_no_implementation():
    # the interface (backend.py) and the implementations (onednn/fbgemm) meet only in the registry
    imports = _imports(SRC / "kernels" / "backend.py", top_level_only=False)
    assert not imports & {"gml.kernels.onednn_int8", "gml.kernels.fbgemm_int8", "gml.kernels.registry"}


def _definitions(pattern: str) -> list[str]:
    rx = re.compile(pattern, re.MULTILINE)
    return sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if rx.search(p.read_text()))


def test_each_vocabulary_fact_is_defined_once():
    assert _definitions(r"^def is_dequantize\(") == ["ir/qdq.py"]
    assert _definitions(r"^def is_quantize\(") == ["ir/qdq.py"]
    assert _definitions(r"^class QParams\b") == ["ir/values.py"]
    assert _definitions(r"^class PostOp\b") == ["ir/values.py"]
    assert _definitions(r"^class \w*ConvSpec\b|^class Conv2dSpec\b") == ["ir/values.py"]
    assert _definitions(r"^_?VIEW_METHODS\s*[:=]") == ["ir/alias.py"]
    assert _definitions(r"^def (writes_in_place|returns_alias|written_in_place)\(") == ["ir/alias.py"]
    assert _definitions(r"^ACTIVATION_KINDS\s*[:=]") == ["ir/ops.py"]
    assert _definitions(r"^OPS: tuple\[OpSpec|^SPECS\s*[:=]|^class OpSpec\b") == ["ir/ops.py"]
    # no module recognised by its class name (ADR 005)
    assert _definitions(r"type\([^)]*\)\.__name__\s*(==|!=|in)") == []


def test_docs_ir_table_is_the_op_table():
    from gml.ir import library

    doc = (ROOT / "docs" / "ir.md").read_text()
    rows = dict(re.findall(r"^\| `gml::(\w+)` \| `(.+)` \|$", doc, re.MULTILINE))
    own = {name: d.schema for name, d in library.vocabulary().items() if d is not None}
    assert rows == {**library.SCHEMAS, **own}


def test_every_op_has_a_python_implementation_and_a_fake_kernel():
    import torch

    from gml.ir import library
    from gml.kernels.int8_ops import IMPLEMENTATIONS, register

    register()
    assert set(IMPLEMENTATIONS) == set(library.SCHEMAS)
    for name in library.SCHEMAS:
        qual = f"gml::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta"), name
    for name, d in library.vocabulary().items():  # ops of their own module: one kernel for every device
        if d is not None:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gml::{name}", "CompositeExplicitAutograd"), name
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gml::{name}", "Meta"), name
