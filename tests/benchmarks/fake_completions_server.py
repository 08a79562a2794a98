# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A stand-in for ``vllm serve`` in CPU tests of ``bench_ddtree.py serve``:
``/health``, a streaming OpenAI ``/v1/completions`` that sends ``chunks`` text
chunks and a usage record per request, and ``/metrics`` with vLLM's
speculative-decoding counters (each request: ``chunks`` drafts of 15 tokens,
``ACCEPTED`` of them accepted, ``ACCEPTED`` at position 0).

Run as a script: ``python fake_completions_server.py PORT CHUNKS [DELAY_S
[ACCEPTED [DIE_AFTER]]]`` (``DELAY_S`` between chunks, like a server's steps;
``ACCEPTED`` tokens per draft in place of the default; the process exits after
``DIE_AFTER`` completions, a server that goes away mid-run)."""

import asyncio
import json
import os
import sys

from aiohttp import web

DRAFT_TOKENS = 15
ACCEPTED = 2
SEEN = web.AppKey("seen", list)
RUNNING = web.AppKey("running", list)
FAKE_KV_BLOCKS = 1000


def make_app(
    chunks: int,
    delay_s: float = 0.0,
    accepted: int = ACCEPTED,
    die_after: int | None = None,
) -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app[RUNNING] = [0]

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        app[RUNNING][0] += 1
        try:
            for i in range(chunks):
                if delay_s:
                    await asyncio.sleep(delay_s)
                data = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await resp.write(f"data: {json.dumps(data)}\n\n".encode())
        finally:
            app[RUNNING][0] -= 1
        usage = {"completion_tokens": chunks, "prompt_tokens": 5}
        tail = {"choices": [], "usage": usage}
        await resp.write(f"data: {json.dumps(tail)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        app[SEEN].append(body)
        if die_after is not None and len(app[SEEN]) >= die_after:
            os._exit(1)
        return resp

    async def health(request):
        return web.Response(text="ok")

    async def metrics(request):
        drafts = chunks * len(app[SEEN])
        lines = [
            f"vllm:spec_decode_num_drafts_total {drafts}",
            f"vllm:spec_decode_num_draft_tokens_total {drafts * DRAFT_TOKENS}",
            f"vllm:spec_decode_num_accepted_tokens_total {drafts * accepted}",
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} '
            f"{drafts * accepted}",
            # KV: a quarter of FAKE_KV_BLOCKS in use by the requests in flight.
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {app[RUNNING][0]}',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            f'vllm:cache_config_info{{block_size="16",engine="0",'
            f'num_gpu_blocks="{FAKE_KV_BLOCKS}"}} 1.0',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    port, chunks = int(sys.argv[1]), int(sys.argv[2])
    delay_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    accepted = int(sys.argv[4]) if len(sys.argv) > 4 else ACCEPTED
    die_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
    app = make_app(chunks, delay_s, accepted, die_after)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def start_in_thread(port: int, chunks: int):
    """The server on ``port`` in a thread: (its request bodies, a stopper)."""
    import threading

    app = make_app(chunks)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return app[SEEN], stop


if __name__ == "__main__":
    main()
