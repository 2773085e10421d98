"""``python -m sglang.launch_server --impl transformers`` over HTTP on 127.0.0.1.

The OpenAI-compatible endpoints (plain and streaming completions, chat completions) and
SGLang's ``/generate`` all answer with the text of HF ``generate``'s greedy tokens for the
same prompt (chat: the chat-templated prompt); SIGTERM then shuts the server and its
children down.
"""

from __future__ import annotations

import json

import psutil
import pytest
import requests
from transformers import AutoTokenizer

from sglang_hf_backend.testing.engines import NEW_TOKENS, PROMPTS, hf_greedy, ours_server

MODEL = "llama"


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


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """One server for the module; the last test stops it with SIGTERM."""
    srv = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()  # a no-op once the SIGTERM test stopped it


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


def test_sigterm_shuts_down_cleanly(server):
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert children, "the server should run scheduler/detokenizer subprocesses"
    code = server.stop()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"subprocesses left running: {alive}"
    assert code in (0, -15), server.log()[-2000:]
