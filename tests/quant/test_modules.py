"""GML INT8 modules: state that survives saving, and qparams read off any node (ADR 002)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import fx, nn

from gml.ir.values import ConvSpec, QParams
from gml.quant.lower import LowerToGML
from gml.quant.modules import (
    Dequantize,
    GMLQuantModuleBase,
    QAdaptiveAvgPool2d,
    QAdd,
    QCat,
    QConv2d,
    QConv2dAdd,
    QFlatten,
    QLinear,
    QMaxPool2d,
    QReLU,
    Quantize,
    UnaryOpsBase,
    extract_qparams,
    quantize_weight,
)

IN, OUT, OTHER = QParams(0.02, 128), QParams(0.05, 3), QParams(0.03, 100)


def _u8(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return x.contiguous(memory_format=torch.channels_last) if len(shape) == 4 else x


def _conv(seed: int, qp_in: QParams = IN, qp_out: QParams = OUT) -> QConv2d:
    g = torch.Generator().manual_seed(seed)
    w, ws = quantize_weight(torch.randn(8, 4, 3, 3, generator=g))
    return QConv2d(w, ws, torch.randn(8, generator=g), ConvSpec(padding=(1, 1)), qp_in, qp_out, relu=True)


def _conv_add(seed: int, qp_out: QParams = OUT, **kw) -> QConv2dAdd:
    g = torch.Generator().manual_seed(seed)
    w, ws = quantize_weight(torch.randn(8, 4, 3, 3, generator=g))
    return QConv2dAdd(w, ws, None, ConvSpec(padding=(1, 1)), IN, OTHER, qp_out, relu=True, **kw)


def _linear(seed: int, qp_out: QParams | None = OUT) -> QLinear:
    g = torch.Generator().manual_seed(seed)
    w, ws = quantize_weight(torch.randn(6, 16, generator=g))
    return QLinear(w, ws, torch.randn(6, generator=g), IN, qp_out)


# ---------------------------------------------------------------- state_dict / saving
@pytest.mark.parametrize(
    ("make", "args"),
    [
        (_conv, lambda: (_u8((2, 4, 6, 6)),)),
        (_conv_add, lambda: (_u8((1, 4, 6, 6)), _u8((1, 8, 6, 6), 1))),
        (_linear, lambda: (_u8((3, 16)),)),
    ],
    ids=["QConv2d", "QConv2dAdd", "QLinear"],
)
def test_state_dict_round_trip_restores_weights_qparams_and_prepacking(make, args):
    src, dst = make(0), make(1, qp_out=QParams(0.5, 7))
    inputs = args()
    assert not torch.equal(src(*[a.clone() for a in inputs]), dst(*[a.clone() for a in inputs]))
    sd = src.state_dict()
    assert {"output_scale", "output_zp", "input_scale", "input_zp", "weight", "weight_scale"} <= set(sd)
    assert sd["weight"].dtype == torch.int8
    dst.load_state_dict(sd)
    assert dst.output_qparams == OUT and dst.input_qparams == IN
    assert float(dst.output_scale) == 0.05 and int(dst.output_zp) == 3
    # the prepacked weight was rebuilt from the loaded dense weight
    assert torch.equal(src(*[a.clone() for a in inputs]), dst(*[a.clone() for a in inputs]))


def test_state_dict_of_weightless_modules_keeps_their_qparams():
    add = QAdd(IN, OTHER, OUT, relu=True)
    other = QAdd(QParams(1.0, 0), QParams(1.0, 0), QParams(1.0, 0), relu=True)  # structure: constructor
    other.load_state_dict(add.state_dict())
    assert (other.input_qparams, other.other_qparams, other.output_qparams) == (IN, OTHER, OUT)
    a, b = _u8((1, 4, 3, 3)), _u8((1, 4, 3, 3), 1)
    assert torch.equal(other(a, b), add(a, b))
    cat = QCat(1, [IN, OTHER], OUT)
    cat2 = QCat(1, [OUT, OUT], IN)
    cat2.load_state_dict(cat.state_dict())
    assert cat2._in_qps == (IN, OTHER) and cat2.output_qparams == OUT
    deq = Dequantize(OUT)
    deq2 = Dequantize(IN)
    deq2.load_state_dict(deq.state_dict())
    assert deq2.input_qparams == OUT


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_modules_survive_deepcopy_and_pickling(how: str):
    model = nn.Sequential(Quantize(IN), QConv2d(*_conv_args()), QReLU(OUT, OUT), Dequantize(OUT))
    x = torch.randn(1, 4, 6, 6)
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert clone[1]._packed is not model[1]._packed  # repacked, not shared
    assert torch.equal(clone(x), model(x))


def _conv_args():
    m = _conv(0)
    return m.weight, m.weight_scale, m.bias, m.spec, IN, OUT


def test_base_classes_are_abstract_and_register_output_qparams_as_buffers():
    with pytest.raises(TypeError, match="abstract"):
        GMLQuantModuleBase(OUT)  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):
        UnaryOpsBase(IN, OUT)  # type: ignore[abstract]
    for mod in (QReLU(IN, OUT), QMaxPool2d((2, 2), (2, 2), (0, 0), (1, 1), False, IN, OUT),
                QAdaptiveAvgPool2d((1, 1), IN, OUT), QFlatten(1, -1, IN, OUT), Quantize(OUT)):  # fmt: skip
        buffers = dict(mod.named_buffers())
        assert float(buffers["output_scale"]) == OUT.scale and int(buffers["output_zp"]) == OUT.zero_point


def test_fp32_output_linear_has_no_output_qparams():
    lin = _linear(0, qp_out=None)
    assert lin.output_qparams is None and lin.output_dtype == torch.float32
    y = lin(_u8((2, 16)))
    assert y.dtype == torch.float32
    assert "out=fp32" in repr(lin)


def test_conv_add_clone_other_keeps_the_skip_tensor_intact():
    x, other = _u8((1, 4, 6, 6)), _u8((1, 8, 6, 6), 1)
    before = other.clone()
    safe = _conv_add(0, clone_other=True)
    y_safe = safe(x, other)
    assert torch.equal(other, before)
    fast = _conv_add(0)
    y_fast = fast(x, other)
    assert torch.equal(y_fast, y_safe)
    if fast.backend.conv_add_writes_other:
        assert not torch.equal(other, before)


def test_repr_says_what_the_module_computes():
    r = repr(_conv(0))
    assert "4→8, k=3x3" in r and "relu" in r and "in=(0.02, 128)" in r and "out=(0.05, 3)" in r


# ---------------------------------------------------------------- extract_qparams
class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("x_scale", torch.tensor(0.02))
        self.register_buffer("x_zp", torch.tensor(128))


def _hand_built_reference() -> fx.GraphModule:
    """x → Q(get_attr qparams) → DQ → relu → Q(literal qparams) → DQ → output."""
    g = fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(torch.quantize_per_tensor, (x, g.get_attr("x_scale"), g.get_attr("x_zp"), torch.quint8))
    relu = g.call_function(torch.relu, (g.call_method("dequantize", (q,)),))
    q2 = g.call_function(torch.quantize_per_tensor, (relu, 0.05, 3, torch.quint8))
    g.output(g.call_method("dequantize", (q2,)))
    return fx.GraphModule(_Root(), g)


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_extract_qparams_reads_quantize_and_dequantize_nodes():
    gm = _hand_built_reference()
    assert extract_qparams(_node(gm, "quantize_per_tensor"), gm) == QParams(0.019999999552965164, 128)
    assert extract_qparams(_node(gm, "dequantize"), gm) == extract_qparams(_node(gm, "quantize_per_tensor"), gm)
    assert extract_qparams(_node(gm, "quantize_per_tensor_1"), gm) == OUT
    assert extract_qparams(_node(gm, "relu"), gm) is None  # an fp32 value has no qparams
    assert extract_qparams(_node(gm, "x"), gm) is None


def test_lowered_nodes_carry_their_qparams_as_op_arguments():
    from gml.ir import library

    gm = LowerToGML()(_hand_built_reference()).graph_module
    lowered = {library.gml_op_name(n): n for n in gm.graph.nodes if library.gml_op_name(n)}
    assert sorted(lowered) == ["dequantize", "qactivation", "quantize"]
    assert not any(n.op == "call_module" for n in gm.graph.nodes)  # ops, not modules (ADR 005)
    relu_node = lowered["qactivation"]
    assert library.op_args(relu_node)["op"] == "relu"
    assert QParams(*library.output_qparams_args(relu_node)) == OUT
    assert QParams(*library.output_qparams_args(relu_node.args[0])) == QParams(0.019999999552965164, 128)
    assert library.output_qparams_args(lowered["dequantize"]) is None  # its output is fp32
    # the qparams are in the graph, so an edit of the graph is what the executor runs
    x = torch.randn(1, 4, 3, 3)
    before = gm(x)
    relu_node.args = (*relu_node.args[:5], 0.5, 9, *relu_node.args[7:])
    deq = lowered["dequantize"]
    deq.args = (deq.args[0], 0.5, 9)
    gm.recompile()
    assert QParams(*library.output_qparams_args(relu_node)) == QParams(0.5, 9)
    assert not torch.equal(gm(x), before)


def test_extract_qparams_decomposed_ops_and_unsupported_dtypes():
    import torch.ao.quantization.fx._decomposed  # registers the quantized_decomposed ops

    qd = torch.ops.quantized_decomposed
    g = fx.Graph()
    x = g.placeholder("x")
    q = g.call_function(qd.quantize_per_tensor.default, (x, 0.1, 5, 0, 255, torch.uint8))
    dq = g.call_function(qd.dequantize_per_tensor.default, (q, 0.1, 5, 0, 255, torch.uint8))
    q8 = g.call_function(torch.quantize_per_tensor, (x, 0.1, 0, torch.qint8))
    g.output((dq, q8))
    gm = fx.GraphModule(nn.Module(), g)
    assert extract_qparams(q, gm) == QParams(0.1, 5) == extract_qparams(dq, gm)
    with pytest.raises(ValueError, match=r"activation dtype torch\.qint8"):
        extract_qparams(q8, gm)
