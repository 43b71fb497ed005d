#!/usr/bin/env python3
"""Train a small byte-level BPE tokenizer and write it as a Hugging Face tokenizer.json.

The file has the layout of Qwen3's tokenizer (NFC, Qwen's split regex, byte-level alphabet, BPE merges,
<|endoftext|> as a special token), so `hydrahead` and HF transformers read it the same way. Only the
standard library is used: training splits text with an ASCII approximation of Qwen's regex (which
needs Unicode classes), which only decides which merges are learnt; encoding always uses the regex in
the file.

    scripts/demo/train_tokenizer.py --vocab 1024 --out tokenizer.json datasets/haystack/essays/*.txt ...
"""
import argparse
import collections
import json
import re
import sys

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
ASCII_SPLIT = re.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|"
                         r"\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train(texts, vocab_size):
    byte_map = bytes_to_unicode()
    words = collections.Counter()
    for text in texts:
        for piece in ASCII_SPLIT.findall(text):
            words[tuple(byte_map[b] for b in piece.encode("utf-8"))] += 1
    vocab = {byte_map[b]: i for i, b in enumerate(sorted(byte_map))}   # ids 0..255 in byte order
    merges = []
    words = {w: c for w, c in words.items()}
    while len(vocab) < vocab_size:
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair itself so the result is deterministic.
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        merged = a + b
        merges.append(f"{a} {b}")
        vocab[merged] = len(vocab)
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return vocab, merges


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="UTF-8 text files to learn merges from")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size before the special tokens")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    texts = [open(f, encoding="utf-8").read() for f in a.files]
    vocab, merges = train(texts, a.vocab)
    eos = len(vocab)
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eos, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{a.out}: {len(vocab)} tokens ({len(merges)} merges) + <|endoftext|> = {eos}", file=sys.stderr)


if __name__ == "__main__":
    main()
