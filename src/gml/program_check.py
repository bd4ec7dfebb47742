"""Check every field of a saved program before torch builds anything from it (issue #24, ADR 004).

A ``.pt2`` holds no pickle (:mod:`gml.archive` refuses one), yet ``torch.export.load`` still trusts
the program's ``model.json``: node and argument *names* are pasted into the ``forward`` that torch.fx
generates and ``exec``s, symbolic-shape strings go to ``sympy.sympify`` (which ``eval``s), the
``guards_code`` strings are pasted into a generated guard function, node targets are looked up as
attributes of ``torch`` / ``operator`` / ``math`` and called, and node metadata (stack traces) is
written into the generated source as comments. Anyone can re-seal a manifest, so a hand-edited
``model.json`` runs code on load. Hence, before anything is deserialized:

* :func:`check_program` walks the JSON **against torch's own serialization schema**
  (``torch._export.serde.schema``: every dataclass field, every union arm) and admits a value only
  when a rule of this module says what it may be. A string field with no rule here is refused, so
  a field a newer torch adds is refused until someone decides what it may hold. The rules:
  names are Python identifiers (not keywords, not dunders); attribute paths are dotted identifiers
  or indices; targets are on GML's allow-list (:func:`target_allowed`); a symbolic expression and a
  guard parse (``ast``, never evaluated) into a small grammar of integers, symbols ``s0``/``u3``,
  arithmetic, comparisons, ``L['input'].size()[i]`` and torch's named sympy functions; string
  arguments are short printable text; every device is the CPU; sizes, strides and offsets are
  non-negative and bounded; the keyword names of an op call are its schema's argument names.
* :func:`check_payloads` checks the weights / constants configs: every tensor's extent
  (``offset + sum((size - 1) * stride) + 1`` elements) fits in the member that holds it, and no
  member is larger than the largest tensor it backs (a member that inflates to far more than the
  graph needs is refused before torch allocates it).
* :func:`sanitized` drops node metadata (stack traces, module stacks: nothing GML reads), so no
  free text reaches generated code.

What an aten op does with its arguments is checked by the op's own kernel; the few aten ops that
do not check (the ``_unsafe_*`` indexing ops), read files (``from_file``) or point a tensor at raw
storage (``set_``) are not on the allow-list. The ranges of GML's own ops' arguments (strides >= 1,
...) are checked after deserialization by :func:`gml.ir.checks.check_graph`.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import keyword
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch._export.serde import schema

from gml.errors import ModelLoadError

#: Bounds that no model GML writes comes near; they keep a hostile file from exhausting memory.
MAX_NAME = 256
MAX_TEXT = 1024
MAX_EXPR = 4096
MAX_DIM = 1 << 40
MAX_NUMEL = 1 << 31  # elements of one tensor (a batch-1 activation of any GML model is far below)
MAX_INT = (1 << 63) - 1

_SYMBOL = re.compile(r"[a-z]{1,3}\d{1,9}")  # torch's shape symbols: s0, u12, ...
#: a module name torch.fx writes as ``getattr(self, 'name')`` when not an identifier: torchvision's
#: RegNet names its blocks ``block1-0`` (files of it were refused); no quote, dot or space can occur
_SEGMENT = re.compile(r"[A-Za-z0-9_-]{1,256}")
_NUMBER = re.compile(r"-?\d{1,40}(\.\d{0,40})?(e[-+]?\d{1,4})?")
_VERSION = re.compile(r"[0-9A-Za-z.+_-]{1,64}")
_PAYLOAD = re.compile(r"(weight|tensor)_\d{1,9}")


class Refused(ModelLoadError):
    """A field of the saved program that GML does not admit."""


def _refuse(path: str, what: str) -> Refused:
    return Refused(
        f"the saved program was refused: {path} {what}; nothing in it was built or run",
        hint="gml.io.save never writes such a value: the file was not written by gml, or was altered on purpose",
    )


# --------------------------------------------------------------------------------------------------
# string rules
# --------------------------------------------------------------------------------------------------


def is_identifier(s: str) -> bool:
    """A Python identifier that is not a keyword and not a dunder (``__class__``, ``__import__``)."""
    dunder = s.startswith("__") and s.endswith("__")
    return len(s) <= MAX_NAME and s.isidentifier() and s.isascii() and not keyword.iskeyword(s) and not dunder


def _name(s: str, path: str) -> None:
    if not is_identifier(s):
        raise _refuse(path, f"= {s[:80]!r} is not a plain identifier")


def _fqn(s: str, path: str) -> None:
    """A module attribute path: ``layer1.0.conv1.weight`` (empty for the root module)."""
    if s == "":
        return
    parts = s.split(".")
    # a segment is an attribute name torch.fx writes as getattr(self, 'name') when not an identifier
    if len(s) > 4 * MAX_NAME or not all(_SEGMENT.fullmatch(p) and not p.startswith("__") for p in parts):
        raise _refuse(path, f"= {s[:80]!r} is not a dotted attribute path")


def _text(s: str, path: str) -> None:
    """A string argument of an op (``'relu'``, ``'tanh'``, ``''``): short, printable, one line."""
    if len(s) > MAX_TEXT or not s.isascii() or not s.isprintable():
        raise _refuse(path, f"= {s[:80]!r} is not a short printable string")


def _cpu(s: str, path: str) -> None:
    if s != "cpu":
        raise _refuse(path, f"= {s[:40]!r}: GML models run on the CPU")


def _version(s: str, path: str) -> None:
    if not _VERSION.fullmatch(s):
        raise _refuse(path, f"= {s[:80]!r} is not a version string")


def _verifier(s: str, path: str) -> None:
    if s not in ("ATEN", "TRAINING", ""):
        raise _refuse(path, f"= {s[:40]!r} is not a torch.export dialect")


def _payload_path(s: str, path: str) -> None:
    if not _PAYLOAD.fullmatch(s):
        raise _refuse(path, f"= {s[:80]!r} is not a plain tensor")


#: torch's sympy functions (the deserializer's ``sympy_functions``) and sympy's own that torch prints.
SYMPY_FUNCTIONS = frozenset(
    {
        *("FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt"),
        *("CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv"),
        *("TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity"),
        *("OpaqueUnaryFn_sqrt", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or"),
        *("Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan"),
        *("And", "Or", "Not", "Integer", "Rational", "Mul", "Add", "Pow", "BooleanTrue", "BooleanFalse"),
    }
)
_SYMPY_CONSTANTS = frozenset({"oo", "zoo", "nan", "true", "false", "True", "False"})
_SYMBOL_ASSUMPTIONS = frozenset({"positive", "integer", "real", "nonnegative", "finite", "negative", "nonzero"})
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY = (ast.USub, ast.UAdd, ast.Not)
_COMPARE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_SHAPE_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
#: the functions of ``torch`` a guard may call (torch.export writes them; the guard's namespace has torch)
_TORCH_SYM_FUNCTIONS = frozenset({"sym_max", "sym_min"})


def _parse(s: str, path: str) -> ast.Expression:
    if len(s) > MAX_EXPR or not s.isascii() or not s.isprintable():
        raise _refuse(path, f"= {s[:80]!r} is not a short one-line expression")
    try:
        return ast.parse(s, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _refuse(path, f"= {s[:80]!r} does not parse ({type(e).__name__})") from None


def _common(node: ast.AST, walk: Callable[[ast.AST], None]) -> bool:
    """Arithmetic, comparisons and number constants, shared by both grammars; True if ``node`` was one."""
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool) or (type(node.value) is int and abs(node.value) > MAX_INT):
            raise ValueError("a constant that is not a number")
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITH):
        walk(node.left)
        walk(node.right)
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY):
        walk(node.operand)
        return True
    if isinstance(node, ast.Compare) and all(isinstance(op, _COMPARE) for op in node.ops):
        walk(node.left)
        for c in node.comparators:
            walk(c)
        return True
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            walk(v)
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SYMPY_FUNCTIONS:
        if node.keywords:
            raise ValueError(f"keywords in a call of {node.func.id!r}")
        for a in node.args:
            walk(a)
        return True
    return False


def _grammar(s: str, path: str, walk: Callable[[ast.AST], None], what: str) -> None:
    """Parse ``s`` and walk its tree with ``walk`` (which raises ValueError naming what is not allowed)."""
    try:
        walk(_parse(s, path).body)
    except ValueError as e:
        raise _refuse(path, f"= {s[:80]!r} is not {what}: it holds {e}") from None


def _sym_expr(s: str, path: str) -> None:
    """A sympy expression as torch prints it: ``s0 + 1``, ``Symbol('s72', positive=True, integer=True)``,
    ``Max(1, FloorDiv(s0, 2))``. Parsed with ``ast`` and walked; never evaluated here."""

    def walk(node: ast.AST) -> None:
        if _common(node, walk):
            return
        if isinstance(node, ast.Name):
            if not (_SYMBOL.fullmatch(node.id) or node.id in SYMPY_FUNCTIONS or node.id in _SYMPY_CONSTANTS):
                raise ValueError(f"the name {node.id!r}")
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "Symbol":
                first = node.args[0] if len(node.args) == 1 else None
                named = isinstance(first, ast.Constant) and isinstance(first.value, str)
                if not (named and _SYMBOL.fullmatch(first.value)):
                    raise ValueError("a Symbol that is not a shape symbol")
                for kw in node.keywords:
                    if kw.arg not in _SYMBOL_ASSUMPTIONS or not (
                        isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool)
                    ):
                        raise ValueError(f"the Symbol assumption {kw.arg!r}")
                return
            if node.func.id == "Float":  # Float('0.5', precision=53)
                first = node.args[0] if len(node.args) == 1 else None
                numeric = isinstance(first, ast.Constant) and (
                    type(first.value) in (int, float)
                    or (isinstance(first.value, str) and _NUMBER.fullmatch(first.value))
                )
                if not numeric or any(
                    kw.arg != "precision" or not isinstance(kw.value, ast.Constant) for kw in node.keywords
                ):
                    raise ValueError("a Float that is not a number")
                return
            raise ValueError(f"a call of {node.func.id!r}")
        raise ValueError(f"a {type(node).__name__}")

    _grammar(s, path, walk, "a shape expression")


def _guard(s: str, path: str) -> None:
    """An export guard: ``L['input_ids'].size()[1] <= 512``, ``L['a'].size()[1] == L['b'].size()[1]``.
    torch pastes it into generated code, so only this grammar passes."""

    def input_ref(node: ast.AST) -> None:  # L['name'] or L['name'][0] / ['key'] (pytree paths)
        while isinstance(node, ast.Subscript):
            key = node.slice
            if not (
                isinstance(key, ast.Constant)
                and ((isinstance(key.value, str) and is_identifier(key.value)) or type(key.value) is int)
            ):
                raise ValueError("an input path that is not names and indices")
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == "L"):
            raise ValueError("a subscript of something other than the inputs L")

    def walk(node: ast.AST) -> None:
        if _common(node, walk):
            return
        if isinstance(node, ast.Subscript):  # L[...].size()[i]
            call = node.value
            if not (
                isinstance(node.slice, ast.Constant)
                and type(node.slice.value) is int
                and isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in _SHAPE_METHODS
                and not call.args
                and not call.keywords
            ):
                raise ValueError("a subscript that is not an input's size or stride")
            input_ref(call.func.value)
            return
        if (  # torch.sym_max(1, ...) (a timm LeViT's attention-bias guard): a max of two sizes
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in _TORCH_SYM_FUNCTIONS
            and not node.keywords
        ):
            for a in node.args:
                walk(a)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # L[...].storage_offset()
            if node.func.attr not in _SHAPE_METHODS or node.args or node.keywords:
                raise ValueError(f"a call of {node.func.attr!r}")
            input_ref(node.func.value)
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            raise ValueError(f"a call of {node.func.id!r}")
        raise ValueError(f"a {type(node).__name__}")

    _grammar(s, path, walk, "a shape guard")


def _treespec(s: str, path: str) -> None:
    """``in_spec`` / ``out_spec``: torch's JSON treespec; container types torch registered, string
    context keys that are identifiers (dict keys, ``ModelOutput`` fields)."""
    import json

    if len(s) > 1 << 20:
        raise _refuse(path, "is too long for an input/output structure")
    try:
        version, spec = json.loads(s)
    except (ValueError, TypeError):
        raise _refuse(path, "is not a treespec") from None

    def walk(node: Any, depth: int) -> None:
        if depth > 64 or not isinstance(node, dict) or set(node) - {"type", "context", "children_spec"}:
            raise _refuse(path, "is not a treespec")
        t = node.get("type")
        if t is not None and t not in _CONTAINERS and not _model_output(t):
            raise _refuse(path, f"names the container type {str(t)[:80]!r}, which GML models do not return")
        context = node.get("context")
        if isinstance(context, str) and context not in ("null", ""):
            try:
                keys = json.loads(context)
            except ValueError:
                raise _refuse(path, "has a context that is not JSON") from None
            for k in keys if isinstance(keys, list) else [keys]:
                if isinstance(k, str) and not is_identifier(k):
                    raise _refuse(path, f"has the key {k[:80]!r}, not an identifier")
                if not isinstance(k, str | int | type(None)):
                    raise _refuse(path, "has a context key that is not a name or index")
        elif context is not None and not isinstance(context, str):
            raise _refuse(path, "has a context that is not JSON text")
        children = node.get("children_spec", [])
        if not isinstance(children, list):
            raise _refuse(path, "is not a treespec")
        for c in children:
            walk(c, depth + 1)

    if type(version) is not int:
        raise _refuse(path, "is not a treespec")
    walk(spec, 0)


#: The containers a GML model's inputs and outputs come in (no defaultdict, deque or namedtuple: their
#: treespec contexts name modules that torch would import).
_CONTAINERS = frozenset(
    {
        *("builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict", "torch.Size"),
        *("torch.fx.immutable_collections.immutable_list", "torch.fx.immutable_collections.immutable_dict"),
    }
)


def _model_output(type_name: str) -> bool:
    """A Hugging Face ``ModelOutput`` class that transformers registered with torch's pytree.

    transformers registers its output classes when ``transformers.modeling_outputs`` is imported: that
    module (a fixed name, from the installed package, never from the file) is imported here if needed."""
    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE

    if not type_name.startswith("transformers.") or not all(is_identifier(p) for p in type_name.split(".")):
        return False
    if type_name not in SERIALIZED_TYPE_TO_PYTHON_TYPE:
        try:
            import transformers.modeling_outputs  # noqa: F401
        except ImportError:
            raise ModelLoadError(
                f"the saved model returns a {type_name}, and transformers is not installed",
                hint="pip install 'gml-lab[transformers]' to load models optimized from Hugging Face",
            ) from None
    cls = SERIALIZED_TYPE_TO_PYTHON_TYPE.get(type_name)
    return isinstance(cls, type) and cls.__module__.startswith("transformers.")


def _refused_field(s: str, path: str) -> None:
    raise _refuse(path, "is a field GML never writes")


def _free(s: str, path: str) -> None:
    """Metadata text: dropped by :func:`sanitized` before deserialization, only bounded here."""
    if len(s) > 1 << 16:
        raise _refuse(path, "is too long")


#: ``(schema class, field)`` -> the rule for its strings (the field's own strings, a list's items);
#: ``(class, field, "key")`` -> the rule for a dict field's keys. A string field without a rule is refused.
STRING_RULES: dict[tuple[str, ...], Callable[[str, str], None]] = {
    ("Device", "type"): _cpu,
    ("SymExpr", "expr_str"): _sym_expr,
    ("SymIntArgument", "as_name"): _name,
    ("SymFloatArgument", "as_name"): _name,
    ("SymBoolArgument", "as_name"): _name,
    ("TensorArgument", "name"): _name,
    ("TokenArgument", "name"): _name,
    ("GraphArgument", "name"): _refused_field,  # a subgraph (higher-order op): GML emits none
    ("CustomObjArgument", "name"): _refused_field,
    ("CustomObjArgument", "class_fqn"): _refused_field,
    ("Argument", "as_string"): _text,
    ("Argument", "as_strings"): _text,
    ("Argument", "as_operator"): _refused_field,
    ("Argument", "as_string_to_argument", "key"): _name,
    ("NamedArgument", "name"): _name,
    ("Node", "target"): lambda s, path: _target(s, path),
    ("Node", "name"): _name,
    ("Node", "metadata", "key"): _free,
    ("Node", "metadata"): _free,
    ("Graph", "tensor_values", "key"): _name,
    ("Graph", "sym_int_values", "key"): _name,
    ("Graph", "sym_bool_values", "key"): _name,
    ("Graph", "sym_float_values", "key"): _name,
    ("Graph", "custom_obj_values", "key"): _refused_field,
    ("ConstantValue", "as_string"): _text,
    ("InputToConstantInputSpec", "name"): _name,
    ("InputToParameterSpec", "parameter_name"): _fqn,
    ("InputToBufferSpec", "buffer_name"): _fqn,
    ("InputToTensorConstantSpec", "tensor_constant_name"): _fqn,
    ("InputToCustomObjSpec", "custom_obj_name"): _refused_field,
    ("BufferMutationSpec", "buffer_name"): _fqn,
    ("ParameterMutationSpec", "parameter_name"): _fqn,
    ("GradientToParameterSpec", "parameter_name"): _refused_field,
    ("GradientToUserInputSpec", "user_input_name"): _refused_field,
    ("UserInputMutationSpec", "user_input_name"): _name,
    ("ModuleCallSignature", "in_spec"): _treespec,
    ("ModuleCallSignature", "out_spec"): _treespec,
    ("ModuleCallSignature", "forward_arg_names"): _name,
    ("ModuleCallEntry", "fqn"): _fqn,
    ("NamedTupleDef", "field_names"): _name,
    ("GraphModule", "metadata", "key"): _free,
    ("GraphModule", "metadata"): _free,
    ("GraphModule", "treespec_namedtuple_fields", "key"): _fqn,
    ("ExportedProgram", "opset_version", "key"): _name,
    ("ExportedProgram", "range_constraints", "key"): lambda s, path: _sym_expr(s, path),
    ("ExportedProgram", "verifiers"): _verifier,
    ("ExportedProgram", "torch_version"): _version,
    ("ExportedProgram", "guards_code"): _guard,
    ("PayloadMeta", "path_name"): _payload_path,
    ("PayloadConfig", "config", "key"): _fqn,
}


# --------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------

#: The Python callables torch.export serializes by name: integer arithmetic on symbolic sizes.
SYM_TARGETS = frozenset(
    {
        *(f"_operator.{n}" for n in ("eq", "ne", "le", "ge", "lt", "gt", "neg", "pos", "mul", "add", "sub")),
        *(f"_operator.{n}" for n in ("floordiv", "mod", "pow", "truediv", "and_", "or_")),
        *("math.trunc", "torch.sym_not", "torch.sym_int", "torch.sym_float", "torch.sym_max", "torch.sym_min"),
    }
)
#: The fp32 / bf16 fused oneDNN ops :mod:`gml.kernels.fp32` emits.
MKLDNN_OPS = frozenset({"_convolution_pointwise", "_linear_pointwise"})
#: aten ops that do not check their arguments, touch files or point a tensor at raw storage.
ATEN_REFUSED = re.compile(
    r"_?unsafe_.*|from_file|set_|_print|_nested_.*|.*_storage.*|record_stream|_local_scalar_dense"
)


def resolve_target(s: str) -> torch._ops.OpOverload | None:
    """The op overload ``torch.ops.NS.OP.OVERLOAD`` names when it is on GML's allow-list, else None.

    Only attribute lookups on ``torch.ops`` namespaces: nothing is imported or called."""
    parts = s.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"]:
        return None
    ns, name, overload = parts[2:]
    if not (is_identifier(overload) and (is_identifier(name) or name.strip("_") in _DUNDER_OPS)):
        return None
    if ns == "gml":
        from gml.ir import library

        ops = library.vocabulary()  # defines every op (a load is often the first use in a process)
        if name not in ops or not getattr(ops[name], "saved", True):
            return None
    elif ns == "mkldnn":
        if name not in MKLDNN_OPS:
            return None
    elif ns == "aten":
        if ATEN_REFUSED.fullmatch(name):
            return None
    else:
        return None
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(op, torch._ops.OpOverload) or any("Storage" in str(a.type) for a in op._schema.arguments):
        return None
    return op


_DUNDER_OPS = frozenset({"and", "or", "xor", "lshift", "rshift", "iand", "ior", "ixor", "ilshift", "irshift"})


def target_allowed(s: str) -> bool:
    """Whether a node may call ``s``: a gml op, one of GML's fused oneDNN ops, an aten op that checks
    its arguments, or integer arithmetic on symbolic sizes."""
    return s in SYM_TARGETS or resolve_target(s) is not None


def _target(s: str, path: str) -> None:
    if len(s) > MAX_NAME or not target_allowed(s):
        raise _refuse(path, f"= {s[:80]!r} is not an op GML runs")


# --------------------------------------------------------------------------------------------------
# the schema walk
# --------------------------------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _walk(value: Any, tp: Any, path: str, rule: tuple[str, ...] | None) -> None:
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if isinstance(tp, str):  # a forward reference inside schema.py ("Argument", "Graph")
        tp = getattr(schema, tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) != 1:
            raise _refuse(path, "has a type GML does not read")
        _walk(value, arms[0], path, rule)
        return
    if origin is list:
        if not isinstance(value, list):
            raise _refuse(path, "is not a list")
        (item,) = typing.get_args(tp)
        for i, v in enumerate(value):
            _walk(v, item, f"{path}[{i}]", rule)
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise _refuse(path, "is not a mapping")
        _, item = typing.get_args(tp)
        key_rule = STRING_RULES.get((*rule, "key")) if rule else None
        for k, v in value.items():
            if not isinstance(k, str) or key_rule is None:
                raise _refuse(path, f"has the key {str(k)[:80]!r}, which GML never writes")
            key_rule(k, f"{path} key")
            _walk(v, item, f"{path}[{k!r}]", rule)
        return
    if dataclasses.is_dataclass(tp):
        _walk_dataclass(value, tp, path)
        return
    if tp is str:
        check = STRING_RULES.get(rule) if rule else None
        if not isinstance(value, str):
            raise _refuse(path, "is not a string")
        if check is None:
            raise _refuse(path, "is a string field GML does not read")
        check(value, path)
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise _refuse(path, "is not a boolean")
        return
    if isinstance(tp, type) and issubclass(tp, enum.IntEnum):
        if type(value) is not int or value not in {m.value for m in tp}:
            raise _refuse(path, f"is not a {tp.__name__}")
        return
    if tp is int:
        if type(value) is not int or abs(value) > MAX_INT:
            raise _refuse(path, "is not an integer in range")
        return
    if tp is float:
        if type(value) not in (int, float):
            raise _refuse(path, "is not a number")
        return
    raise _refuse(path, f"has a type GML does not read ({tp!r})")


def _walk_dataclass(value: Any, cls: type, path: str) -> None:
    if not isinstance(value, dict):
        raise _refuse(path, f"is not a {cls.__name__}")
    hints = _hints(cls)
    unknown = set(value) - set(hints)
    if unknown:
        raise _refuse(path, f"has the field {sorted(unknown)[0][:80]!r}, which a {cls.__name__} does not have")
    if issubclass(cls, schema._Union) and len(value) != 1:
        raise _refuse(path, f"is a {cls.__name__} with {len(value)} alternatives set")
    for name, v in value.items():
        _walk(v, hints[name], f"{path}.{name}", (cls.__name__, name))
    if cls is schema.TensorMeta:
        _check_tensor_meta(value, path)


def _ints(syms: Any) -> list[int | None]:
    """Concrete values of a list of SymInt (``None`` for a symbolic one)."""
    return [s.get("as_int") if isinstance(s, dict) else None for s in syms]


def _check_tensor_meta(meta: dict[str, Any], path: str) -> None:
    sizes, strides = _ints(meta.get("sizes", [])), _ints(meta.get("strides", []))
    if len(sizes) != len(strides) or len(sizes) > 16:
        raise _refuse(path, "has sizes and strides of different lengths")
    offset = _ints([meta.get("storage_offset")])[0]
    for v in [*sizes, *strides, offset]:
        if v is not None and not 0 <= v <= MAX_DIM:
            raise _refuse(path, f"has a size, stride or offset {v} out of range")
    if math.prod(s for s in sizes if s is not None) > MAX_NUMEL:
        raise _refuse(path, f"has {math.prod(s for s in sizes if s is not None)} elements")


# --------------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------------


def check_program(program: Any) -> None:
    """Refuse (:class:`Refused`) a ``model.json`` with any field outside the rules above."""
    _walk(program, schema.ExportedProgram, "model.json", None)
    for i, node in enumerate(program["graph_module"]["graph"]["nodes"]):
        _check_call(node, f"model.json node {i} ({str(node.get('name'))[:40]})")


def _check_call(node: dict[str, Any], path: str) -> None:
    """The keyword names of a call are its op's argument names, each at most once."""
    op = resolve_target(node["target"])
    names = [a["name"] for a in node["inputs"]]
    if len(set(names)) != len(names):
        raise _refuse(path, "passes an argument twice")
    if op is None:  # integer arithmetic on sizes: positional arguments only
        if any(a.get("kind") == schema.ArgumentKind.KEYWORD for a in node["inputs"]):
            raise _refuse(path, "passes keyword arguments to an arithmetic op")
        return
    # the arguments in schema order, keyword-only ones by keyword, none missing (readers bind by schema:
    # gml.ir.library.schema_args)
    arguments = {a.name: (i, a) for i, a in enumerate(op._schema.arguments)}
    last = -1
    for given in node["inputs"]:
        i, arg = arguments.get(given["name"], (None, None))
        if arg is None:
            raise _refuse(path, f"passes {given['name']!r}, which {op} does not take")
        if i <= last:
            raise _refuse(path, f"passes {given['name']!r} out of its schema's order")
        if arg.kwarg_only and given.get("kind") == schema.ArgumentKind.POSITIONAL:
            raise _refuse(path, f"passes the keyword-only {given['name']!r} positionally")
        last = i
    missing = [a.name for a in op._schema.arguments if not a.has_default_value() and a.name not in names]
    if missing:
        raise _refuse(path, f"does not pass {missing[0]!r}, which {op} needs")


def _extent(meta: dict[str, Any]) -> int | None:
    """Bytes a strided tensor reaches into its storage (None when a dim is symbolic)."""
    sizes, strides = _ints(meta["sizes"]), _ints(meta["strides"])
    offset = _ints([meta["storage_offset"]])[0]
    if None in sizes or None in strides or offset is None:
        return None
    if 0 in sizes:
        return 0
    itemsize = _ITEMSIZE.get(meta["dtype"])
    if itemsize is None:
        return None
    return (offset + sum((s - 1) * st for s, st in zip(sizes, strides)) + 1) * itemsize


#: serialized ScalarType -> bytes per element (the dtypes a GML model holds)
_ITEMSIZE = {
    schema.ScalarType.BYTE: 1,
    schema.ScalarType.CHAR: 1,
    schema.ScalarType.SHORT: 2,
    schema.ScalarType.INT: 4,
    schema.ScalarType.LONG: 8,
    schema.ScalarType.HALF: 2,
    schema.ScalarType.FLOAT: 4,
    schema.ScalarType.DOUBLE: 8,
    schema.ScalarType.BOOL: 1,
    schema.ScalarType.BFLOAT16: 2,
}


def check_payloads(config: Any, member_sizes: dict[str, int], what: str) -> None:
    """A weights / constants config: raw tensors only, each inside its member, no member larger
    than the largest tensor it holds (``member_sizes``: the archive's real sizes by path name)."""
    _walk(config, schema.PayloadConfig, what, None)
    reach: dict[str, int] = {}
    for fqn, entry in config["config"].items():
        path = f"{what} entry {fqn!r}"
        meta = entry.get("tensor_meta")
        if entry.get("use_pickle") is not False:
            raise _refuse(path, "asks for a pickled payload")
        if meta is None:
            raise _refuse(path, "is not a plain tensor")
        if meta["dtype"] not in _ITEMSIZE:
            raise _refuse(path, "has a dtype GML models do not hold")
        name = entry["path_name"]
        if name not in member_sizes:
            raise _refuse(path, f"names the member {name!r}, which the archive does not have")
        extent = _extent(meta)
        if extent is None:
            raise _refuse(path, "has a symbolic size")
        if extent > member_sizes[name]:
            raise _refuse(path, f"reaches {extent} bytes into a member of {member_sizes[name]}")
        reach[name] = max(reach.get(name, 0), extent)
    for name, size in member_sizes.items():
        if size > reach.get(name, 0):
            raise _refuse(f"{what} member {name!r}", f"holds {size} bytes; its tensors need {reach.get(name, 0)}")


_STATE_KINDS = {"parameter": "parameter_name", "buffer": "buffer_name", "tensor_constant": "tensor_constant_name"}


def check_state_matches_graph(program: Any, configs: list[Any]) -> None:
    """Each stored tensor is one the graph takes, with the dtype and shape the graph declares for it:
    what the archive holds is what the graph needs, no more and nothing else."""
    values = program["graph_module"]["graph"]["tensor_values"]
    stored: dict[str, Any] = {}
    for config in configs:
        stored.update(config["config"])
    used = set()
    for i, spec in enumerate(program["graph_module"]["signature"]["input_specs"]):
        ((kind, body),) = spec.items()
        field = _STATE_KINDS.get(kind)
        if field is None:
            continue
        fqn, path = body[field], f"model.json input spec {i}"
        entry, meta = stored.get(fqn), values.get(body["arg"]["name"])
        if entry is None or meta is None:
            raise _refuse(path, f"takes {fqn!r}, which the archive does not hold")
        held = entry["tensor_meta"]
        if held["dtype"] != meta["dtype"] or _ints(held["sizes"]) != _ints(meta["sizes"]):
            raise _refuse(path, f"declares {fqn!r} with another dtype or shape than the archive holds")
        used.add(fqn)
    extra = sorted(set(stored) - used)
    if extra:
        raise _refuse("the archive", f"holds tensors the graph never takes ({extra[0][:80]!r})")


def sanitized(program: dict[str, Any]) -> dict[str, Any]:
    """``program`` without node and module metadata (free text GML never reads)."""
    gm = dict(program["graph_module"])
    graph = dict(gm["graph"])
    graph["nodes"] = [{**n, "metadata": {}} for n in graph["nodes"]]
    gm["graph"] = graph
    gm["metadata"] = {}
    return {**program, "graph_module": gm}


__all__ = [
    "STRING_RULES",
    "Refused",
    "check_payloads",
    "check_program",
    "check_state_matches_graph",
    "is_identifier",
    "resolve_target",
    "sanitized",
    "target_allowed",
]
