"""``python -m sglang.launch_server --impl transformers`` over HTTP on 127.0.0.1, one server.

The OpenAI-compatible endpoints (plain and streaming completions, chat completions) and
SGLang's ``/generate`` all answer with the text of HF ``generate``'s greedy tokens for the
same prompt (chat: the chat-templated prompt).

No request takes the server down: every input that used to kill the scheduler (and with it
the server and every request in flight) and the rest of its family gets a 4xx with a message,
a normal request succeeds right after, and the server process is the same one. The soak mixes
valid and invalid requests, streaming or not, and clients that disconnect mid-stream, 1,000
requests at concurrency 64: no 5xx, every valid greedy answer equals its reference, and memory
after the soak stays within 10% of memory after warm-up. Longer soaks by hand:
``SOAK_REQUESTS=20000 pytest test/srt/engine/test_server.py -k soak``.

Last, SIGTERM shuts the server and its children down.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import psutil
import pytest
import requests
from transformers import AutoTokenizer

from sglang_hf_backend.testing.engines import (
    NEW_TOKENS,
    PROMPTS,
    Server,
    hf_greedy,
    ours_server,
    running_engine,
)

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
    """One server for the module; the last test stops it with SIGTERM."""
    srv = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()  # a no-op once the SIGTERM test stopped it


@pytest.fixture(scope="module")
def hf_texts(checkpoint) -> tuple[list[str], str]:
    """HF's greedy answers, decoded: one per prompt, and one for the first prompt as a chat."""
    path = checkpoint(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    prompts = [tokenizer(text).input_ids for text in [*PROMPTS, chat]]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in hf_greedy(path, prompts)]
    return texts[:-1], texts[-1]


def test_log_names_our_class(server):
    assert "sglang_hf_backend: serving LlamaForCausalLM with TransformersForCausalLM" in server.log()


def test_completions_match_hf(server, hf_texts):
    texts, _ = hf_texts
    for prompt, expected in zip(PROMPTS, texts):
        body = {"model": "default", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == expected


def test_streaming_completion_matches_hf(server, hf_texts):
    texts, _ = hf_texts
    body = {
        "model": "default",
        "prompt": PROMPTS[1],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    pieces = []
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
    assert len(pieces) > 1
    assert "".join(pieces) == texts[1]


def test_chat_completion_matches_hf(server, hf_texts):
    _, expected = hf_texts
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }
    reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == expected


def test_generate_matches_hf(server, hf_texts):
    texts, _ = hf_texts
    body = {"text": PROMPTS[2], "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert reply["text"] == texts[2]


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


def test_idle_server_leaves_the_cores_alone(server, references):
    """Idle, the scheduler waits for requests (the platform's sleep_on_idle) instead of polling
    for them, which kept a core busy."""
    reply = requests.post(
        server.url + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=60
    )
    assert reply.json()["text"] == references[PROMPTS[0]]
    launcher = psutil.Process(server.process.pid)
    processes = [launcher, *launcher.children(recursive=True)]
    time.sleep(1)  # what the last request left to finish
    before = sum(sum(p.cpu_times()[:2]) for p in processes)
    time.sleep(2)
    used = sum(sum(p.cpu_times()[:2]) for p in processes) - before
    print(f"idle server: {used:.2f} s of CPU in 2 s")
    assert used < 0.4


def test_sigterm_shuts_down_cleanly(server):
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert children, "the server should run scheduler/detokenizer subprocesses"
    code = server.stop()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"subprocesses left running: {alive}"
    assert code in (0, -15), server.log()[-2000:]
