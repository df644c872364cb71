"""Live metrics (engine record -> API-process collector) and the streamed-statistics splice,
without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvllm.vllm.metrics import ENV, FIELDS, Collector, EnginePublisher, read_totals
from kvllm.vllm.server import _splice

STATS = {"kvllm": {"method": "kara", "compressions": 3}}


def test_engines_publish_and_the_collector_sums_them(tmp_path: Path) -> None:
    a, b = EnginePublisher(str(tmp_path), 0), EnginePublisher(str(tmp_path), 1)
    a.publish({"compression_rounds": 2, "kv_physical_tokens": 10, "compress_seconds": 0.5})
    b.publish({"compression_rounds": 3, "kv_physical_tokens": 5})
    assert read_totals(str(tmp_path)) == {
        **dict.fromkeys(FIELDS, 0.0),
        "compression_rounds": 5.0,
        "kv_physical_tokens": 15.0,
        "compress_seconds": 0.5,
    }
    a.publish({"compression_rounds": 4})  # a record is replaced whole
    assert read_totals(str(tmp_path))["compression_rounds"] == 7.0
    registry = CollectorRegistry()
    registry.register(Collector(str(tmp_path)))
    text = generate_latest(registry).decode()
    assert "kvllm:compression_rounds_total 7.0" in text
    assert "kvllm:kv_physical_tokens 5.0" in text
    assert "# TYPE kvllm:kv_blocks_saved gauge" in text
    a.close()
    b.close()
    a.close()  # twice is fine
    assert list(tmp_path.iterdir()) == []
    assert read_totals(str(tmp_path))["compression_rounds"] == 0.0
    assert read_totals(str(tmp_path / "missing")) == dict.fromkeys(FIELDS, 0.0)


def test_a_torn_record_is_never_read(tmp_path: Path) -> None:
    publisher = EnginePublisher(str(tmp_path), 0)
    publisher.publish({"compression_rounds": 1})
    raw = bytearray(publisher.path.read_bytes())
    raw[0] |= 1  # a writer caught mid-record forever: odd sequence
    (tmp_path / "engine-9-0-0.bin").write_bytes(bytes(raw))
    assert read_totals(str(tmp_path))["compression_rounds"] == 1.0  # the torn one is skipped
    publisher.close()


def test_records_of_engines_gone_without_closing_are_never_summed(tmp_path: Path) -> None:
    """An engine dropped without shutdown, and one whose process died."""
    import gc
    import subprocess
    import sys

    dropped = EnginePublisher(str(tmp_path), 0)
    dropped.publish({"compression_rounds": 5})
    del dropped
    gc.collect()
    code = (
        "import os, sys; from kvllm.vllm.metrics import EnginePublisher; "
        "p = EnginePublisher(sys.argv[1], 1); p.publish({'compression_rounds': 7}); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert len(list(tmp_path.glob("engine-1-*.bin"))) == 1  # it died holding its record
    live = EnginePublisher(str(tmp_path), 2)
    live.publish({"compression_rounds": 3})
    assert read_totals(str(tmp_path))["compression_rounds"] == 3.0
    assert [p.name for p in tmp_path.iterdir()] == [live.path.name]
    live.close()


def test_a_multiprocess_registry_exports_the_totals_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an API server of `--api-server-count` > 1 serves: with PROMETHEUS_MULTIPROC_DIR
    set, vLLM's /metrics route (and /metrics/) answers from a multiprocess registry, not the
    global one; the kvllm:* metrics are on it once, live from the engines' records."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import multiprocess
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    from kvllm.vllm.server import install_multiprocess_metrics

    (tmp_path / "prometheus").mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))
    monkeypatch.setenv(ENV, str(tmp_path / "records"))
    # Restored after the test: install_multiprocess_metrics replaces the class.
    monkeypatch.setattr(multiprocess, "MultiProcessCollector", multiprocess.MultiProcessCollector)
    install_multiprocess_metrics()
    install_multiprocess_metrics()  # idempotent
    publisher = EnginePublisher(str(tmp_path / "records"), 0)
    app = FastAPI()
    attach_router(app)
    client = TestClient(app)
    for rounds, path in enumerate(["/metrics", "/metrics/", "/metrics"]):
        publisher.publish({"compression_rounds": rounds, "tokens_dropped": 8 * rounds})
        lines = client.get(path).text.splitlines()
        assert [line for line in lines if line.startswith("kvllm:compression_rounds_total")] == [
            f"kvllm:compression_rounds_total {float(rounds)}"
        ]
        assert f"kvllm:tokens_dropped_total {8.0 * rounds}" in lines
        assert not any(line.startswith("python_gc_objects_collected_total") for line in lines)  # not REGISTRY
    publisher.close()


def _chunk(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def test_splice_adds_the_statistics_to_the_final_chunk_only() -> None:
    finish = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]}
    token = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    spliced = _splice(_chunk(finish), STATS, usage=False)
    assert spliced.endswith("}\n\n") and spliced.startswith("data: {")
    assert json.loads(spliced[len("data: ") :]) == {**finish, "kv_transfer_params": STATS}
    assert json.loads(_splice(_chunk(usage), STATS, usage=True)[6:]) == {**usage, "kv_transfer_params": STATS}
    assert _splice(_chunk(token), STATS, usage=False) is None
    assert _splice(_chunk(finish), STATS, usage=True) is None  # with usage, only the usage chunk
    assert _splice(_chunk(usage), STATS, usage=False) is None
    assert _splice("data: [DONE]\n\n", STATS, usage=False) is None
    assert _splice(_chunk({"error": {"message": "x"}}), STATS, usage=True) is None
