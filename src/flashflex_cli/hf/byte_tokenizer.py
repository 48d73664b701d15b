"""A Hugging Face tokenizer for flashflex's byte-level token files (`flashflex data prepare` without
--tokenizer): token id = the UTF-8 byte's value, 0-255, no special tokens. An exported model trained on such data
gets these files, so `AutoTokenizer.from_pretrained(folder)` encodes text into the ids it was trained on and
decodes generated ids back into text.

The tokenizer is a BPE model without merges over the 256 byte symbols of the byte-level pre-tokenizer (which
spells every byte as one printable character, GPT-2's byte-to-character table) with the regex split off, so each
byte is one token whose id is the byte itself.
"""

from __future__ import annotations

import json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_VOCAB = 256


def byte_symbols() -> list[str]:
    """The printable character the byte-level pre-tokenizer spells each byte 0-255 with: printable Latin-1 bytes
    as themselves, the others as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(BYTE_VOCAB):
        if b not in symbols:
            symbols[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    return [symbols[b] for b in range(BYTE_VOCAB)]


def byte_tokenizer_json() -> str:
    """tokenizer.json text of the byte-level tokenizer (built with the `tokenizers` library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def byte_tokenizer_config(max_length: int) -> str:
    """tokenizer_config.json text: transformers' fast tokenizer class over tokenizer.json, `max_length` tokens."""
    return json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                       "clean_up_tokenization_spaces": False}, indent=2) + "\n"
