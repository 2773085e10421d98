"""``launch_server --impl transformers`` for an embedder, a classifier and a cross-encoder.

``/v1/embeddings`` answers in OpenAI's shape with the vectors ``Engine.encode`` gives;
``/v1/classify`` in SGLang's shape with labels from the config's ``id2label``; ``/v1/rerank``
scores (query, document) pairs, segment ids included, as HF does. Empty or wrongly typed
input gets a 4xx with a message, and the server keeps serving.
"""

from __future__ import annotations

import pytest
import requests
import torch

from sglang_hf_backend.testing.engines import PROMPTS, Server, encode_case, ours_server

BAD_INPUTS = {"empty list": [], "wrong type": 42, "list of numbers and text": [1, "a"]}


def start_server(path, tmp_path_factory, *extra: str) -> Server:
    return ours_server(path, tmp_path_factory.mktemp("server") / "server.log", *extra)


@pytest.fixture(scope="module")
def engine_outputs(checkpoint):
    """Engine outputs, taken before any server starts: an engine's shutdown ends every child process."""
    return {name: encode_case(checkpoint, name).outputs for name in ("bert-embedding", "qwen3-classifier")}


@pytest.fixture(scope="module")
def embedder(checkpoint, tmp_path_factory, engine_outputs):
    server = start_server(checkpoint("bert-embedding"), tmp_path_factory, "--is-embedding")
    yield server, engine_outputs["bert-embedding"]
    server.stop()


@pytest.fixture(scope="module")
def classifier(checkpoint, tmp_path_factory, engine_outputs):
    server = start_server(checkpoint("qwen3-classifier"), tmp_path_factory)
    yield server, engine_outputs["qwen3-classifier"]
    server.stop()


def test_embeddings_endpoint(embedder):
    server, expected = embedder
    reply = requests.post(
        f"{server.url}/v1/embeddings", json={"model": "default", "input": PROMPTS}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(PROMPTS)))
    assert all(d["object"] == "embedding" for d in body["data"])
    assert body["usage"]["prompt_tokens"] > 0
    vectors = torch.tensor([d["embedding"] for d in body["data"]])
    assert (vectors - expected).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def cross_encoder(checkpoint, tmp_path_factory, engine_outputs):
    server = start_server(checkpoint("bert-cross-encoder"), tmp_path_factory)
    yield server, checkpoint("bert-cross-encoder")
    server.stop()


def hf_pair_scores(path, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(**tokenizer(query, doc, return_tensors="pt")).logits.item() for doc in documents]


def test_rerank_scores_pairs_like_hf(cross_encoder):
    server, path = cross_encoder
    query, documents = PROMPTS[0], PROMPTS[1:]
    reply = requests.post(
        f"{server.url}/v1/rerank", json={"query": query, "documents": documents}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    scores = {item["index"]: item["score"] for item in reply.json()}
    expected = hf_pair_scores(path, query, documents)
    assert [scores[i] for i in range(len(documents))] == pytest.approx(expected, abs=1e-4)
    ranked = [item["index"] for item in reply.json()]
    assert ranked == sorted(range(len(documents)), key=lambda i: -expected[i])


def test_classify_endpoint(classifier):
    server, expected = classifier
    reply = requests.post(
        f"{server.url}/v1/classify", json={"model": "default", "input": PROMPTS}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    assert [d["label"] for d in data] == [labels[int(i)] for i in expected.argmax(dim=-1)]
    probs = torch.tensor([d["probs"] for d in data])
    assert (probs - expected.softmax(dim=-1)).abs().max() <= 1e-5


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
@pytest.mark.parametrize("endpoint", ["/v1/embeddings", "/v1/classify"])
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(embedder, classifier, endpoint, bad):
    server = embedder[0] if endpoint == "/v1/embeddings" else classifier[0]
    reply = requests.post(
        f"{server.url}{endpoint}", json={"model": "default", "input": BAD_INPUTS[bad]}, timeout=60
    )
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)
    assert reply.json().get("message") or reply.json().get("detail") or reply.json().get("error")
    ok = requests.post(f"{server.url}{endpoint}", json={"model": "default", "input": PROMPTS[0]}, timeout=60)
    assert ok.status_code == 200
    assert server.process.poll() is None
