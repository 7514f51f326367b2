"""Train the byte-level BPE tokenizer on the train split and encode both splits to token ids.

    python tools/train_tiny/tokenizer.py --out out/tiny

reads `out/tiny/manifest.json` (from corpus.py) and writes `tokenizer.json`, `train.npy`,
`valid.npy` and `heldout.npy` (uint16 token ids: each file is `<|bos|>` + its tokens + `<|eos|>`, files in manifest
order) and `unigram.json` (train-split token counts, for the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from corpus import SPLITS, documents
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
# Ids 0..7 are special: bos/eos as the config says, pad, the DSpark noise token, four reserved.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|noise|>",
                  "<|reserved_4|>", "<|reserved_5|>", "<|reserved_6|>", "<|reserved_7|>"]
BOS_ID, EOS_ID, PAD_ID, NOISE_ID = 0, 1, 2, 3


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-split, no prefix space) with VOCAB_SIZE entries."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {i}")
    return tokenizer


def encode_split(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """[num_tokens] uint16: `<|bos|> doc <|eos|>` per file, concatenated."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/tiny"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    manifest = args.out / "manifest.json"
    texts = {split: documents(manifest, split) for split in SPLITS}
    tokenizer = train_tokenizer(texts["train"])
    tokenizer.save(str(args.out / "tokenizer.json"))
    summary = {}
    for split in SPLITS:
        ids = encode_split(tokenizer, texts[split])
        np.save(args.out / f"{split}.npy", ids)
        summary[split] = {"tokens": int(ids.size), "bytes_per_token": round(sum(len(t.encode()) for t in texts[split])
                                                                             / ids.size, 3)}
        if split == "train":
            counts = np.bincount(ids, minlength=VOCAB_SIZE)
            (args.out / "unigram.json").write_text(json.dumps(counts.tolist()), encoding="utf-8")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
