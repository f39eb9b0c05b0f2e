#!/usr/bin/env python3
"""gpt2_to_tokenizer_json.py: converts OpenAI's GPT-2 encoder.json + vocab.bpe (in DIR)
into a Hugging Face tokenizer.json in DIR, the one tokenizer format mhar loads. The
layout matches what Hugging Face publishes for gpt2: ByteLevel pre-tokenizer with the
GPT-2 regex, BPE model, <|endoftext|> (50256) as the special token."""
import json
import os
import sys

directory = sys.argv[1]
with open(os.path.join(directory, "encoder.json"), encoding="utf-8") as f:
    vocab = json.load(f)
with open(os.path.join(directory, "vocab.bpe"), encoding="utf-8") as f:
    lines = f.read().split("\n")
# The first line is a "#version" comment; the last is empty.
merges = [line for line in lines[1:] if line]
byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
              "use_regex": True}
tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>",
                      "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": True, "special": True}],
    "normalizer": None,
    "pre_tokenizer": byte_level,
    "post_processor": byte_level,
    "decoder": byte_level,
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": "", "end_of_word_suffix": "",
              "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
              "merges": merges},
}
out = os.path.join(directory, "tokenizer.json")
with open(out + ".tmp", "w", encoding="utf-8") as f:
    json.dump(tokenizer, f, ensure_ascii=False)
os.replace(out + ".tmp", out)
print(f"gpt2_to_tokenizer_json: wrote {out} ({len(vocab)} tokens, {len(merges)} merges)")
