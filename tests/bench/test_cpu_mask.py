"""benchmarks/cpu_mask: a process under the CPUID mask sees the lower tier in every library."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("cpu_mask_run", ROOT / "benchmarks" / "cpu_mask" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_cpuid_faulting() -> bool:
    try:
        return " cpuid_fault" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


needs_faulting = pytest.mark.skipif(
    not _has_cpuid_faulting() or torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="needs CPUID faulting and an AVX-512 CPU to mask",
)


@needs_faulting
def test_every_library_sees_avx2_under_the_mask(tmp_path: Path):
    run = _runner()
    env = run.masked_env("AVX2", run.build_library(tmp_path))
    probe = (
        "import torch, gml.runtime.target as t, gml.bench.roofline as r; "
        "print(torch.backends.cpu.get_cpu_capability(), t.detect_target().isa, r.cpu_name())"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    aten, isa, name = out.stdout.split(maxsplit=2)
    assert (aten, isa) == ("AVX2", "avx2")  # ATen's dispatch and oneDNN's, with no ONEDNN_MAX_CPU_ISA
    assert name.strip().endswith("[CPUID masked to AVX2]")
    env = run.masked_env("AVX512_CORE", run.build_library(tmp_path))
    out = subprocess.run([sys.executable, "-m", "gml.runtime.target"], env=env, capture_output=True, text=True)
    assert out.stdout.startswith("avx512_core, no VNNI")


@needs_faulting
def test_a_real_fault_still_reaches_the_programs_handler(tmp_path: Path):
    """faulthandler installs its SIGSEGV handler after the mask's, and a subprocess (vfork: the child
    shares the parent's memory and resets its handlers) runs before the fault: it is still reported."""
    run = _runner()
    env = run.masked_env("AVX2", run.build_library(tmp_path))
    crash = 'import ctypes, subprocess, torch; subprocess.run(["true"]); torch.zeros(1); ctypes.string_at(0)'
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", crash], env=env, capture_output=True, text=True)
    assert out.returncode == -11
    assert "Segmentation fault" in out.stderr


def test_unknown_tier_is_refused():
    with pytest.raises(SystemExit):
        _runner().main(["AVX9", "--", "true"])
