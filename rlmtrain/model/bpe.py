"""A small byte-level BPE tokenizer trained on a run's own text, saved as a Hugging Face folder.

Why: a model trained from scratch on a CPU learns per token, and with the byte tokenizer an RLM
turn is ~4x more tokens than with a BPE whose merges come from the papers, prompts and tool names
it will read and write. A 2k-word vocabulary trained on the run's corpus makes a turn's code a few
dozen tokens and costs a second to train.

The folder holds `tokenizer.json` (byte-level pre-tokenizer and decoder, so any text round-trips),
`tokenizer_config.json` (ChatML special tokens and chat template, the format `ByteTokenizer`
uses) and `generation_config.json`; `HFTokenizer.from_dir` loads it like any checkpoint's, and it
is copied next to every checkpoint the run saves so the weights never travel without their ids.
Training is deterministic for the same texts and vocabulary size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from rlmtrain.model.hf_tokenizer import HFTokenizer

__all__ = [
    "BPE_FILES",
    "CHATML_TEMPLATE",
    "tokenizer_files",
    "train_bpe",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

BPE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
"""What a tokenizer folder written here holds (and what `tokenizer_files` lists)."""


def train_bpe(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, *, split_digits: bool = False
) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` ids (special tokens included) on `texts`, write it
    to `out_dir` and return it loaded from there. `split_digits` makes every digit a piece of its
    own, never merged: a vocabulary trained on names like 'iris0' and 'cedar60' would otherwise
    hold each as one token, and a held-out 'delta72' would reach the model in a shape it never
    saw ('delta', '7', '2')."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"BPE vocabulary of {vocab_size} is smaller than the 256 bytes plus "
            f"{len(SPECIAL_TOKENS)} special tokens it must hold"
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    # Pieces are whitespace-delimited (a word keeps its leading space), not split again at
    # punctuation as GPT-2's regex does: code like `context[p]['abstract']]` then merges into a
    # few tokens, which halves a turn's code in tokens against the byte-level default.
    pieces = [pre_tokenizers.Split(Regex(r" ?[^\s]+|\s+"), behavior="isolated")]
    if split_digits:
        pieces.append(pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*pieces, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos_ids = [tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}) + "\n")
    return HFTokenizer.from_dir(out)


def tokenizer_files(src_dir: str | Path) -> list[Path]:
    """A tokenizer folder's files that a checkpoint carries (those present of `BPE_FILES` and a
    chat template), so the checkpoint loads with the ids it was trained on."""
    src = Path(src_dir)
    return [src / name for name in (*BPE_FILES, "chat_template.jinja") if (src / name).is_file()]
