"""Run a command as if on a lower x86 tier: every library in it sees that tier through CPUID.

    .venv/bin/python benchmarks/cpu_mask/run.py AVX2 -- .venv/bin/gml bench resnet18 --int8
    .venv/bin/python benchmarks/cpu_mask/run.py AVX512_CORE -- .venv/bin/python -m pytest tests/quant

``ONEDNN_MAX_CPU_ISA`` caps oneDNN only (torch's copy and GML's). ONNX Runtime's MLAS, fbgemm,
ATen's vector kernels and OpenVINO's own paths read CPUID and ignore it, so under the cap a peer may
still run AVX-512 / VNNI / AMX code. This runner preloads ``cpu_mask.so`` (``cpu_mask.c`` beside
this file; built with the system C compiler into ``build/`` on first use), which masks CPUID through
Linux's CPUID faulting, so every library picks the kernels of the lower CPU and runs them on this
core: the closest this machine gets to an AVX2-only CPU of the same microarchitecture. Benchmark
tables name the mask (``gml.bench.roofline.cpu_name``).

Needs CPUID faulting (``cpuid_fault`` in /proc/cpuinfo: Intel since Ivy Bridge, also in KVM guests);
where it is missing the runner says so and exits 2 (``ONEDNN_MAX_CPU_ISA`` is then the only cap).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIERS = ("AVX2", "AVX512_CORE", "AVX512_CORE_VNNI")
# glibc picks its string functions before the preload's constructor runs: its own tunable masks them
GLIBC_MASK = {
    "AVX2": "glibc.cpu.hwcaps=-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512VL,-AVX512ER,-AVX512PF",
}
# ARCH_GET_CPUID (asm/prctl.h) through syscall(SYS_arch_prctl = 158): 0 while CPUID faults
PROBE = "import ctypes, sys; sys.exit(0 if ctypes.CDLL(None).syscall(158, 0x1011, 0) == 0 else 3)"


def build_library(out_dir: Path = ROOT / "build") -> Path:
    """``cpu_mask.so``, compiled again when ``cpu_mask.c`` is newer."""
    src, lib = HERE / "cpu_mask.c", out_dir / "cpu_mask.so"
    if lib.exists() and lib.stat().st_mtime >= src.stat().st_mtime:
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("cpu_mask: no C compiler (cc / gcc) to build cpu_mask.so")
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", str(src), "-o", str(lib), "-ldl"], check=True)
    return lib


def masked_env(tier: str, lib: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["GML_CPU_MASK"] = tier
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    if tier in GLIBC_MASK:
        env["GLIBC_TUNABLES"] = ":".join(p for p in (env.get("GLIBC_TUNABLES", ""), GLIBC_MASK[tier]) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tier", choices=TIERS, help="the tier CPUID reports")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: cpu_mask/run.py TIER -- COMMAND ...")
    env = masked_env(args.tier, build_library())
    if subprocess.run([sys.executable, "-c", PROBE], env=env).returncode != 0:
        print(
            "cpu_mask: this CPU or kernel has no CPUID faulting (no 'cpuid_fault' in /proc/cpuinfo), so "
            "CPUID cannot be masked here; ONEDNN_MAX_CPU_ISA still caps oneDNN (torch's and GML's)",
            file=sys.stderr,
        )
        return 2
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
