"""torch's own transformer modules: eager against GML fp32 and GML INT8, one interleaved run.

    python benchmarks/torch_transformer.py [--threads 2] [--rounds 30] [--seq 64] [--d-model 256]

Cases (random init, ``batch_first``, dropout 0, eval): ``nn.TransformerEncoder`` of 4 layers called
with no mask, with a causal ``mask`` and no ``is_causal`` (torch compares the mask's values with a
causal one), with a bool ``src_key_padding_mask`` (turned into a float ``-inf`` mask before the
attention); ``nn.TransformerDecoder`` of 4 layers (self- and cross-attention); one
``nn.MultiheadAttention`` with a key padding mask. Batch 2, the second sequence a quarter padding.
Prints the CPU (the CPUID mask it runs under, if any), per case and variant the median wall ms of
``--rounds`` calls (each after ``--settle-ms`` idle, the variants in turn), the ratio to eager, the
largest error against eager's Python path (``torch.enable_grad``: not its fused fast path, which gives
NaN for a fully padded row) and where GML ran it.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gml


def _cpu() -> str:
    from gml.bench.roofline import cpu_name
    from gml.runtime.target import detect_target

    return f"{cpu_name()} (oneDNN ISA {detect_target().isa})"


class _Encoder(nn.Module):
    def __init__(self, d: int, call: str) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.call = call

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        if self.call == "mask":
            return self.enc(x, mask=extra)
        if self.call == "padding":
            return self.enc(x, src_key_padding_mask=extra)
        return self.enc(x)


class _Decoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0), 4)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.dec(x, memory)


class _MHA(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.att(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def _cases(seq: int, d: int) -> list[tuple[str, nn.Module, tuple, list[tuple]]]:
    g = torch.Generator().manual_seed(0)

    def x() -> torch.Tensor:
        return torch.randn(2, seq, d, generator=g)

    pad = torch.zeros(2, seq, dtype=torch.bool)
    pad[1, seq - seq // 4 :] = True
    causal = nn.Transformer.generate_square_subsequent_mask(seq)
    return [
        ("TransformerEncoder", _Encoder(d, "none"), (x(),), [(x(),) for _ in range(4)]),
        ("TransformerEncoder, causal mask", _Encoder(d, "mask"), (x(), causal), [(x(), causal) for _ in range(4)]),
        ("TransformerEncoder, padding mask", _Encoder(d, "padding"), (x(), pad), [(x(), pad) for _ in range(4)]),
        ("TransformerDecoder", _Decoder(d), (x(), x()), [(x(), x()) for _ in range(4)]),
        ("MultiheadAttention, padding mask", _MHA(d), (x(), pad), [(x(), pad) for _ in range(4)]),
    ]


def _where(res: Any) -> str:
    return str(res.runtime).splitlines()[0].removeprefix("runtime: ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--settle-ms", type=float, default=20.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"CPU: {_cpu()}; torch {torch.__version__}; {args.threads} thread(s); seq {args.seq}, d_model {args.d_model}")
    print("| case | variant | ms | / eager | max err vs eager | runs |")
    print("|---|---|---:|---:|---:|---|")
    for label, model, example, calib in _cases(args.seq, args.d_model):
        model.eval()
        with torch.enable_grad():
            want = model(*example).detach()
        runs: dict[str, tuple[Callable[..., Any], str]] = {"eager": (model, "torch")}
        builds = {
            "gml fp32": lambda model=model, example=example: gml.optimize(model, example),
            "gml int8": lambda model=model, example=example, calib=calib: gml.quantize(
                model, calib, example_inputs=example
            ),
        }
        for name, build in builds.items():
            try:
                res = build()
            except Exception as exc:  # a build that fails is a row, not the end of the run
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                print(f"| {label} | {name} | — | — | — | build failed: {why} |")
                continue
            tag = f"{name} ({res.precision})" if name == "gml int8" else name
            runs[tag] = (res.executable, _where(res))
        times: dict[str, list[float]] = {k: [] for k in runs}
        with torch.no_grad():
            errs: dict[str, float] = {}
            for k, (f, _) in list(runs.items()):
                try:
                    errs[k] = float((f(*example).float() - want).abs().max())
                except Exception as exc:  # a variant that refuses the inputs is a row, not the end of the run
                    print(f"| {label} | {k} | — | — | — | {type(exc).__name__}: {str(exc).splitlines()[0][:90]} |")
                    del runs[k], times[k]
            for f, _ in runs.values():
                f(*example)
            for _ in range(args.rounds):
                for k, (f, _) in runs.items():
                    time.sleep(args.settle_ms / 1e3)
                    t0 = time.perf_counter()
                    f(*example)
                    times[k].append((time.perf_counter() - t0) * 1e3)
        eager = statistics.median(times["eager"])
        for k, (_, where) in runs.items():
            ms = statistics.median(times[k])
            print(f"| {label} | {k} | {ms:.3f} | {ms / eager:.2f} | {errs[k]:.1e} | {where} |", flush=True)


if __name__ == "__main__":
    main()
