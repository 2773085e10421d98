"""No request takes the server down: bad input gets a 4xx, and a bounded soak stays clean.

Every input that used to kill the scheduler (and with it the server and every request in
flight) and the rest of its family is sent to ``launch_server --impl transformers``; each
gets a 4xx with a message, a normal request succeeds right after, and the server process is
the same one. The soak mixes valid and invalid requests, streaming or not, and clients that
disconnect mid-stream, 1,000 requests at concurrency 64: no 5xx, every valid greedy answer
equals its reference, and memory after the soak stays within 10% of memory after warm-up.
Longer soaks by hand: ``SOAK_REQUESTS=20000 pytest test/srt/engine/test_server_robustness.py -k soak``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import psutil
import pytest
import requests

from sglang_hf_backend.testing.engines import PROMPTS, Server, ours_server, running_engine

MODEL = "llama"
VOCAB = 1024
GREEDY = {"temperature": 0, "max_new_tokens": 8}
CHAT = [{"role": "user", "content": "hi"}]
# name -> (endpoint, body, what the message must say)
BAD_REQUESTS = {
    "chat top_logprobs beyond the vocabulary": (
        "/v1/chat/completions",
        {"model": "default", "messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5000},
        "top_logprobs / logprobs = 5000",
    ),
    "completions logprobs beyond the vocabulary": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 4, "logprobs": 5000},
        "more alternatives than the vocabulary has",
    ),
    "generate top_logprobs_num beyond the vocabulary": (
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 5000, "sampling_params": GREEDY},
        "top_logprobs / logprobs = 5000",
    ),
    "token id past the vocabulary": (
        "/generate",
        {"input_ids": [5, 6, 99999], "sampling_params": GREEDY},
        "prompt token id 99999 at position 2 is outside the vocabulary",
    ),
    "negative token id": (
        "/generate",
        {"input_ids": [5, -3, 7], "sampling_params": GREEDY},
        "prompt token id -3 at position 1",
    ),
    "completions token prompt past the vocabulary": (
        "/v1/completions",
        {"model": "default", "prompt": [5, 6, 99999], "max_tokens": 4},
        "prompt token id 99999",
    ),
    "stop token id past the vocabulary": (
        "/generate",
        {"text": "hi", "sampling_params": {**GREEDY, "stop_token_ids": [99999]}},
        "stop_token_ids token id 99999",
    ),
    "logit_bias id past the vocabulary": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 4, "logit_bias": {"99999": 5}},
        "logit_bias",
    ),
    "min_tokens above max_tokens": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 4, "min_tokens": 10},
        "min_new_tokens",
    ),
    "regex that does not compile": (
        "/generate",
        {"text": "hi", "sampling_params": {**GREEDY, "regex": "([a-z"}},
        "regex",
    ),
    "JSON schema that does not parse": (
        "/generate",
        {"text": "hi", "sampling_params": {**GREEDY, "json_schema": "{not json"}},
        "json",
    ),
    "input_embeds": (
        "/generate",
        {"input_embeds": [[0.1, 0.2, 0.3]], "sampling_params": GREEDY},
        "input_embeds",
    ),
    "adapter that is not loaded": (
        "/generate",
        {"text": "hi", "lora_path": "nope", "sampling_params": GREEDY},
        "LoRA",
    ),
    "logprob_start_len past the prompt": (
        "/generate",
        {"text": "hi", "return_logprob": True, "logprob_start_len": 500, "sampling_params": GREEDY},
        "logprob_start_len",
    ),
    "n beyond 128 completions": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 4, "n": 100000},
        "n = 100000 completions per request",
    ),
    "max_tokens beyond the context": (
        "/v1/completions",
        {"model": "default", "prompt": "hi", "max_tokens": 10**9},
        "context length",
    ),
    "malformed JSON": ("/v1/completions", "{not json", ""),
}


@pytest.fixture(scope="module")
def references(checkpoint) -> dict[str, str]:
    """Greedy texts from an engine, taken before the server starts (an engine's shutdown ends children)."""
    with running_engine(checkpoint(MODEL), impl="transformers") as engine:
        outputs = engine.engine.generate(PROMPTS, GREEDY)
        with pytest.raises(ValueError, match="prompt token id 99999 at position 1"):
            engine.engine.generate(input_ids=[5, 99999], sampling_params=GREEDY)
        assert engine.engine.generate(PROMPTS[0], GREEDY)["text"] == outputs[0]["text"]  # still serving
    return {prompt: out["text"] for prompt, out in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, references):
    srv = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("robust") / "server.log")
    yield srv
    srv.stop()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_and_the_server_keeps_serving(server, references, case):
    endpoint, body, says = BAD_REQUESTS[case]
    pid = server.process.pid
    if isinstance(body, str):
        reply = requests.post(
            server.url + endpoint, data=body, headers={"Content-Type": "application/json"}, timeout=60
        )
    else:
        reply = requests.post(server.url + endpoint, json=body, timeout=60)
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text[:300])
    assert says.lower() in reply.text.lower() and len(reply.text) > 20
    ok = requests.post(
        server.url + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=60
    )
    assert ok.status_code == 200 and ok.json()["text"] == references[PROMPTS[0]]
    assert server.process.poll() is None and server.process.pid == pid


def test_unknown_model_name_is_a_404(server):
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}
    reply = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 404
    error = reply.json()
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert "The model `no-such-model` does not exist" in error["message"]
    for name in ("default", str(server_model_path(server))):  # what the server does serve
        body["model"] = name
        assert requests.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


def server_model_path(server: Server) -> str:
    info = requests.get(server.url + "/v1/models", timeout=30).json()
    return info["data"][0]["id"]


def tree_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def test_soak_mixed_traffic(server, references):
    """Bounded: 1,000 requests (SOAK_REQUESTS to change), concurrency 64, about a minute here."""
    import aiohttp

    total = int(os.environ.get("SOAK_REQUESTS", 1000))
    for prompt in PROMPTS:  # warm-up
        requests.post(server.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
    rss_after_warmup = tree_rss(server.process.pid)
    rng = random.Random(0)
    kinds = ["valid", "valid", "valid_stream", "invalid", "disconnect"]
    results: dict[str, list] = {"5xx": [], "mismatch": [], "valid": [], "invalid_status": []}

    async def one(session: aiohttp.ClientSession, semaphore: asyncio.Semaphore, index: int) -> None:
        kind, prompt = rng.choice(kinds), rng.choice(PROMPTS)
        async with semaphore:
            if kind == "invalid":
                endpoint, body, _ = rng.choice(list(BAD_REQUESTS.values()))
                payload = (
                    {"data": body, "headers": {"Content-Type": "application/json"}}
                    if isinstance(body, str)
                    else {"json": body}
                )
                async with session.post(server.url + endpoint, **payload) as reply:
                    await reply.read()
                    if reply.status >= 500:
                        results["5xx"].append((endpoint, reply.status))
                    elif not 400 <= reply.status < 500:
                        results["invalid_status"].append((endpoint, reply.status))
                return
            body = {"text": prompt, "sampling_params": GREEDY, "stream": kind != "valid"}
            async with session.post(server.url + "/generate", json=body) as reply:
                if reply.status >= 500:
                    results["5xx"].append(("/generate", reply.status))
                    return
                if kind == "disconnect":
                    await reply.content.readline()  # read a little, then hang up
                    reply.close()
                    return
                if kind == "valid":
                    text = (await reply.json())["text"]
                else:
                    text = ""
                    async for raw in reply.content:
                        line = raw.strip()
                        if line.startswith(b"data:") and line != b"data: [DONE]":
                            text = json.loads(line[5:])["text"]  # cumulative
                results["valid"].append(index)
                if text != references[prompt]:
                    results["mismatch"].append((prompt, text))

    async def soak() -> None:
        semaphore = asyncio.Semaphore(64)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(one(session, semaphore, i) for i in range(total)))

    asyncio.run(soak())
    rss_after = tree_rss(server.process.pid)
    print(
        f"soak: {total} requests, {len(results['valid'])} valid answers, RSS {rss_after_warmup / 2**20:.0f} MB "
        f"after warm-up -> {rss_after / 2**20:.0f} MB after ({rss_after / rss_after_warmup:.3f}x)"
    )
    assert results["5xx"] == [] and results["invalid_status"] == []
    assert results["mismatch"] == []
    assert len(results["valid"]) > total / 3
    assert server.process.poll() is None
    assert rss_after <= 1.10 * rss_after_warmup
