"""The Engram compressed vocabulary, derived from a model folder's tokenizer.json (spec §2.9.6 step 1).

Every token id is decoded alone (the raw tokenizer, special tokens kept) and normalised: NFKC, NFD,
accents stripped, lowercased, runs of spaces / tabs / newlines made one space, stripped — except
that a token that is exactly one space stays one space. Tokens whose normalised text is equal share a
compressed id (an empty normalisation keys by the decoded text); a token whose decoding holds U+FFFD
(a partial UTF-8 byte) keys by its vocabulary string. Ids are given in order of first appearance,
scanning token ids upwards. The `tokenizers` library is needed only for models with Engram layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .config_checks import ConfigError

_LONE_SPACE = "\ue000"     # a private-use character: keeps a one-space token from being stripped away


def _normaliser():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(), normalizers.Replace(_LONE_SPACE, " "),
    ])


def compressed_token_map(model_dir: str | Path, vocab_size: int) -> Tensor:
    """[vocab_size] int64 compressed id of every token id of `<model_dir>/tokenizer.json`. Ids past the
    tokenizer's size (vocab_size may be larger) share the last token's id: a fresh id would change the
    compressed vocabulary's size, and such ids never come out of the tokenizer.

    Raises:
        ConfigError: no tokenizer.json, the `tokenizers` library is missing, or the tokenizer holds more
            ids than `vocab_size`.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: a DeepSeek-V4.1 model with Engram layers hashes its tokens "
                          "through the tokenizer's compressed vocabulary")
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ConfigError("Engram layers need the `tokenizers` library: pip install tokenizers") from err
    tokenizer = Tokenizer.from_file(str(path))
    return token_map_of(tokenizer, vocab_size, str(path))


def token_map_of(tokenizer, vocab_size: int, where: str = "the tokenizer") -> Tensor:
    """`compressed_token_map` of a loaded `tokenizers.Tokenizer`."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ConfigError(f"{where} has {size} token ids, more than vocab_size={vocab_size}")
    normalise = _normaliser().normalize_str
    ids: dict[str, int] = {}
    out = []
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalise(text) or text
        out.append(ids.setdefault(key, len(ids)))
    out.extend([out[-1] if out else 0] * (vocab_size - size))
    return torch.tensor(out, dtype=torch.int64)
