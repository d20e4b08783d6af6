"""One vLLM engine process for the tests: `python -m tests.vllm.drive OUT STORAGE CHILD
DELAY_MS` runs the docqa workload through `kvscope.vllm.session.run_vllm_session` with the
observer around CHILD (example: vLLM's ExampleConnector, or with DELAY_MS > 0
DelayedExampleConnector; async: BackgroundExampleConnector) on STORAGE.
VLLM_ENABLE_V1_MULTIPROCESSING comes from the
environment. Run in a process of its own: vLLM keeps its KV-transfer group per process."""

from __future__ import annotations

import sys
from pathlib import Path

from kvscope.run_options import RunOptions
from kvscope.vllm.session import example_child, run_vllm_session

#: The workload every test run serves (the same prompts in every process).
NUM_REQUESTS = 6
RATE = 40.0


def main(out: str, storage: str, child: str, delay_ms: float) -> None:
    opts = RunOptions(workload="docqa", num_requests=NUM_REQUESTS, seed=3, rate=RATE,
                      model="tiny", out=Path(out), max_num_seqs=8)
    spec = example_child(storage, delay_ms=delay_ms, background=child == "async")
    summary = run_vllm_session(opts, child=spec)
    print("\n".join(summary.lines()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
