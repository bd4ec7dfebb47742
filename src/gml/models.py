"""Turn what a user names into a model and example inputs.

A model spec is one of

* a torchvision model name (``resnet18``, ``mobilenet_v2``, ...), built with random weights:
  GML-Lab never downloads anything;
* ``timm:NAME`` (``timm:efficientnet_b0``): a timm model (``pip install 'gml-lab[timm]'``), built
  with ``pretrained=False`` (random init; nothing is downloaded), inputs at its default resolution;
* ``hf:BertModel`` (a transformers class built from its default config, random weights) or a local
  Hugging Face model folder (``config.json`` + weights): :mod:`gml.models_hf`;
* ``path/to/file.py:ClassName``: the class is imported from that file and built with no arguments.
  If the file defines ``example_inputs()`` (or the class an ``example_input_shape`` attribute) it
  gives the default inputs;
* an ``nn.Module`` (Python API).

Checkpoints load with ``torch.load(..., weights_only=True)``, which refuses pickled code; opting
out (``unsafe_load=True`` / ``--unsafe-load``) is explicit. A Hugging Face folder whose config asks
for its own Python code (``auto_map``) is refused the same way unless ``trust_remote_code=True``
(``--trust-remote-code``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import pickle
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gml.errors import InputError, ModelLoadError, did_you_mean
from gml.models_hf import input_templates, is_hf_spec, load_hf

DEFAULT_VISION_SHAPE = (1, 3, 224, 224)
_SPECIAL_SHAPES = {"inception_v3": (1, 3, 299, 299)}
#: torchvision's video classifiers take ``[N, C, T, H, W]`` clips; 16 frames, and the crop size of
#: the model's weights' transforms (112x112 for the ResNet3D family, 224x224 for S3D, MViT, Swin3D).
VIDEO_FRAMES = 16
VIDEO_SHAPE = (1, 3, VIDEO_FRAMES, 112, 112)
#: optical flow models take two frames whose sides are multiples of 8.
FLOW_FRAME_SHAPE = (1, 3, 128, 128)


def torchvision_names() -> list[str]:
    import torchvision.models as tvm

    return sorted(tvm.list_models())


def _load_torchvision(name: str) -> nn.Module:
    import torchvision.models as tvm

    names = tvm.list_models()
    if name not in names:
        raise ModelLoadError(
            f"Unknown model '{name}': not a torchvision model and not a path like file.py:Class.",
            hint=did_you_mean(name, names)
            + "`python -c 'import torchvision; print(torchvision.models.list_models())'` lists the names.",
        )
    kwargs: dict[str, Any] = {"weights": None}
    if name == "inception_v3" or name.startswith("googlenet"):
        kwargs.update(aux_logits=False, init_weights=True)
    params = inspect.signature(tvm.get_model_builder(name)).parameters
    if "weights_backbone" in params:  # segmentation/detection builders download a backbone otherwise
        kwargs["weights_backbone"] = None
    try:
        return tvm.get_model(name, **kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"Building torchvision's {name} with random weights failed: {type(exc).__name__}: {exc}",
            hint="build the model in Python and pass the module to gml's API.",
        ) from None


TIMM_PREFIX = "timm:"


def _load_timm(name: str) -> nn.Module:
    """``timm.create_model(name, pretrained=False)``: random init, never a download."""
    try:
        import timm
    except ImportError:
        raise ModelLoadError(
            f"'{TIMM_PREFIX}{name}' needs timm, which is not installed.",
            hint="pip install 'gml-lab[timm]' (or pip install timm).",
        ) from None
    names = timm.list_models()
    if name not in names:
        raise ModelLoadError(
            f"Unknown timm model '{name}'.",
            hint=did_you_mean(name, names) + "`python -c 'import timm; print(timm.list_models())'` lists the names.",
        )
    try:
        return timm.create_model(name, pretrained=False)
    except Exception as exc:
        raise ModelLoadError(
            f"Building timm's {name} with random weights failed: {type(exc).__name__}: {exc}",
            hint="build the model in Python and pass the module to gml's API.",
        ) from None


def _timm_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The model's default ``(1, C, H, W)`` from its timm pretrained config, if it has one."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    size = cfg.get("input_size")
    return (1, *(int(d) for d in size)) if size else None


def _user_module_name(path: str) -> str:
    return "gml_user_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ModelLoadError(f"Model file '{path}' does not exist.", hint="check the path before ':Class'.")
    mod_name = _user_module_name(path)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"'{path}' is not an importable Python file.", hint="give a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelLoadError(
            f"Importing '{path}' failed: {type(exc).__name__}: {exc}",
            hint=f"run `python {path}` to see the error in your file.",
        ) from None
    return module


def load_model(
    spec: str | nn.Module,
    *,
    weights: str | None = None,
    unsafe_load: bool = False,
    eval_mode: bool = True,
    submodule: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Build the model ``spec`` names; optionally load a checkpoint; put it in eval mode.

    ``submodule`` (a dotted path such as ``backbone``) returns that part of the model instead, after
    the checkpoint is loaded into the whole: the way to optimize the traceable part of a model whose
    top-level ``forward`` does not trace (torchvision's detectors loop over a list of images).
    """
    if isinstance(spec, nn.Module):
        model = spec
    elif ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        path, cls_name = spec.rsplit(":", 1)
        module = _import_file(path)
        cls = getattr(module, cls_name, None)
        if cls is None:
            found = [k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)]
            raise ModelLoadError(
                f"'{path}' has no class '{cls_name}'.",
                hint=f"nn.Module classes in that file: {', '.join(found) or 'none'}.",
            )
        try:
            model = cls()
        except TypeError as exc:
            raise ModelLoadError(
                f"Cannot build {cls_name}() with no arguments: {exc}",
                hint="give the class default arguments, or build the model in Python and call gml's API.",
            ) from None
        if not isinstance(model, nn.Module):
            raise ModelLoadError(f"{cls_name} is not an nn.Module.", hint="point at an nn.Module subclass.")
    elif spec.startswith(TIMM_PREFIX):
        model = _load_timm(spec.removeprefix(TIMM_PREFIX))
    elif spec.endswith(".py"):
        raise ModelLoadError(f"'{spec}' names a file but no class.", hint=f"use {spec}:ClassName.")
    elif is_hf_spec(spec):  # #15: hf:ArchitectureClass or a local HF model folder (gml.models_hf)
        model = load_hf(spec, trust_remote_code=trust_remote_code)
    else:
        model = _load_torchvision(spec)
    if weights is not None:
        load_checkpoint(model, weights, unsafe_load=unsafe_load)
    if submodule:
        model = select_submodule(model, submodule)
    return model.eval() if eval_mode else model


def child_names(model: nn.Module, limit: int = 8) -> str:
    """``"a, b, c"``: the model's direct children, for messages."""
    names = [name for name, _ in model.named_children()]
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def select_submodule(model: nn.Module, path: str) -> nn.Module:
    """``model.get_submodule(path)`` with an error that lists what is there."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        parent_path, _, _ = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
        except AttributeError:
            parent = model
        where = f"'{parent_path}'" if parent is not model else type(model).__name__
        raise ModelLoadError(
            f"{type(model).__name__} has no submodule '{path}'.",
            hint=f"children of {where}: {child_names(parent) or 'none'}; nest with dots (backbone.body).",
        ) from None


def pickled_globals(path: str) -> list[str] | None:
    """The code references (``module.name``) a pickle in ``path`` would import, read with
    :mod:`pickletools` (which parses opcodes and runs nothing); for a ``torch.save`` zip archive, of
    its ``data.pkl``. ``None`` when the bytes are not a parseable pickle (a corrupt file)."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                name = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
                if name is None:
                    return None
                data = zf.read(name)
        else:
            with open(path, "rb") as f:
                data = f.read()
        found: list[str] = []
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST") and isinstance(arg, str):
                found.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
            elif op.name in ("REDUCE", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD") and not found:
                found.append(f"(a {op.name} call)")
        return found
    except Exception:
        return None


# what torch.save writes for plain tensors; anything else is code a weights-only load refuses to run
_TENSOR_GLOBALS = ("torch._utils._rebuild", "collections.OrderedDict", "torch.FloatStorage", "torch.")


def load_checkpoint(model: nn.Module, path: str, *, unsafe_load: bool = False) -> None:
    """Load a state dict from ``path`` into ``model``, refusing pickled code unless ``unsafe_load``."""
    if os.path.isdir(path):
        raise ModelLoadError(
            f"Checkpoint '{path}' is a directory, not a checkpoint file.",
            hint="pass the .pt/.pth file inside it (a state_dict saved with torch.save).",
        )
    if not os.path.isfile(path):
        raise ModelLoadError(f"Checkpoint '{path}' does not exist.")
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 5 ...": the error below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=not unsafe_load)
    except pickle.UnpicklingError as exc:
        # weights_only=True names the first non-tensor global it refused ("GLOBAL posix.system");
        # without one, the bytes are simply not a readable pickle: a corrupt file, not an attack.
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found is None and not unsafe_load:
            # weights_only also stops at pickle opcodes it does not support ("Unsupported operand"),
            # before reaching a GLOBAL: read the references ourselves (pickletools runs nothing)
            refs = pickled_globals(path)
            code = [r for r in refs or [] if not r.startswith(_TENSOR_GLOBALS)]
            if code:
                raise ModelLoadError(
                    f"Refused to load '{path}': it contains a pickled reference to {code[0]}, not only "
                    "tensors; unpickling it could run arbitrary code, so nothing in it was executed.",
                    hint="save a state_dict with torch.save(model.state_dict(), path), or pass --unsafe-load "
                    "if you trust the file.",
                ) from None
            if refs is not None and "Unsupported operand" in str(exc):
                raise ModelLoadError(
                    f"Refused to load '{path}': it is a pickle written with opcodes a weights-only load does not "
                    "read (another pickle protocol), so nothing in it was executed.",
                    hint="re-save it with torch.save(model.state_dict(), path), or pass --unsafe-load if you "
                    "trust the file.",
                ) from None
        if found is None or unsafe_load:
            raise ModelLoadError(
                f"Checkpoint '{path}' is corrupt or truncated: not readable PyTorch checkpoint data.",
                hint="re-save it with torch.save(model.state_dict(), path).",
            ) from None
        raise ModelLoadError(
            f"Refused to load '{path}': it contains a pickled reference to {found.group(1)}, not only "
            "tensors; unpickling it could run arbitrary code, so nothing in it was executed.",
            hint="save a state_dict with torch.save(model.state_dict(), path) (a whole pickled model "
            "also triggers this), or pass --unsafe-load if you trust the file.",
        ) from None
    except Exception as exc:
        raise ModelLoadError(
            f"Checkpoint '{path}' is corrupt or truncated ({type(exc).__name__}: {str(exc)[:200]}).",
            hint="re-save it with torch.save(model.state_dict(), path).",
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if isinstance(state, nn.Module):
        state = state.state_dict()
    if not isinstance(state, dict):
        raise ModelLoadError(f"Checkpoint '{path}' holds a {type(state).__name__}, not a state_dict.")
    expected = model.state_dict()
    for key, value in state.items():
        if key not in expected:
            continue
        if not isinstance(value, torch.Tensor):
            raise ModelLoadError(
                f"Checkpoint '{path}' does not match the model: '{key}' is a {type(value).__name__}, not a tensor.",
                hint="check that the file is a state_dict of this model (torch.save(model.state_dict(), path)).",
            )
        if value.shape != expected[key].shape:
            raise ModelLoadError(
                f"Checkpoint '{path}' does not match the model: '{key}' has shape {tuple(value.shape)} in the "
                f"file and {tuple(expected[key].shape)} in the model.",
                hint="check that the checkpoint belongs to this architecture and configuration (e.g. the "
                "number of classes).",
            )
    try:
        result = model.load_state_dict(state, strict=False)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise ModelLoadError(
            f"Checkpoint '{path}' does not match the model: {first[-1].strip() if first else type(exc).__name__}",
            hint="check that the checkpoint belongs to this architecture.",
        ) from None
    if result.missing_keys or result.unexpected_keys:
        hint = "check that the checkpoint belongs to this architecture."
        prefixed = [k for k in result.unexpected_keys if k.startswith("module.")]
        if prefixed and all(k.removeprefix("module.") in expected for k in prefixed):
            hint = (
                "its keys start with 'module.': it was saved from a DataParallel / DistributedDataParallel "
                "wrapper. Save model.module.state_dict() instead, or strip the prefix: "
                "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, 'module.')."
            )
        raise ModelLoadError(
            f"Checkpoint '{path}' does not match the model: {len(result.missing_keys)} missing keys "
            f"(e.g. {result.missing_keys[:3]}), {len(result.unexpected_keys)} unexpected "
            f"(e.g. {result.unexpected_keys[:3]}).",
            hint=hint,
        )


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"1x3x224x224"`` or ``"1x3x32x32,1x10"`` → list of shapes."""
    shapes = []
    for part in text.split(","):
        try:
            dims = tuple(int(d) for d in part.strip().lower().split("x"))
        except ValueError:
            raise InputError(
                f"Cannot read input shape '{part}'.", hint="write shapes like 1x3x224x224; separate inputs by ','."
            ) from None
        if not dims or any(d <= 0 for d in dims):
            raise InputError(f"Input shape '{part}' has a non-positive dimension.")
        if any(d >= 2**31 for d in dims):
            raise InputError(
                f"Input shape '{part}' has a dimension of 2^31 or more; no tensor of that size fits in memory.",
                hint="give the shape of one real input, e.g. 1x3x224x224.",
            )
        shapes.append(dims)
    return shapes


def _video_shape(name: str) -> tuple[int, ...]:
    """A clip the video model ``name`` accepts, from its weights' metadata (an enum: no download)."""
    import torchvision.models as tvm

    try:
        weights = tvm.get_model_weights(name).DEFAULT
        h, w = weights.transforms().crop_size
        frames = max(VIDEO_FRAMES, int(weights.meta.get("min_temporal_size") or 0))
    except Exception:  # metadata layout of another torchvision version
        return VIDEO_SHAPE
    return (1, 3, frames, int(h), int(w))


def default_input_shapes(model: nn.Module, spec: str | nn.Module | None = None) -> list[tuple[int, ...]]:
    """Shapes the model's author declared, else the torchvision default 1x3x224x224."""
    if is_hf_spec(spec):  # #15
        return [tuple(t.shape) for t in input_templates(model)]
    if isinstance(spec, str) and spec in _SPECIAL_SHAPES:
        return [_SPECIAL_SHAPES[spec]]
    if isinstance(spec, str) and spec.startswith(TIMM_PREFIX) and (shape := _timm_input_shape(model)):
        return [shape]
    if isinstance(spec, str) and ":" not in spec:
        import torchvision.models as tvm

        if spec in tvm.list_models(module=tvm.video):
            return [_video_shape(spec)]
        if spec in tvm.list_models(module=tvm.optical_flow):
            return [FLOW_FRAME_SHAPE, FLOW_FRAME_SHAPE]  # two frames
    declared = getattr(model, "example_input_shape", None)
    if declared is not None:
        return [tuple(declared)] if isinstance(declared[0], int) else [tuple(s) for s in declared]
    tensors = declared_inputs(spec, model)
    if tensors is not None:
        return [tuple(t.shape) for t in tensors]
    return [DEFAULT_VISION_SHAPE]


def declared_inputs(spec: str | nn.Module | None, model: nn.Module | None = None) -> tuple[torch.Tensor, ...] | None:
    """The tensors ``example_inputs()`` of a ``file.py:Class`` spec returns (None otherwise, and
    None when the class declares its own ``example_input_shape``, which then describes it).

    They carry what shapes alone do not: an ``nn.Embedding`` model takes int64 token ids.
    """
    if is_hf_spec(spec) and model is not None:  # #15: token ids from the vocabulary, an all-ones mask
        return input_templates(model)
    if not (isinstance(spec, str) and ".py:" in spec) or getattr(model, "example_input_shape", None) is not None:
        return None
    module = sys.modules.get(_user_module_name(spec.rsplit(":", 1)[0]))
    fn = getattr(module, "example_inputs", None)
    if not callable(fn):
        return None
    values = fn()
    values = (values,) if isinstance(values, torch.Tensor) else tuple(values)
    return values if all(isinstance(v, torch.Tensor) for v in values) else None


def load_with_defaults(
    spec: str | nn.Module,
    *,
    weights: str | None = None,
    unsafe_load: bool = False,
    submodule: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, list[tuple[int, ...]], tuple[torch.Tensor, ...] | None]:
    """:func:`load_model`, plus the model's default input shapes and input templates
    (:func:`declared_inputs`) for :func:`example_inputs`.

    A model name's defaults describe the whole model, so for a ``submodule`` only what that part
    declares itself counts.
    """
    model = load_model(
        spec, weights=weights, unsafe_load=unsafe_load, submodule=submodule, trust_remote_code=trust_remote_code
    )
    own = spec if isinstance(spec, str) and not submodule else None
    return model, default_input_shapes(model, own), declared_inputs(own, model)


def example_inputs(
    shapes: Sequence[Sequence[int]],
    *,
    batch: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    like: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Deterministic random inputs of the given shapes (``batch`` overrides dim 0).

    Floating inputs are N(0, 1). With ``like`` (one template per input, e.g.
    :func:`declared_inputs`), each input takes its template's dtype, and integer or bool inputs
    are drawn uniformly from the template's value range (token ids stay valid indices). One shape
    for several 2-D templates (``input_ids``, ``attention_mask``) is the shape of each.
    """
    gen = torch.Generator().manual_seed(seed)
    if like is not None and len(shapes) == 1 < len(like) and all(t.dim() == 2 for t in like):
        shapes = list(shapes) * len(like)  # #15: one BxS shape for input_ids and attention_mask alike
    templates = list(like) if like is not None and len(like) == len(shapes) else [None] * len(shapes)
    out = []
    for s, t in zip(shapes, templates):
        shape = (batch, *s[1:]) if batch is not None else tuple(s)
        try:
            if t is None or t.is_floating_point():
                out.append(torch.randn(*shape, generator=gen, dtype=dtype if t is None else t.dtype))
            else:
                lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
                out.append(torch.randint(lo, hi + 1, shape, generator=gen).to(t.dtype))
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            size = math.prod(shape) * (dtype if t is None else t.dtype).itemsize
            raise InputError(
                f"Out of memory: an input of shape {'x'.join(map(str, shape))} needs {format_bytes(size)}, "
                "more than this machine can allocate.",
                hint="give the shape of one real input, e.g. --input-shape 1x3x224x224.",
            ) from None
    return tuple(out)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch failing to allocate memory (CPU: a RuntimeError, not MemoryError)."""
    return isinstance(exc, MemoryError | torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
