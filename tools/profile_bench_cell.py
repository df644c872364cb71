"""cProfile one `kvllm bench throughput` process in-process, and print where KvLLM's time goes.

Usage: python tools/profile_bench_cell.py SPEC_JSON OUT.prof

SPEC_JSON is a file holding one process's spec, as `kvllm.bench.sweep` passes it to
`python -m kvllm.bench.throughput` (system, model, engine, workload, concurrency,
compression, repeat). The throughput runs used a `kara` spec at pool 256, C=16, 16 x 512.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys

from kvllm.bench.throughput import Spec, run

if __name__ == "__main__":
    spec = Spec.from_dict(json.loads(open(sys.argv[1]).read()))
    profile = cProfile.Profile()
    profile.enable()
    run(spec)
    profile.disable()
    profile.dump_stats(sys.argv[2])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(r"kvllm|execute_model|schedule", 45)
    print(text.getvalue())
