# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The e2e engine runner's result cache (CPU): reused only for the same
configuration and sources; failures are reported, never cached."""

import json
import subprocess
import threading

import pytest

from tests.e2e import engines


@pytest.fixture(autouse=True)
def _own_gpu_lock(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.GPU_LOCK_ENV, str(tmp_path / "gpu.lock"))


class FakeEngineProcess:
    """Stands in for ``subprocess.run`` of ``tests.e2e.generate``."""

    def __init__(self, returncode: int = 0):
        self.calls = 0
        self.returncode = returncode

    def __call__(self, argv, **kwargs):
        self.calls += 1
        config = json.loads(open(argv[-2]).read())
        if self.returncode == 0:
            with open(argv[-1], "w") as f:
                json.dump({"runs": {"echo": config, "call": self.calls}}, f)
        return subprocess.CompletedProcess(argv, self.returncode, "engine log")


def test_results_are_reused_for_the_same_config_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    fake = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", fake)
    configs = {"a": {"llm": {"model": "m"}}, "b": {"llm": {"model": "n"}}}
    first = engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 2
    again = engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 2 and again == first
    # A different configuration runs.
    engines.run_engines({"a": {"llm": {"model": "other"}}}, tmp_path, "t")
    assert fake.calls == 3
    # Changed sources invalidate every result.
    monkeypatch.setattr(engines, "_source_digest", lambda: "changed")
    engines.run_engines(configs, tmp_path, "t")
    assert fake.calls == 5


def test_failures_are_reported_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    failing = FakeEngineProcess(returncode=1)
    monkeypatch.setattr(engines.subprocess, "run", failing)
    out = engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    assert out["a"] == {"error": "engine log"}
    working = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", working)
    assert "runs" in engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")["a"]
    assert working.calls == 1


def test_without_cache_dir_every_run_starts_an_engine(tmp_path, monkeypatch):
    monkeypatch.delenv(engines.CACHE_ENV, raising=False)
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    fake = FakeEngineProcess()
    monkeypatch.setattr(engines.subprocess, "run", fake)
    engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")
    assert fake.calls == 2


def test_parallel_runs_overlap_with_own_compile_caches(tmp_path, monkeypatch):
    """DDTREE_E2E_PARALLEL=3 starts three engines at once (each waits for the
    others at a barrier, which would time out if they ran one by one), each with
    its own compile cache; results keep the order of the configurations."""
    monkeypatch.delenv(engines.CACHE_ENV, raising=False)
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    monkeypatch.setenv(engines.PARALLEL_ENV, "3")
    barrier = threading.Barrier(3, timeout=30)
    roots = []

    def fake(argv, env, **kwargs):
        roots.append(env["VLLM_CACHE_ROOT"])
        barrier.wait()
        with open(argv[-1], "w") as f:
            json.dump({"runs": {"root": env["VLLM_CACHE_ROOT"]}}, f)
        return subprocess.CompletedProcess(argv, 0, "engine log")

    monkeypatch.setattr(engines.subprocess, "run", fake)
    configs = {
        name: {"llm": {"model": name, "kv_cache_memory_bytes": 1}}
        for name in ("c", "a", "b")
    }
    out = engines.run_engines(configs, tmp_path, "t")
    assert list(out) == ["c", "a", "b"]
    assert len(set(roots)) == 3
    assert [out[n]["runs"]["root"].endswith(n) for n in out] == [True] * 3


def test_parallel_must_be_a_positive_integer(tmp_path, monkeypatch):
    monkeypatch.setenv(engines.PARALLEL_ENV, "0")
    with pytest.raises(ValueError, match="DDTREE_E2E_PARALLEL"):
        engines.run_engines({"a": {"llm": {}}}, tmp_path, "t")


def test_engine_kwargs_use_a_fixed_kv_cache(tmp_path):
    """No memory profiling (it fails when engines run side by side)."""
    kwargs = engines.llm_kwargs(tmp_path / "m")
    assert kwargs["kv_cache_memory_bytes"] == engines.KV_CACHE_BYTES


def test_a_profiling_engine_waits_for_the_gpu_to_itself(tmp_path, monkeypatch):
    """While another test process holds the GPU (a shared ``gpu_share``), an
    engine with a fixed KV cache starts and one with vLLM's memory profiling
    (no ``kv_cache_memory_bytes``) waits until it is released."""
    monkeypatch.delenv(engines.CACHE_ENV, raising=False)
    monkeypatch.delenv("DDTREE_E2E_LOG_DIR", raising=False)
    started = []

    def fake(argv, **kwargs):
        started.append(json.loads(open(argv[-2]).read())["llm"]["model"])
        with open(argv[-1], "w") as f:
            json.dump({"runs": {}}, f)
        return subprocess.CompletedProcess(argv, 0, "engine log")

    monkeypatch.setattr(engines.subprocess, "run", fake)
    fixed = {"fixed": {"llm": {"model": "fixed", "kv_cache_memory_bytes": 1}}}
    profiled = {"profiled": {"llm": {"model": "profiled"}}}
    with engines.gpu_share(exclusive=False):
        engines.run_engines(fixed, tmp_path, "t")
        assert started == ["fixed"]
        waiting = threading.Thread(
            target=engines.run_engines, args=(profiled, tmp_path, "t")
        )
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and started == ["fixed"]
    waiting.join(timeout=30)
    assert not waiting.is_alive() and started == ["fixed", "profiled"]
