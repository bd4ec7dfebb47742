"""The peer runtimes of ``gml bench --llm`` (llama.cpp, OpenVINO GenAI, ONNX Runtime GenAI), each driven in
its own worker process (:mod:`gml.bench.llm_worker`, a JSON-lines protocol) by the interpreter that has
it installed.

A peer runs the models it is given (``--llamacpp-model X.gguf``, ``--openvino-model DIR``,
``--ortgenai-model DIR``), one row per model named by its precision as the model's files state it
(:mod:`gml.bench.llm_files`). A peer that is not installed, or has no model, is not an error: the
table lists it with why it did not run and how to make it run. A model path that does not exist is a
:class:`~gml.errors.InputError` before anything is timed; a model the peer cannot load, or a worker that
dies, becomes a note on its row.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from gml.errors import InputError

WORKER = Path(__file__).with_name("llm_worker.py")


@dataclass(frozen=True)
class PeerKind:
    key: str  # the worker's runtime name and the CLI options' prefix (--llamacpp-model, --llamacpp-python)
    name: str
    module: str  # what the peer's interpreter must import
    install: str
    model: str  # what --KEY-model takes
    make_model: str
    kv_bytes: int  # bytes per KV-cache element in the peer's default cache (for the bandwidth ceiling)


#: kv_bytes: llama.cpp's default cache is f16, OpenVINO's CPU plugin keeps u8 (``KV_CACHE_PRECISION``), ONNX
#: Runtime GenAI's CPU models fp32 (their past_key_values inputs).
PEERS = (
    PeerKind(
        "llamacpp", "llama.cpp", "llama_cpp",
        "pip install 'gml-lab[llm-llamacpp]' (llama-cpp-python: a ~20 min source build)",
        "a .gguf file", "llama.cpp's quantize tool or benchmarks/llama_gguf.py write Q8_0 / Q4_0 GGUFs", 2,
    ),
    PeerKind(
        "openvino", "OpenVINO GenAI", "openvino_genai", "pip install 'gml-lab[llm-openvino]' (openvino-genai)",
        "an OpenVINO IR folder", "benchmarks/openvino_worker.py export SRC DIR int8|int4", 1,
    ),
    PeerKind(
        "ortgenai", "ONNX Runtime GenAI", "onnxruntime_genai",
        "pip install 'gml-lab[llm-ortgenai]' (onnxruntime-genai)",
        "an ONNX Runtime GenAI folder", "benchmarks/ortgenai_export.py SRC DIR int4|int8 (its model builder)", 4,
    ),
)  # fmt: skip
PEERS_BY_KEY = {p.key: p for p in PEERS}


class PeerError(Exception):
    """A worker's failure: its reply's error, or how it died (and the tail of its stderr)."""


@dataclass
class PeerRequest:
    """What a run asks of one peer: its interpreter, its models, extra environment for its worker."""

    kind: PeerKind
    python: str = sys.executable
    models: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    worker: Path = WORKER  # the worker script (tests serve a fake runtime through the same protocol)


def _check_python(kind: PeerKind, python: str) -> None:
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise InputError(
            f"--{kind.key}-python {python!r} is not an executable file",
            f"give the python of the environment that has {kind.name} (e.g. /path/to/venv/bin/python)",
        )


#: what a model folder must hold (llama.cpp takes a file)
FOLDER_MARKERS = {"openvino": "openvino_model.xml", "ortgenai": "genai_config.json"}


def _check_model(kind: PeerKind, path: str) -> None:
    p = Path(path)
    if not p.exists():
        raise InputError(f"--{kind.key}-model {path!r} does not exist", f"give {kind.model}; {kind.make_model}")
    marker = FOLDER_MARKERS.get(kind.key)
    if (marker is None) != p.is_file() or (marker and not (p / marker).is_file()):
        what = f" (no {marker} in it)" if marker and p.is_dir() else ""
        raise InputError(
            f"--{kind.key}-model {path!r} is not {kind.model}{what}", f"give {kind.model}; {kind.make_model}"
        )


def installed(kind: PeerKind, python: str) -> str | None:
    """Why ``kind`` cannot run in ``python`` (``None``: its module imports there)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({kind.module!r}) is None)"
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} could not be run ({e})"
    if rc == 0:
        return None
    here = "this interpreter" if python == sys.executable else python
    return f"not installed in {here}: {kind.install}, or pass --{kind.key}-python PYTHON of an environment that has it"


class PeerWorker:
    """One worker process: ``request`` sends a JSON request and returns the reply, or raises
    :class:`PeerError` (the error it replied, or how the process died)."""

    def __init__(self, kind: str, python: str, env: dict[str, str] | None = None, worker: Path = WORKER):
        self.kind = kind
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close(), read on failure)
        self._proc = subprocess.Popen(
            [python, str(worker), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _died(self, what: str) -> PeerError:
        try:
            rc = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        self._stderr.seek(0)
        tail = self._stderr.read()[-1500:].strip()
        how = "did not exit" if rc is None else f"exited with {rc}"
        if rc is not None and rc < 0:
            sig = signal.Signals(-rc).name
            how = f"was killed by {sig}"
            if sig == "SIGILL" and self.kind == "llamacpp":
                how += (
                    " (ggml's AMX matmul does this in some VMs: build benchmarks/llamacpp_noamx.c and pass "
                    "--llamacpp-preload libnoamx.so)"
                )
        return PeerError(f"the {self.kind} worker {how} {what}" + (f"; its stderr ends: {tail}" if tail else ""))

    def request(self, req: dict, timeout: float = 900.0) -> dict:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(f"before {req['cmd']!r}") from None
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._proc.kill()
            raise self._died(f"({req['cmd']!r} took over {timeout:.0f} s)") from None
        if line is None:
            raise self._died(f"during {req['cmd']!r}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"the {self.kind} worker replied {line.strip()[:200]!r}, not JSON") from None
        if not reply.get("ok"):
            raise PeerError(str(reply.get("error", reply)))
        return reply

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write('{"cmd": "quit"}\n')
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


@dataclass
class PeerRow:
    """One peer model, loaded in its worker; ``run`` times one round."""

    name: str
    worker: PeerWorker
    weight_bytes: int | None
    kv_bytes: int
    note: str = ""
    vocab_size: int | None = None

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        r = self.worker.request({"cmd": "run", "prompt": prompt, "new_tokens": new_tokens})
        return len(prompt) / r["prefill_seconds"], (new_tokens - 1) / max(r["decode_seconds"], 1e-9)


def check_requests(requests: list[PeerRequest]) -> None:
    """Refuse a bad path or interpreter before anything is built or timed."""
    for r in requests:
        _check_python(r.kind, r.python)
        for m in r.models:
            _check_model(r.kind, m)


def start_peers(
    requests: list[PeerRequest], threads: int, max_length: int, say=lambda _m: None
) -> tuple[list[PeerRow], list[tuple[str, str]], list[tuple[str, str]]]:
    """Start a worker per given model and load it. Returns the loaded rows, the rows that failed
    (name, why) and the peers that did not run (name, why and how to make them run)."""
    rows: list[PeerRow] = []
    failed: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    for r in requests:
        why = installed(r.kind, r.python)
        if why is not None:
            skipped.append((r.kind.name, why))
            continue
        if not r.models:
            skipped.append((r.kind.name, f"installed, but no model given: --{r.kind.key}-model ({r.kind.make_model})"))
            continue
        for path in r.models:
            say(f"loading {r.kind.name}: {path}")
            worker = PeerWorker(r.kind.key, r.python, r.env, r.worker)
            try:
                loaded = worker.request({"cmd": "load", "model": path, "threads": threads, "max_length": max_length})
            except PeerError as e:
                worker.close()
                failed.append((f"{r.kind.name} ({Path(path).name})", f"did not load {path}: {e}"))
                continue
            name = f"{r.kind.name} {loaded.get('precision') or Path(path).name}"
            if any(row.name == name for row in rows):
                name += f" ({Path(path).name})"
            rows.append(
                PeerRow(name, worker, loaded.get("weight_bytes"), r.kind.kv_bytes, loaded.get("runtime", ""),
                        loaded.get("vocab_size"))
            )  # fmt: skip
    return rows, failed, skipped
