"""A byte-level BPE tokenizer trained locally, so tiny checkpoints need no model hub.

Trained on a fixed, sorted slice of the Python standard library's sources: the same
machine image gives the same vocabulary every time, in about a second.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def training_files(count: int = 40) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))[:count]


def train_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Train, save to ``out_dir`` (with a ChatML chat template) and return the tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train(training_files(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token=SPECIAL_TOKENS[PAD_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def with_pair_template(directory: str | Path) -> None:
    """Re-save the tokenizer in ``directory`` to encode sentence pairs as a cross-encoder reads
    them: ``A <|im_end|> B`` with segment ids 0 for A and the separator, 1 for B."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    separator = SPECIAL_TOKENS[EOS_ID]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A:0", pair=f"$A:0 {separator}:0 $B:1", special_tokens=[(separator, EOS_ID)]
    )
    tokenizer.save_pretrained(str(directory))
    config_file = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    config_file.write_text(json.dumps(config, indent=1))
