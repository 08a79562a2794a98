# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The long-lived ``vllm bench serve`` client of ``bench_ddtree.py serve``: the
command lines it runs are the ones ``bench_command`` builds, parsed by vLLM's own
parser; one failed run does not stop the next; the parent's time limit kills
the client and later runs report failure."""

import io
import json
import sys
import textwrap

import pytest

from benchmarks import bench_ddtree as bd
from benchmarks import bench_serve_client as client
from tests.benchmarks.test_bench_ddtree import _pair


def _bench_cmd(tmp_path, batch=8, temperature=1.0):
    args = bd.parse_args(["serve", "--out", str(tmp_path / "o"), *_pair(tmp_path)])
    return bd.bench_command(
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
    import json, sys, time
    sys.path.insert(0, {root!r})
    from benchmarks.bench_serve_client import serve_loop

    def run(argv):
        if "--sleep" in argv:
            time.sleep(60)
        if "--fail" in argv:
            raise RuntimeError("no")

    serve_loop(sys.stdin, sys.stdout, run)
    """
)


def test_serve_client_runs_fails_and_is_killed_at_the_limit(tmp_path):
    script = tmp_path / "fake_client.py"
    script.write_text(FAKE_CLIENT.format(root=str(bd.ROOT)))
    cmd = _bench_cmd(tmp_path)
    with (tmp_path / "log").open("w") as log:
        c = bd.ServeClient(log, dict(bd.os.environ), [sys.executable, str(script)])
        try:
            assert c.run(cmd, 60.0)
            assert not c.run(cmd + ["--fail"], 60.0)
            assert c.run(cmd, 60.0)  # the client outlives a failed run
            assert not c.run(cmd + ["--sleep"], 1.0)
            assert c.proc.poll() is not None  # killed at the limit
            assert not c.run(cmd, 60.0)
        finally:
            c.close()
    assert "RuntimeError: no" in (tmp_path / "log").read_text()


def _fake_completions_server(port: int, chunks: int):
    """An OpenAI-style streaming /v1/completions that sends ``chunks`` text
    chunks and a usage record per request, in a thread; returns a stopper."""
    import asyncio
    import threading

    from aiohttp import web

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            data = {"choices": [{"index": 0, "text": f" t{i}"}]}
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())
        usage = {"completion_tokens": chunks, "prompt_tokens": 5}
        await resp.write(
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        )
        await resp.write(b"data: [DONE]\n\n")
        request.app["seen"].append(body)
        return resp

    app = web.Application()
    app["seen"] = []
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return app["seen"], stop


def test_serve_client_runs_vllm_bench_serve_twice_in_one_process(tmp_path):
    """The real client against a fake server: a warm-up and a timed run of one
    (batch, temperature), as run_serve_config sends them, each writes vLLM's
    result JSON with every request completed, from one process."""
    from tests.e2e.servers import free_port

    port = free_port()
    seen, stop = _fake_completions_server(port, chunks=6)
    pair = bd.ROOT / "benchmarks" / "models" / "pycode"
    args = bd.parse_args(
        [
            "serve",
            "--out",
            str(tmp_path / "o"),
            "--target",
            str(pair / "target"),
            "--drafter",
            str(pair / "drafter"),
            "--prompts",
            str(pair / "eval_prompts.json"),
            "--max-tokens",
            "6",
        ]
    )
    prompts = bd.load_prompts(pair / "eval_prompts.json")
    result = tmp_path / "r.json"
    warm, timed = bd.serve_run_commands(
        args, f"http://127.0.0.1:{port}", prompts, None, 2, 0.0, result, 0
    )
    try:
        with (tmp_path / "log").open("w") as log:
            c = bd.ServeClient(log, dict(bd.os.environ))
            try:
                assert c.run(warm, 300.0), (tmp_path / "log").read_text()[-3000:]
                assert c.run(timed, 300.0), (tmp_path / "log").read_text()[-3000:]
                pid = c.proc.pid
                assert c.proc.poll() is None  # the same process ran both
            finally:
                c.close()
    finally:
        stop()
    n = max(args.num_prompts, 2 * args.min_waves)
    for path, want in ((result.with_suffix(".warmup.json"), 2), (result, n)):
        data = json.loads(path.read_text())
        assert data["completed"] == want and data["failed"] == 0, path
        assert data["max_concurrency"] == 2
        assert data["total_output_tokens"] == 6 * want
    # The fake server also answered vLLM's ready check; every timed request
    # carried the run's sampling settings.
    assert len(seen) >= 2 + n and pid > 0
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 6 for b in seen[-n:])
