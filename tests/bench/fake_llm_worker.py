"""A fake peer runtime for tests/bench/test_llm_peers.py, served through gml.bench.llm_worker's protocol.

It sleeps for nothing and reports fixed times: the tests check plumbing (requests, rows, interleaving,
errors), never timings. Model "paths" choose the behaviour: a name with ``bad`` fails to load, one with
``crash`` kills the process on its first run. Every run appends ``model prompt`` to ``$FAKE_PEER_LOG``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gml.bench.llm_worker import _protocol_stdout, serve


class Fake:
    def load(self, model: str, threads: int, max_length: int) -> dict:
        if "bad" in Path(model).name:
            raise ValueError("not a model this runtime reads")
        self.model = model
        return {
            "runtime": f"fake ({threads} threads)",
            "vocab_size": int(os.environ.get("FAKE_PEER_VOCAB", "0")) or None,
        }

    def run(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        if "crash" in Path(self.model).name:
            os._exit(3)
        with open(os.environ["FAKE_PEER_LOG"], "a") as f:
            f.write(json.dumps([Path(self.model).name, prompt, new_tokens]) + "\n")
        return 0.5, 0.25


if __name__ == "__main__":
    _protocol_stdout()
    serve(Fake(), info=lambda path: ("int8" if "8" in Path(path).name else "int4", 1000))
    sys.exit(0)
