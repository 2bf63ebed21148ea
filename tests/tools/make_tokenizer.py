#!/usr/bin/env python3
"""Makes tests/data/tok_kjv/: a byte-level BPE tokenizer trained on the King James Bible, and
the golden ids the `tokenizers` package gives for a set of texts (tests/test_tokenizer.c checks
lowbit's tokenizer against them).

How it was made (tokenizers 0.23.3, Debian 12):
    apt-get install bible-kjv bible-kjv-text      # the text, and the program that unpacks it
    pip install --break-system-packages tokenizers
    python3 tests/tools/make_tokenizer.py         # writes tokenizer.json and golden.json

The corpus is `bible gen1:1-rev22:21` with COLUMNS=80 (the whole Bible, 4.3 MB, lines wrapped
at 80 columns). The tokenizer is Qwen2's layout: NFC, the Llama 3 / Qwen2 split regex
(Isolated), ByteLevel without its own regex or prefix space, a ByteLevel decoder, BPE with a
4096-token vocabulary (all 256 bytes first), three special tokens and one plain added token.
The golden file also defines variants (edits of tokenizer.json that the C test applies the same
way): GPT-2's layout (ByteLevel with use_regex and add_prefix_space, no normalizer,
ignore_merges, merges written "a b", an lstrip/rstrip special token).
"""
import copy
import json
import os
import subprocess
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "tok_kjv")
VOCAB = 4096
# Llama 3's pre-tokenizer regex (Qwen2's differs only in \p{N} instead of \p{N}{1,3}).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
         r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>"]

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  1 And the earth was without form, and void; and darkness was upon the face of\nthe deep.",
    "",
    " ",
    "a",
    "café naïve résumé Ångström façade",
    "cafe\u0301 decomposed e\u0301 and A\u030a",           # NFC composes these
    "你好，世界。日本語のテキストです。",
    "Привет, мир! Ελληνικά. مرحبا بالعالم. नमस्ते दुनिया",
    "emoji 👍🏽 🎉 family 👨‍👩‍👧 flag 🇫🇷 done",
    "a   b\t\tc\n\n\nd    e     \n   ",
    "   leading spaces and trailing   ",
    "\r\nwindows\r\nlines\r\n\r\n",
    "1234567 3.14159 2024-12-02 12345678901234567890 0x1F",
    "I'm sure you don't know, we'll see; they've gone. She'd say HE'S and I'LL, Y'ALL'D'VE",
    "!!!??? ... --- *** (parenthesis) [brackets] {braces} \"quotes\" 'single'",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|>",
    "text<|endoftext|><|endoftext|>more text",
    "<think>reasoning</think> answer",
    "a partial <|im_sta token and <|endoftext| too",
    "And God said, Let there be light: and there was light. 3 And God saw the light, that it "
    "was good: and God divided the light from the darkness.",
    "tab\tseparated\tvalues\t1\t2\t3",
    "mixed ÀÉÎÕÜ ñ ß ø æ œ ç and ¡¿ «guillemets» — dashes – …",
    "zero\u200bwidth and\u00a0nbsp and\u3000ideographic space",
    " " * 3000 + "x" + "ab" * 1500,                # long pieces: the merge order at length
    "lll zzz lllll",                               # equal ranks: the leftmost pair merges first
]

VARIANTS = {
    "main": {},
    "gpt2": {
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                          "use_regex": True},
        "model.ignore_merges": True,
        "merges_form": "string",
        "added_tokens_extra": [{"content": "[MASK]", "single_word": False, "lstrip": True,
                                "rstrip": True, "normalized": False, "special": True}],
    },
}
VARIANT_TEXTS = {"gpt2": TEXTS + ["fill the [MASK] here", "two  [MASK]  spaces[MASK]end",
                                  "[MASK]"]}


def apply_variant(doc, v):
    """The edits the C test makes too (tests/test_tokenizer.c: apply_variant)."""
    doc = copy.deepcopy(doc)
    for k, val in v.items():
        if k == "model.ignore_merges":
            doc["model"]["ignore_merges"] = val
        elif k == "merges_form":
            doc["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m
                                      for m in doc["model"]["merges"]]
        elif k == "added_tokens_extra":
            nid = 1 + max(max(doc["model"]["vocab"].values()),
                          max(a["id"] for a in doc["added_tokens"]))
            for a in val:
                doc["added_tokens"].append(dict(a, id=nid))
                nid += 1
        else:
            doc[k] = val
    return doc


def kjv_text():
    env = dict(os.environ, COLUMNS="80")
    return subprocess.run(["bible", "gen1:1-rev22:21"], check=True, capture_output=True,
                          env=env).stdout.decode("utf-8")


def train(text):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    # Special and added tokens after the vocabulary, as Llama 3 and Qwen2 have them.
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ADDED])
    return tok


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = train(kjv_text())
    doc = json.loads(tok.to_str())
    with open(os.path.join(OUT, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    cases = []
    for name, v in VARIANTS.items():
        t = Tokenizer.from_str(json.dumps(apply_variant(doc, v)))
        for text in VARIANT_TEXTS.get(name, TEXTS):
            ids = t.encode(text, add_special_tokens=False).ids
            cases.append({"variant": name, "text": text, "ids": ids,
                          "decoded": t.decode(ids, skip_special_tokens=False),
                          "decoded_skip": t.decode(ids, skip_special_tokens=True)})
    with open(os.path.join(OUT, "golden.json"), "w", encoding="utf-8") as f:
        # One case a line, so a diff of the goldens reads case by case.
        f.write('{"tokenizers_version": %s,\n"variants": %s,\n"cases": [\n' % (
            json.dumps(__import__("tokenizers").__version__), json.dumps(VARIANTS)))
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print(f"vocab {tok.get_vocab_size()}, {len(cases)} golden cases", file=sys.stderr)


if __name__ == "__main__":
    main()
