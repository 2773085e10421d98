"""``launch_server --impl transformers`` on a vision-language model (Qwen2-VL, M-RoPE).

A chat completion with a base64 image (OpenAI's ``image_url`` data URI) answers what HF
``generate`` answers for the chat-templated prompt and that image, and what ``/generate``
answers for the same prompt with the image given by path (``Engine.generate``'s
``image_data``). A corrupt image, a video and an audio clip each get a 4xx with a message,
and the server keeps serving.
"""

from __future__ import annotations

import base64

import pytest
import requests
from transformers import AutoProcessor

from sglang_hf_backend.testing.engines import NEW_TOKENS, ours_server
from sglang_hf_backend.testing.vision_language import hf_image_generate

MODEL = "qwen2_vl"
QUESTION = "What is in this picture?"
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"these bytes are no PNG").decode()
# name -> (content part, what the error message must say)
BAD_PARTS = {
    "corrupt image": ({"type": "image_url", "image_url": {"url": NOT_AN_IMAGE}}, "image"),
    "video": ({"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}, "carries video"),
    "audio": ({"type": "audio_url", "audio_url": {"url": "file:///clip.wav"}}, "carries audio"),
}


def data_uri(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def chat(server, parts: list[dict]) -> requests.Response:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def image_question(path) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": data_uri(path)}}, {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    running = ours_server(checkpoint(MODEL), tmp_path_factory.mktemp("server") / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def templated_prompt(checkpoint) -> str:
    """The chat template's rendering of the question with its image placeholder."""
    processor = AutoProcessor.from_pretrained(checkpoint(MODEL))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_chat_with_a_base64_image_answers_like_hf_and_generate(
    server, checkpoint, test_images, templated_prompt
):
    path = checkpoint(MODEL)
    reply = chat(server, image_question(test_images["wide"]))
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]["message"]["content"]

    reference_ids = hf_image_generate(path, templated_prompt, test_images["wide"], NEW_TOKENS)
    tokenizer = AutoProcessor.from_pretrained(path).tokenizer
    assert answer == tokenizer.decode(reference_ids, skip_special_tokens=True)

    by_path = requests.post(
        f"{server.url}/generate",
        json={
            "text": templated_prompt,
            "image_data": str(test_images["wide"]),
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
        },
        timeout=120,
    )
    assert by_path.status_code == 200, by_path.text
    assert by_path.json()["output_ids"] == reference_ids


@pytest.mark.parametrize("bad", list(BAD_PARTS))
def test_bad_media_gets_a_4xx_and_the_server_keeps_serving(server, test_images, bad):
    part, topic = BAD_PARTS[bad]
    reply = chat(server, [part, {"type": "text", "text": QUESTION}])
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)
    print(f"{bad}: {reply.status_code} {reply.text}")
    assert topic in reply.text.lower(), reply.text
    assert chat(server, image_question(test_images["square"])).status_code == 200
    assert server.process.poll() is None
