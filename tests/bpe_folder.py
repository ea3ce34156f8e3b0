"""An HF tokenizer folder for tests: byte-level BPE trained in memory with the ``tokenizers`` library, a
tokenizer_config.json with a chat template and the Qwen special tokens (used by the tokenizer and the
special-token tests)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_bpe_folder(folder: Path, words: list[str], template: str, *, vocab_size: int, seed: int = 0,
                     added_tokens: tuple[str, ...] = (), generation_config: bool = False) -> Path:
    """Train on 300 random 30-word lines of ``words``; ``added_tokens`` are added as non-special tokens;
    ``generation_config`` also writes a generation_config.json whose eos ids are <|im_end|> and <|endoftext|>."""
    rng = random.Random(seed)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(rng.choice(words) for _ in range(30)) for _ in range(300)], trainer=trainer)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>", "chat_template": template}))
    if generation_config:
        (folder / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}))
    return folder
