"""Tiny vision-language checkpoints with real processors, test images, and HF references.

Three families whose language models differ where it matters to us: LLaVA (CLIP tower, plain
1-D positions; also with a Mixtral language model), Qwen2-VL (M-RoPE positions computed from the image grid) and Gemma3 (an
image's tokens attend to each other both ways; one sliding and one full-attention layer).
Each checkpoint has the locally trained tokenizer with the family's image tokens added,
the family's real processor, and a chat template that renders OpenAI image parts as the
family's image placeholder, so the server's chat API can be checked as well.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, GenerationConfig

from sglang_hf_backend.testing.checkpoints import TINY_DECODER
from sglang_hf_backend.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID

_VISION_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
# SGLang's Qwen2-VL processing asks the image processor for these pixel bounds.
_QWEN2_VL_PIXELS = dict(
    min_pixels=3136, max_pixels=1003520, patch_size=14, merge_size=2, temporal_patch_size=2
)


def _chat_template(image_placeholder: str) -> str:
    """ChatML whose messages may be lists of text and image parts (OpenAI content)."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image_placeholder}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _llava(tokenizer_dir: Path, mixture_of_experts: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens={"image_token": "<image>"})
    if mixture_of_experts:
        text_config = transformers.MixtralConfig(
            **{**TINY_DECODER, "intermediate_size": 32, "vocab_size": len(tokenizer)}, num_local_experts=4
        )
    else:
        text_config = transformers.LlamaConfig(**{**TINY_DECODER, "vocab_size": len(tokenizer)})
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**_VISION_TOWER),
        text_config=text_config,
        image_token_index=tokenizer.image_token_id,
        vision_feature_select_strategy="default",
    )
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
    )
    return transformers.LlavaForConditionalGeneration(config), processor


def _qwen2_vl(tokenizer_dir: Path):
    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    ids = dict(zip(("vision_start", "vision_end", "image", "video"), tokenizer.convert_tokens_to_ids(tokens)))
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            **{**TINY_DECODER, "vocab_size": len(tokenizer)},
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )
    processor = transformers.Qwen2VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**_QWEN2_VL_PIXELS),
        video_processor=transformers.Qwen2VLVideoProcessor(**_QWEN2_VL_PIXELS),
        tokenizer=tokenizer,
    )
    return transformers.Qwen2VLForConditionalGeneration(config), processor


def _gemma3(tokenizer_dir: Path):
    tokens = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=tokens)
    config = transformers.Gemma3Config(
        # the last token sees the image only through the full-attention layer
        text_config=dict(
            **{**TINY_DECODER, "vocab_size": len(tokenizer)},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=_VISION_TOWER,
        mm_tokens_per_image=16,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    # initialised to zeros, which would give every image token the same embedding
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=16,
    )
    return model, processor


@dataclasses.dataclass(frozen=True)
class VisionLanguageModel:
    build: Callable[[Path], tuple]  # tokenizer dir -> (HF model, processor)
    image_placeholder: str  # what a prompt writes where an image goes


VISION_LANGUAGE_MODELS = {
    "llava": VisionLanguageModel(_llava, "<image>"),
    # a mixture-of-experts language model: SGLang resolves TransformersMultiModalMoEForCausalLM
    "llava-mixtral": VisionLanguageModel(
        lambda tokenizer: _llava(tokenizer, mixture_of_experts=True), "<image>"
    ),
    "qwen2_vl": VisionLanguageModel(_qwen2_vl, "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": VisionLanguageModel(_gemma3, "<start_of_image>"),
}


def build_vision_language_checkpoint(name: str, out_dir: Path, tokenizer_dir: Path) -> Path:
    family = VISION_LANGUAGE_MODELS[name]
    model, processor = family.build(Path(tokenizer_dir))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(out_dir)
    template = _chat_template(family.image_placeholder)
    processor.chat_template = template
    processor.tokenizer.chat_template = template
    processor.save_pretrained(out_dir)
    return out_dir


# -- images and prompts ------------------------------------------------------------
# width, height; "unseen" is only sent after the others, in place of another prompt's image
IMAGE_SIZES = {"wide": (112, 84), "square": (32, 32), "unseen": (64, 96)}


def write_test_images(directory: Path) -> dict[str, Path]:
    """Random-noise PNGs (fixed seed) of different shapes."""
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = {}
    for name, (width, height) in IMAGE_SIZES.items():
        paths[name] = Path(directory) / f"{name}.png"
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(paths[name])
    return paths


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    text: str  # with {image} where the image goes
    image: str | None  # a key of IMAGE_SIZES, or None for a text-only prompt

    def render(self, model: str) -> str:
        return self.text.format(image=VISION_LANGUAGE_MODELS[model].image_placeholder)


# two different images and a text-only prompt, batched together
IMAGE_PROMPTS = [
    ImagePrompt("{image}Describe def foo(x):", "wide"),
    ImagePrompt("{image}for i in range(10):", "square"),
    ImagePrompt("import os\nimport sys", None),
]


@lru_cache(maxsize=None)
def _hf_model(path: str):
    return transformers.AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_image_generate(path: Path, text: str, image: Path | None, new_tokens: int) -> list[int]:
    """New tokens from HF ``generate`` on ``text`` and ``image`` (greedy, fp32, eager)."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(path)
    inputs = processor(text=[text], images=[Image.open(image)] if image else None, return_tensors="pt")
    with torch.no_grad():
        out = _hf_model(str(path)).generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def hf_image_greedy(path: Path, model: str, images: dict[str, Path], new_tokens: int) -> list[list[int]]:
    """HF's answers to each of ``IMAGE_PROMPTS``, one at a time."""
    return [
        hf_image_generate(path, prompt.render(model), images.get(prompt.image), new_tokens)
        for prompt in IMAGE_PROMPTS
    ]


def tokens_before_image(path: Path, model: str, images: dict[str, Path], prompt: ImagePrompt) -> int:
    """Where the processor puts the first image token of ``prompt``: what two different images share."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(path)
    ids = processor(text=[prompt.render(model)], images=[Image.open(images[prompt.image])])["input_ids"][0]
    return list(ids).index(_hf_model(str(path)).config.image_token_id)


# -- our engine on the same prompts ---------------------------------------------------
@dataclasses.dataclass
class VisionCase:
    """What one engine produced for IMAGE_PROMPTS (the engine is shut down again)."""

    name: str
    path: Path
    reference: list[list[int]]  # HF generate
    batched: list[list[int]]
    one_at_a_time: list[list[int]]
    repeated: dict  # the first prompt sent again: output_ids and cached_tokens
    other_image: dict  # the first prompt's text with an image not sent before
    other_image_reference: list[int]
    tokens_before_image: int  # of the first prompt
    reports: list[dict]


_CASES: dict[tuple, VisionCase] = {}


def vision_case(checkpoint, images: dict[str, Path], name: str, **options) -> VisionCase:
    """IMAGE_PROMPTS through our engine (batched, then one at a time, then the cache probes),
    next to HF's answers; kept for the session."""
    from sglang_hf_backend.testing.engines import GREEDY, NEW_TOKENS, running_engine

    key = (name, tuple(sorted({"tp_size": 1, **options}.items())))
    if key not in _CASES:
        path = checkpoint(name)
        texts = [prompt.render(name) for prompt in IMAGE_PROMPTS]
        pictures = [str(images[prompt.image]) if prompt.image else None for prompt in IMAGE_PROMPTS]
        with running_engine(path, impl="transformers", **options) as running:
            engine = running.engine

            def generate(text, image):
                out = engine.generate(prompt=text, image_data=image, sampling_params=GREEDY)
                return {"output_ids": out["output_ids"], "cached_tokens": out["meta_info"]["cached_tokens"]}

            batched = engine.generate(prompt=texts, image_data=pictures, sampling_params=GREEDY)
            one_at_a_time = [generate(text, image)["output_ids"] for text, image in zip(texts, pictures)]
            repeated = generate(texts[0], pictures[0])
            other_image = generate(texts[0], str(images["unseen"]))
            reports = running.load_reports()
        _CASES[key] = VisionCase(
            name=name,
            path=path,
            reference=hf_image_greedy(path, name, images, NEW_TOKENS),
            batched=[out["output_ids"] for out in batched],
            one_at_a_time=one_at_a_time,
            repeated=repeated,
            other_image=other_image,
            other_image_reference=hf_image_generate(path, texts[0], images["unseen"], NEW_TOKENS),
            tokens_before_image=tokens_before_image(path, name, images, IMAGE_PROMPTS[0]),
            reports=reports,
        )
    return _CASES[key]


def hf_image_last_token_embeddings(path: Path, model: str, images: dict[str, Path]) -> torch.Tensor:
    """The language model's last hidden state for each of ``IMAGE_PROMPTS``, normalised: what an
    embedding model without sentence-transformers files pools."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(path)
    rows = []
    with torch.no_grad():
        for prompt in IMAGE_PROMPTS:
            pictures = [Image.open(images[prompt.image])] if prompt.image else None
            inputs = processor(text=[prompt.render(model)], images=pictures, return_tensors="pt")
            rows.append(_hf_model(str(path)).model(**inputs).last_hidden_state[0, -1])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)
