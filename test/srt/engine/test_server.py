"""``python -m sglang.launch_server --impl transformers`` over HTTP on 127.0.0.1.

The OpenAI-compatible endpoints (plain and streaming completions, chat completions) and
SGLang's ``/generate`` all answer, and their text equals an ``sgl.Engine`` serving the
same checkpoint with the same settings; SIGTERM then shuts the server and its children down.
"""

from __future__ import annotations

import json

import psutil
import pytest
import requests

from sglang_hf_backend.testing.engines import NEW_TOKENS, PROMPTS, ours_server, running_engine

MODEL = "llama"


@pytest.fixture(scope="module")
def engine_texts(checkpoint):
    with running_engine(checkpoint(MODEL), impl="transformers") as engine:
        outs = engine.engine.generate(PROMPTS, {"temperature": 0.0, "max_new_tokens": NEW_TOKENS})
        chat = engine.engine.generate(
            engine.engine.tokenizer_manager.tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
            ),
            {"temperature": 0.0, "max_new_tokens": NEW_TOKENS},
        )
    return [o["text"] for o in outs], chat["text"]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory, engine_texts):
    # engine_texts first: an Engine's shutdown ends every child of this process, a server too.
    srv = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


def test_log_names_our_class(server):
    assert "sglang_hf_backend: serving LlamaForCausalLM with TransformersForCausalLM" in server.log()


def test_completions_match_engine(server, engine_texts):
    texts, _ = engine_texts
    for prompt, expected in zip(PROMPTS, texts):
        body = {"model": "default", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        reply = requests.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == expected


def test_streaming_completion_matches_engine(server, engine_texts):
    texts, _ = engine_texts
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


def test_chat_completion_matches_engine(server, engine_texts):
    _, expected = engine_texts
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }
    reply = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == expected


def test_generate_matches_engine(server, engine_texts):
    texts, _ = engine_texts
    body = {"text": PROMPTS[2], "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}}
    reply = requests.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert reply["text"] == texts[2]


def test_sigterm_shuts_down_cleanly(checkpoint, tmp_path_factory):
    srv = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("server-stop") / "server.log")
    children = psutil.Process(srv.process.pid).children(recursive=True)
    assert children, "the server should run scheduler/detokenizer subprocesses"
    code = srv.stop()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"subprocesses left running: {alive}"
    assert code in (0, -15), srv.log()[-2000:]
