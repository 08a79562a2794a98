# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The long-lived ``vllm bench serve`` client of ``bench_ddtree.py serve``: the
command lines it runs are the ones ``bench_command`` builds, parsed by vLLM's own
parser; one failed run does not stop the next; the parent's time limit kills
the client and later runs report failure."""

import functools
import io
import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import bench_ddtree as bd
from benchmarks import bench_ddtree_config as bdc
from benchmarks import bench_ddtree_procs as bdp
from benchmarks import bench_ddtree_serve as bds
from benchmarks import bench_serve_client as client
from benchmarks import host_usage as hu
from tests.benchmarks import fake_completions_server as fake
from tests.benchmarks.test_bench_ddtree import _pair


def _bench_cmd(tmp_path, batch=8, temperature=1.0):
    args = bd.parse_args(["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)])
    return bds.bench_command(
        args, "http://h:1", tmp_path / "d.json", batch, temperature, tmp_path / "r.json"
    )


def test_bench_command_parses_as_vllm_bench_serve(tmp_path):
    """What the parent sends is what ``vllm bench serve`` would have parsed."""
    cmd = _bench_cmd(tmp_path)
    ns = client.parse_bench_args(client.bench_args(cmd))
    assert ns.max_concurrency == 8
    assert ns.temperature == 1.0
    assert ns.dataset_name == "sharegpt"
    assert ns.base_url == "http://h:1"
    assert ns.save_result and ns.result_filename == "r.json"
    assert ns.num_warmups == 8
    with pytest.raises(ValueError, match="not a vllm bench serve"):
        client.bench_args([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"])


def test_serve_loop_answers_every_line(tmp_path):
    """Each line gets one answer; a failing run and a parser error answer
    non-zero and the loop goes on to the next line."""
    ran = []

    def run(argv):
        ran.append(argv)
        if "--fail" in argv:
            raise RuntimeError("server went away")
        if "--bad" in argv:
            client.parse_bench_args(argv)

    good = _bench_cmd(tmp_path)
    lines = [json.dumps(c) + "\n" for c in (good, good + ["--fail"], good + ["--bad"])]
    lines.insert(1, "\n")  # blank lines are skipped
    lines.append(json.dumps(good) + "\n")
    reply = io.StringIO()
    assert client.serve_loop(lines, reply, run) == 0
    answers = [json.loads(x)["rc"] for x in reply.getvalue().splitlines()]
    assert answers[0] == 0 and answers[3] == 0
    assert answers[1] == 1 and answers[2] != 0
    assert len(answers) == len(ran) == 4


FAKE_CLIENT = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    from benchmarks.bench_serve_client import serve_loop

    def run(argv):
        if "--sleep" in argv:
            time.sleep(60)
        if "--fail" in argv:
            raise RuntimeError("no")
        if "--die" in argv:
            os._exit(3)
        return {{"calls": 1}}

    serve_loop(sys.stdin, sys.stdout, run)
    """
)


def test_serve_client_runs_fails_and_is_killed_at_the_limit(tmp_path):
    script = tmp_path / "fake_client.py"
    script.write_text(FAKE_CLIENT.format(root=str(bd.ROOT)))
    cmd = _bench_cmd(tmp_path)
    with (tmp_path / "log").open("w") as log:
        argv = [sys.executable, str(script)]
        c = bdp.ServeClient(log, dict(bdc.os.environ), argv=argv)
        try:
            assert c.run(cmd, 60.0) and c.last_usage == {"calls": 1}
            assert not c.run(cmd + ["--fail"], 60.0) and c.last_usage is None
            assert c.run(cmd, 60.0)  # the client outlives a failed run
            assert not c.run(cmd + ["--sleep"], 1.0)
            assert c.proc.poll() is not None  # killed at the limit
            assert not c.run(cmd, 60.0)
        finally:
            c.close()
        # A client that dies mid-run: that run and every later one fail at once.
        c = bdp.ServeClient(log, dict(bdc.os.environ), argv=argv)
        try:
            assert c.run(cmd, 60.0)
            start = time.monotonic()
            assert not c.run(cmd + ["--die"], 60.0)
            assert not c.run(cmd, 60.0)
            assert time.monotonic() - start < 10.0
        finally:
            c.close()
    assert "RuntimeError: no" in (tmp_path / "log").read_text()


PAIR = bd.ROOT / "benchmarks" / "models" / "pycode"


def _serve_argv(max_tokens: int) -> list[str]:
    """bench_ddtree serve on the bundled pair (its tokenizer and prompts)."""
    return [
        "serve",
        "--target",
        str(PAIR / "target"),
        "--drafter",
        str(PAIR / "drafter"),
        "--prompts",
        str(PAIR / "eval_prompts.json"),
        "--max-tokens",
        str(max_tokens),
    ]


def test_serve_client_runs_vllm_bench_serve_twice_in_one_process(tmp_path):
    """The real client against a fake server: a warm-up and a timed run of one
    (batch, temperature), as run_serve_config sends them, each writes vLLM's
    result JSON with every request completed, from one process."""
    from benchmarks.checkout import free_port

    port = free_port()
    seen, stop = fake.start_in_thread(port, chunks=6)
    pair = PAIR
    args = bd.parse_args([*_serve_argv(6), "--out", str(tmp_path / "o")])
    prompts = bdc.load_prompts(pair / "eval_prompts.json")
    result = tmp_path / "r.json"
    warm, timed = bds.serve_run_commands(
        args, f"http://127.0.0.1:{port}", prompts, None, 2, 0.0, result, 0
    )
    try:
        with (tmp_path / "log").open("w") as log:
            c = bdp.ServeClient(log, dict(bdc.os.environ))
            try:
                assert c.run(warm, 300.0), (tmp_path / "log").read_text()[-3000:]
                assert c.run(timed, 300.0), (tmp_path / "log").read_text()[-3000:]
                assert c.proc.poll() is None  # the same process ran both
            finally:
                c.close()
    finally:
        stop()
    n = bds.serve_num_prompts(args, 2)
    for path, want in ((result.with_suffix(".warmup.json"), 2), (result, n)):
        data = json.loads(path.read_text())
        assert data["completed"] == want and data["failed"] == 0, path
        assert data["max_concurrency"] == 2
        assert data["total_output_tokens"] == 6 * want
    # Warm-up and timed requests, nothing else (vLLM's ready check is off by
    # default); every timed request carried the run's sampling settings.
    assert len(seen) == 2 + n
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 6 for b in seen[-n:])


def test_run_serve_config_through_the_client(tmp_path, monkeypatch):
    """bench_ddtree's serve path on the CPU, with a fake server in place of
    vllm serve: every (batch, temperature) gets a row from vLLM's result JSON
    (throughput, acceptance from the server's spec-decode counters, latency)
    and the host over its timed run (the server's busiest thread), and the
    warm-up and timed runs of all cells come from one client process."""

    chunks = 5
    pair = PAIR
    argv = [*_serve_argv(chunks), "--num-prompts", "4", "--min-waves", "2"]
    args = bd.parse_args([*argv, "--out", str(tmp_path / "o")])
    args.out.mkdir(parents=True)
    script = Path(fake.__file__)
    monkeypatch.setattr(
        bds,
        "serve_command",
        lambda a, config, max_batch, port: [
            sys.executable,
            str(script),
            str(port),
            str(chunks),
            "0.02",  # seconds per chunk: timed runs long enough to share out
        ],
    )
    clients = []
    real = bdp.ServeClient

    def recording(*a, **kw):
        clients.append(real(*a, **kw))
        return clients[-1]

    monkeypatch.setattr(bds, "ServeClient", recording)
    prompts = bdc.load_prompts(pair / "eval_prompts.json")
    runs = [(1, 0.0), (4, 1.0)]
    ok = bds.run_serve_config(args, "ddtree-64", 4, runs, prompts, "rid", 300.0)
    log = (args.out / "logs" / "ddtree-64.log").read_text()
    assert ok, log[-3000:]
    assert len(clients) == 1  # one client for every cell of the server
    rows = [
        json.loads(x) for x in (args.out / bd.RESULTS_FILE).read_text().splitlines()
    ]
    assert [(r["batch"], r["temperature"]) for r in rows] == runs
    for r, (batch, _) in zip(rows, runs):
        n = max(4, batch * 2)
        assert r["completed"] == n and r["failed"] == 0
        assert r["output_tokens"] == chunks * n
        assert r["tok_s"] > 0 and r["median_itl_ms"] is not None
        # 15 draft tokens per draft, 2 accepted: vLLM's acceptance length 3.
        assert r["acceptance_length"] == pytest.approx(1 + fake.ACCEPTED)
        # The host over vLLM's benchmark() call only: its window is the
        # benchmark's duration plus little (no vLLM import, no tokenizer load).
        usage = r["host_usage"]
        assert usage["timed_s"] == pytest.approx(r["wall_s"], abs=1e-3)
        assert r["wall_s"] <= usage["wall_s"] <= r["wall_s"] + 2.0, usage
        assert usage["warmup_requests"] == 0  # defaults: warm-ups run apart
        assert usage["calibration_ms"] > 0 and usage["step_thread"] is not None
        # The fake server sleeps between chunks: far from a busy step loop.
        assert 0.0 <= usage["step_thread_busy_pct"] <= 60.0, usage
        assert r["config"] == "ddtree-64" and r["run_id"] == "rid"
    # Tuned: one command with vLLM's own warm-up requests, counted as such.
    tuned = bd.parse_args([*argv, "--out", str(tmp_path / "t"), "--settings", "tuned"])
    tuned.out.mkdir(parents=True)
    assert bds.run_serve_config(tuned, "ddtree-64", 4, [(2, 0.0)], prompts, "r2", 300.0)
    (row,) = [
        json.loads(x) for x in (tuned.out / bd.RESULTS_FILE).read_text().splitlines()
    ]
    assert row["host_usage"]["warmup_requests"] == 2
    # --pin-cpus: the server is pinned once it is up (its log says so), and
    # this process has its CPUs back afterwards.
    mine = os.sched_getaffinity(0)
    if len(mine) > 1:
        pin = bd.parse_args(
            [*argv, "--out", str(tmp_path / "p"), "--pin-cpus", str(max(mine))]
        )
        pin.out.mkdir(parents=True)
        assert bds.run_serve_config(pin, "ddtree-64", 4, [(1, 0.0)], prompts, "r3", 300)
        assert os.sched_getaffinity(0) == mine
        log = (pin.out / "logs" / "ddtree-64.log").read_text()
        assert re.search(
            rf"pinned [1-9]\d* threads of this server to CPUs {max(mine)}", log
        )
        (row,) = [
            json.loads(x) for x in (pin.out / bd.RESULTS_FILE).read_text().splitlines()
        ]
        assert row["pin_cpus"] == str(max(mine))  # on the row, not only the setup
        # A server that cannot be pinned is a failed one, and the CPUs come back.
        monkeypatch.setattr(
            bdc,
            "pin_process_tree",
            lambda pid, cpus: (_ for _ in ()).throw(OSError(22, "Invalid argument")),
        )
        bad = bd.parse_args(
            [*argv, "--out", str(tmp_path / "b"), "--pin-cpus", str(max(mine))]
        )
        bad.out.mkdir(parents=True)
        assert not bds.run_serve_config(
            bad, "ddtree-64", 4, [(1, 0.0)], prompts, "r4", 300
        )
        assert os.sched_getaffinity(0) == mine
        log = (bad.out / "logs" / "ddtree-64.log").read_text()
        assert "could not pin this server to CPUs: OSError" in log


# The client class and server start themselves (tests below replace them).
REAL_CLIENT = bdp.ServeClient
REAL_START_SERVER = bds.start_server


def _interleaved(
    tmp_path, monkeypatch, name, extra, accepted, die_after=None, affinity=None
):
    """bench_ddtree serve --interleave 2 on fake servers (DFlash and DDTree auto,
    ``accepted`` tokens per draft each, DDTree's server exiting after
    ``die_after`` requests): (args, the runs the client was sent as
    (config, result file, prompt texts, the configs whose servers were up),
    the rows, run_sweep's return code). ``affinity``, a list: per run, the CPUs
    of (every server thread, that run's client, this process) appended."""
    from benchmarks.checkout import free_port  # noqa: F401  (bench_ddtree's)

    chunks = 4
    argv = [*_serve_argv(chunks), "--num-prompts", "8", "--min-waves", "4"]
    argv += ["--configs", "dflash,ddtree-auto", "--interleave", "2"]
    argv += ["--temperatures", "0", *extra]
    args = bd.parse_args([*argv, "--out", str(tmp_path / name)])
    script = Path(fake.__file__)
    ports, memory = {}, {}

    def fake_serve(a, config, max_batch, port):
        ports[port] = config
        memory[config] = a.gpu_memory_utilization
        cmd = [sys.executable, str(script), str(port), str(chunks), "0.01"]
        cmd.append(str(accepted[config]))
        if die_after and config in die_after:
            cmd.append(str(die_after[config]))
        return cmd

    monkeypatch.setattr(bds, "serve_command", fake_serve)
    pids = {}

    def start_server(*a, **kw):
        server, base = REAL_START_SERVER(*a, **kw)
        pids[ports[int(base.rsplit(":", 1)[1])]] = server.pid
        return server, base

    monkeypatch.setattr(bds, "start_server", start_server)
    order = []

    class Recording(REAL_CLIENT):
        def run(self, cmd, time_left):
            port = int(cmd[cmd.index("--base-url") + 1].rsplit(":", 1)[1])
            name = cmd[cmd.index("--result-filename") + 1]
            data = json.loads(Path(cmd[cmd.index("--dataset-path") + 1]).read_text())
            texts = [d["conversations"][0]["value"] for d in data]
            # Every server is up while any of them runs (the point of it).
            up = []
            for other in ports:
                try:
                    bds.urllib.request.urlopen(
                        f"http://127.0.0.1:{other}/health", timeout=5
                    )
                    up.append(ports[other])
                except OSError:
                    pass
            order.append((ports[port], name, texts, sorted(up)))
            if affinity is not None:
                import psutil

                threads = [
                    t.id
                    for pid in pids.values()
                    for p in hu.process_tree(psutil.Process(pid))
                    for t in p.threads()
                ]
                affinity.append(
                    (
                        {frozenset(os.sched_getaffinity(t)) for t in threads},
                        os.sched_getaffinity(self.proc.pid),
                        os.sched_getaffinity(0),
                    )
                )
            return super().run(cmd, time_left)

    monkeypatch.setattr(bds, "ServeClient", Recording)
    # The fake servers' requests last tens of ms: sample their /metrics often.
    monkeypatch.setattr(
        bds, "KvSampler", functools.partial(bds.KvSampler, interval_s=0.005)
    )
    rc = bd.run_sweep(args)
    assert memory == {"dflash": 0.45, "ddtree-auto": 0.45}
    rows = [
        json.loads(x) for x in (args.out / bd.RESULTS_FILE).read_text().splitlines()
    ]
    return args, order, rows, rc


def test_interleaved_serve_through_the_client(tmp_path, monkeypatch):
    """--interleave on the CPU, fake servers in place of vllm serve: both
    servers are up at once, each cell warms up every server and then runs its
    timed requests as slices alternating ABBA between them, and each config's
    row adds up its slices (requests, tokens, acceptance) from its own server;
    every server gets the same prompt texts, each new to it. Resumed, only the
    cells not yet measured run."""
    accepted = {"dflash": 2, "ddtree-auto": 5}
    args, order, rows, rc = _interleaved(
        tmp_path, monkeypatch, "o", ["--batches", "1,2"], accepted
    )
    assert rc == 0, (args.out / "logs" / "dflash.log").read_text()[-3000:]
    setup = bdc.setup_of(args)
    assert setup["interleave"] == 2 and setup["interleave_gpu_memory"] == 0.45
    assert sorted((r["config"], r["batch"]) for r in rows) == sorted(
        (c, b) for c in ("dflash", "ddtree-auto") for b in (1, 2)
    )
    for r in rows:
        n = bds.serve_num_prompts(args, r["batch"])  # 8 at batch 1 and 2
        assert r["slices"] == 2 and len(r["slices_tok_s"]) == 2
        assert r["interleaved_with"] == [c for c in accepted if c != r["config"]]
        assert r["completed"] == n and r["failed"] == 0
        assert r["output_tokens"] == 4 * n
        # Each row's acceptance is its own server's (5 vs 2 accepted per draft).
        assert r["acceptance_length"] == pytest.approx(1 + accepted[r["config"]])
        assert r["host_usage"]["slices"] == 2
        # KV from the server's /metrics: a quarter of its 1000 blocks over the
        # 1 or 2 requests running.
        kv = r["kv_usage"]
        assert kv["samples"] >= 1 and kv["num_gpu_blocks"] == fake.FAKE_KV_BLOCKS
        assert 125 <= kv["blocks_per_running_request"] <= 250
    assert all(up == sorted(accepted) for *_, up in order)
    assert "KV blocks per running request" in (args.out / bd.REPORT_FILE).read_text()
    # Per cell: both warm-ups, then slices A B, B A (the plan's config order).
    first, second = [c for c, _, _ in bd.plan(args, set())]
    for batch in (1, 2):
        cell = [(c, n) for c, n, *_ in order if f"_b{batch}_" in n]
        assert [c for c, _ in cell] == [first, second, first, second, second, first]
        kinds = [n.rsplit(".", 2)[1] for _, n in cell]
        assert kinds == ["warmup", "warmup", "slice0", "slice0", "slice1", "slice1"]
    # Same texts for both servers in every run, none repeated within a server.
    by_name = {}
    for config, name, texts, _ in order:
        by_name.setdefault(name.replace(config, "C"), []).append(texts)
    assert all(len(v) == 2 and v[0] == v[1] for v in by_name.values())
    for config in (first, second):
        seen = [t for c, _, texts, _ in order if c == config for t in texts]
        assert len(seen) == len(set(seen)) == (1 + 2) + 2 * 8  # warm-ups, slices
    # Resumed with one more concurrency: only its cell runs, for both configs.
    more, order2, rows2, rc2 = _interleaved(
        tmp_path,
        monkeypatch,
        "o2",
        ["--batches", "1,2,4", "--resume-from", str(args.out)],
        accepted,
    )
    assert rc2 == 0
    assert {n.split("_b")[1].split("_")[0] for _, n, *_ in order2} == {"4"}
    assert sorted((r["config"], r["batch"]) for r in rows2 if r["batch"] == 4) == [
        ("ddtree-auto", 4),
        ("dflash", 4),
    ]


def test_interleaved_servers_pinned_to_the_same_cpus(tmp_path, monkeypatch):
    """--pin-cpus: while any timed or warm-up run goes, every thread of every
    server is on the pinned CPUs and this process and the run's client on the
    others; the rows' setup says so; afterwards this process has its CPUs
    back."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one CPU here: nothing to pin a server to apart from clients")
    pinned = {max(mine)}
    seen = []
    args, order, rows, rc = _interleaved(
        tmp_path,
        monkeypatch,
        "p",
        ["--batches", "1", "--pin-cpus", str(max(mine))],
        {"dflash": 2, "ddtree-auto": 3},
        affinity=seen,
    )
    assert rc == 0, (args.out / "logs" / "dflash.log").read_text()[-3000:]
    assert os.sched_getaffinity(0) == mine
    assert len(seen) == len(order) == 6  # per server: a warm-up and two slices
    for servers, client_cpus, own in seen:
        assert servers == {frozenset(pinned)}
        assert client_cpus == own == mine - pinned
    assert len(rows) == 2
    assert bdc.setup_of(args)["pin_cpus"] == str(max(mine))
    for config in ("dflash", "ddtree-auto"):
        log = (args.out / "logs" / f"{config}.log").read_text()
        assert f"to CPUs {max(mine)}" in log


def test_interleaved_serve_drops_a_failed_server(tmp_path, monkeypatch, capsys):
    """DDTree's fake server exits in the second cell's first slice: the first
    cell's rows stay, DDTree is blamed (run_sweep fails), and DFlash measures
    the second cell alone over prompts its server has not seen."""
    accepted = {"dflash": 2, "ddtree-auto": 3}
    # Requests per server: cell 1: 1 warm-up + 2 x 4; cell 2: 2 warm-ups, then
    # the 12th request (slice 0 of cell 2) is the last.
    args, order, rows, rc = _interleaved(
        tmp_path,
        monkeypatch,
        "f",
        ["--batches", "1,2"],
        accepted,
        die_after={"ddtree-auto": 12},
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "ddtree-auto: a run of batch 2 T=0.0 failed" in out
    assert "only dflash to measure" not in out  # the cell began with both
    assert sorted((r["config"], r["batch"]) for r in rows) == [
        ("ddtree-auto", 1),
        ("dflash", 1),
        ("dflash", 2),
    ]
    (lone,) = [r for r in rows if r["batch"] == 2]
    assert lone["interleaved_with"] == [] and lone["failed"] == 0
    seen = [t for c, _, texts, _ in order if c == "dflash" for t in texts]
    assert len(seen) == len(set(seen))  # the re-run's prompts are new to it
