# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Traffic for ``tests/e2e/test_ddtree_load.py``, run in a process of its own.

    python -m tests.e2e.load_client stream URL OUT --seconds S --concurrency C
    python -m tests.e2e.load_client replay URL OUT --limit-file F --seconds S \
        --concurrency C [--offset K --stride N]

``stream``: C workers keep C streaming requests in flight for S seconds, taking
request 0, 1, 2, ... (:func:`request`); every fifth request is aborted mid-stream
(the client closes the connection once some of its tokens arrived). At S seconds the
streams still open are closed too: those are aborted at the deadline, with the
prefix they received. ``replay``: the same requests without streaming or aborts, in
order, until the count written to F (by the test, once the streams are done) is
reached or S seconds have passed (a reply still pending then is dropped);
``--offset K --stride N`` replays only requests K, K + N, K + 2N, ... so that N
servers can share the replay. Each request is one JSON line in OUT: its index, tokens,
per-position top logprobs ``[[token_id, logprob], ...]``, finish reason, whether it
was aborted and whether at the deadline, and the HTTP error if one happened.
"""

import argparse
import asyncio
import itertools
import json
import random
import time
from functools import cache
from pathlib import Path
from typing import TextIO

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
PAIR = ROOT / "benchmarks" / "models" / "pycode"
MODEL = "pycode"
MAX_MODEL_LEN = 2048
ABORT_EVERY = 5
GREEDY_LOGPROBS = 5
# compare_seeded needs both engines' tokens among the returned logprobs (the
# servers start with --max-logprobs SEEDED_LOGPROBS).
SEEDED_LOGPROBS = 50
REQUEST_TIMEOUT_S = 300
# Tries more for a reference reply whose connection the server dropped.
REPLAY_RETRIES = 1


def server_args(kv_bytes: int, spec: dict | None = None, **flags) -> list[str]:
    """``vllm serve`` arguments for the pair as the tests serve it: vLLM's
    defaults but for a fixed KV cache (servers share the GPU without memory
    profiling) and the given ``flags`` (``max_logprobs=50`` ->
    ``--max-logprobs 50``)."""
    args = [
        "--served-model-name",
        MODEL,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--gpu-memory-utilization",
        "0.1",
    ]
    for key, value in flags.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return args


@cache
def _corpus() -> list[int]:
    """The pair's held-out prompts as one token stream: prompts cut from it at
    different offsets are code the drafter knows and the engine has not seen."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(PAIR / "target" / "tokenizer.json"))
    texts = [
        p["text"]
        for p in json.loads((PAIR / "eval_prompts.json").read_text())["prompts"]
    ]
    return tok.encode("\n\n".join(texts)).ids


def request(i: int) -> dict:
    """Request i: a fresh prompt of mixed length (short, medium or long), mixed
    output lengths, greedy or seeded temperature 1 in pairs (i // 2 even: greedy;
    so each reference's parity gets both kinds alike), half of them
    stopping at the end-of-sequence token; every fifth closes its stream once
    ``abort_after`` tokens arrived (up to half its ``max_tokens``: a count of
    chunks would let most finish first, as a loaded server merges the deltas
    of several steps into one chunk)."""
    rng = random.Random(i)
    corpus = _corpus()
    length = rng.choice(
        [rng.randint(4, 64), rng.randint(64, 400), rng.randint(400, 1400)]
    )
    start = (i * 7919) % (len(corpus) - length)
    max_tokens = min(rng.choice([16, 48, 128, 256, 512]), MAX_MODEL_LEN - length - 1)
    greedy = (i // 2) % 2 == 0
    body = {
        "model": MODEL,
        "prompt": corpus[start : start + length],
        "max_tokens": max_tokens,
        "temperature": 0.0 if greedy else 1.0,
        "logprobs": GREEDY_LOGPROBS if greedy else SEEDED_LOGPROBS,
        "return_tokens_as_token_ids": True,
        "ignore_eos": rng.random() < 0.5,
    }
    if not greedy:
        body["seed"] = 10_000 + i
    abort_after = (
        rng.randint(1, max(1, max_tokens // 2))
        if i % ABORT_EVERY == ABORT_EVERY - 1
        else None
    )
    return {"body": body, "greedy": greedy, "abort_after": abort_after}


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _add_logprobs(out: dict, logprobs: dict | None) -> None:
    if not logprobs:
        return
    out["tokens"] += [_token_id(t) for t in logprobs["tokens"]]
    out["top"] += [
        [[_token_id(t), lp] for t, lp in top.items()]
        for top in logprobs["top_logprobs"]
    ]


async def _lines(content):
    """The stream's lines, however long: vLLM merges the deltas of steps a slow
    reader missed into one event, which with 50 logprobs per token can exceed
    aiohttp's ``readline`` limit."""
    pending = b""
    async for chunk in content.iter_any():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def _fetch(session, url: str, spec: dict, stream: bool, out: dict) -> None:
    """Fills ``out`` as the response arrives, so that a request cut short keeps
    what it received."""
    abort_after = spec["abort_after"] if stream else None
    body = {**spec["body"], "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return
        if not stream:
            choice = (await resp.json())["choices"][0]
            _add_logprobs(out, choice["logprobs"])
            out["finish"] = choice["finish_reason"]
            return
        async for line in _lines(resp.content):
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :])["choices"]
            if not choices:
                continue
            _add_logprobs(out, choices[0].get("logprobs"))
            out["finish"] = choices[0].get("finish_reason") or out["finish"]
            if abort_after is not None and len(out["tokens"]) >= abort_after:
                if out["finish"] is None:
                    out["aborted"] = True
                # Leaving the block closes the connection: vLLM aborts.
                return


async def _one(session, url: str, i: int, stream: bool, deadline: float) -> dict | None:
    """Request i until it ends or the loop's clock reaches ``deadline``: a stream
    then closes with what it received; a pending reply holds nothing (None)."""
    spec = request(i)
    out = {
        "i": i,
        "greedy": spec["greedy"],
        "tokens": [],
        "top": [],
        "finish": None,
        "aborted": False,
        "at_deadline": False,
        "error": None,
        # Wall-clock start and end: when errors happen, next to the module's
        # phases (its summary's ``start_epoch``).
        "t0": round(time.time(), 2),
    }
    try:
        async with asyncio.timeout_at(deadline) as cut:
            for attempt in range(1 + REPLAY_RETRIES * (not stream)):
                try:
                    await _fetch(session, url, spec, stream, out)
                    break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    # A reference reply lost in transport is asked again (the
                    # same request gives the same output); a DDTree stream's
                    # loss stays an error.
                    if stream or attempt == REPLAY_RETRIES or out["tokens"]:
                        raise
                    out["retries"] = attempt + 1
    except Exception as e:  # noqa: BLE001 - counted as this request's error
        # aiohttp's own timeout raises TimeoutError too: only ours is the deadline.
        if not cut.expired():
            out["error"] = f"{type(e).__name__}: {e}"[:500]
        elif not stream:
            return None
        else:
            out["at_deadline"] = True
            out["aborted"] = out["finish"] is None
    out["t1"] = round(time.time(), 2)
    return out


def _limit(path: Path | None) -> int | None:
    if path is None or not path.exists():
        return None
    return int(path.read_text())


async def _drive(
    url: str,
    f: TextIO,
    seconds: float,
    concurrency: int,
    stream: bool,
    limit_file: Path | None,
    offset: int = 0,
    stride: int = 1,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    indices = itertools.count(offset, stride)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    # No keep-alive: a pooled connection the server closed while idle fails
    # the next request on it with ServerDisconnectedError (aiohttp does not
    # retry); a new connection per request costs little on the loopback.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker():
            while loop.time() < deadline:
                i = next(indices)
                limit = _limit(limit_file)
                if not stream and limit is not None and i >= limit:
                    return
                out = await _one(session, url, i, stream, deadline)
                if out is not None:
                    f.write(json.dumps(out) + "\n")
                    f.flush()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["stream", "replay"])
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--limit-file", type=Path)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--stride", type=int, default=1)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        asyncio.run(
            _drive(
                args.url,
                f,
                args.seconds,
                args.concurrency,
                args.mode == "stream",
                args.limit_file,
                args.offset,
                args.stride,
            )
        )


if __name__ == "__main__":
    main()
