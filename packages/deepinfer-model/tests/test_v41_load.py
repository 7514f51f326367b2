"""Loading DeepSeek-V4.1 folders: official names with FP8 / MXFP4 / FP8 Engram tables, transformers'
names, the Engram vocabulary from tokenizer.json, DSpark stages kept aside."""

from __future__ import annotations

import re

import pytest
import torch
from v41_checkpoint import folder_model, official_tensors, tokenizer, transformers_tensors, write_folder
from v41_helpers import run_chunks

from deepinfer.model import DeepseekV41ForCausalLM, WeightError, load_model
from deepinfer.model.engram_vocab import token_map_of

TOKENS = [5, 9, 3, 40, 41, 7, 7, 12, 60, 61, 62, 3, 4, 90, 15, 16, 17, 9, 5, 3, 22]


def test_compressed_vocabulary_by_hand() -> None:
    m = token_map_of(tokenizer(), 100).tolist()
    ids = {w: i for i, w in enumerate(["<s>", "</s>", "<pad>", "Hello", "hello", "HELLO", "café", "cafe", "Café",
                                        " ", "\t", "the", "The", " the", "ﬁ", "fi"])}
    assert m[ids["Hello"]] == m[ids["hello"]] == m[ids["HELLO"]]                 # lowercase
    assert m[ids["café"]] == m[ids["cafe"]] == m[ids["Café"]]                    # accents stripped
    assert m[ids["ﬁ"]] == m[ids["fi"]]                                           # NFKC
    assert m[ids[" "]] == m[ids["\t"]] != m[ids["<s>"]]                           # whitespace → one space, kept
    assert m[ids[" the"]] == m[ids["the"]] == m[ids["The"]]                       # stripped
    assert m[:3] == [0, 1, 2] and m[3] == 3 and m[96:] == [m[95]] * 4            # first-appearance order, padding
    assert max(m) + 1 == 96 - 2 - 2 - 1 - 1 - 2                                  # 12 of 96 ids merged


def test_official_fp8_mxfp4_folder_generates_the_same_logits(tmp_path) -> None:
    model, raw = folder_model()
    tensors = official_tensors(model, quantised=True)         # model now holds the dequantised values
    want = run_chunks(model, [TOKENS], [[len(TOKENS)]])[0]
    folder = write_folder(tmp_path / "official", model, raw, tensors, composite=True)
    loaded = load_model(folder)
    assert isinstance(loaded, DeepseekV41ForCausalLM) and loaded.cfg.quant.fp8_block == 32
    assert loaded.layers[1].engram.embed.weight.dtype == torch.float8_e4m3fn          # the table stays FP8
    assert set(loaded.draft_weights) == {"mtp.0.main_proj.weight"}
    torch.testing.assert_close(run_chunks(loaded, [TOKENS], [[7, 1, 13]])[0], want, atol=2e-4, rtol=0)
    host = load_model(folder, expert_dtype="fp4", engram_on_host=True)
    torch.testing.assert_close(run_chunks(host, [TOKENS], [[len(TOKENS)]])[0], want, atol=2e-4, rtol=0)


def test_transformers_names_folder(tmp_path) -> None:
    model, raw = folder_model(seed=3)
    want = run_chunks(model, [TOKENS], [[len(TOKENS)]])[0]
    folder = write_folder(tmp_path / "hf", model, raw, transformers_tensors(model), composite=False)
    torch.testing.assert_close(run_chunks(load_model(folder), [TOKENS], [[len(TOKENS)]])[0], want, atol=2e-4,
                               rtol=0)
    half = load_model(folder, dtype=torch.bfloat16)
    assert half.layers[0].attn_norm.weight.dtype == torch.bfloat16                     # bf16 norms
    assert half.layers[0].hc_attn_fn.dtype == half.layers[0].attn.attn_sink.dtype == torch.float32
    got = run_chunks(half, [TOKENS], [[len(TOKENS)]])[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.95


def test_missing_and_misshaped_weights_are_named(tmp_path) -> None:
    model, raw = folder_model()
    tensors = official_tensors(model, quantised=False)
    del tensors["layers.7.attn.indexer.wk.weight"]
    with pytest.raises(WeightError, match="missing weight 'layers.7.attn.indexer.wk.weight'"):
        load_model(write_folder(tmp_path / "a", model, raw, tensors, composite=False))
    tensors = official_tensors(model, quantised=True)
    tensors["layers.1.engram.embed.scale"] = tensors["layers.1.engram.embed.scale"][:, :0]
    with pytest.raises(WeightError, match="layers.1.engram.embed.scale.*scale shape"):
        load_model(write_folder(tmp_path / "b", model, raw, tensors, composite=True))


def test_engram_needs_the_tokenizer(tmp_path) -> None:
    model, raw = folder_model()
    folder = write_folder(tmp_path / "c", model, raw, official_tensors(model, quantised=False), composite=False)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(Exception, match="tokenizer.json does not exist"):
        load_model(folder)


def test_dummy_v41_model_runs(tmp_path) -> None:
    model, raw = folder_model()
    folder = write_folder(tmp_path / "d", model, raw, {}, composite=False)
    dummy = load_model(folder, load_format="dummy", seed=1)
    logits = run_chunks(dummy, [TOKENS], [[len(TOKENS)]])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_partial_utf8_tokens_key_by_their_vocabulary_string() -> None:
    """Byte-level tokens that decode to U+FFFD (half of a UTF-8 character) keep distinct ids, keyed by
    their raw vocabulary string; whole characters normalise ("é" → "e")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"e": 0, "Ã": 1, "©": 2, "Ã©": 3, "Ã¨": 4, "¨": 5}        # Ã© = "é", Ã¨ = "è" in byte-level form
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©"), ("Ã", "¨")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert "\ufffd" in tok.decode([1]) and tok.decode([3]) == "é"
    assert token_map_of(tok, 6).tolist() == [0, 1, 2, 0, 0, 3]


def _as_save_pretrained_tables(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' `save_pretrained` spelling of the Engram tables: at model level, each with a float32
    `weight_scale_inv` (all ones beside a float table; the e8m0 scales as float32 beside an FP8 one)."""
    out = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.engram\.embed\.(weight|scale)", key)
        if m is None:
            out[key] = t
            continue
        stem = f"model.engram_tables.{m.group(1)}"
        if m.group(2) == "scale":
            out[f"{stem}.weight_scale_inv"] = t.float()
        else:
            out[f"{stem}.weight"] = t
            if t.dtype != torch.float8_e4m3fn:
                out[f"{stem}.weight_scale_inv"] = torch.ones(t.shape[0], t.shape[1] // 32)
    return out


def _greedy(model: DeepseekV41ForCausalLM, num_tokens: int) -> list[int]:
    tokens = list(TOKENS[:9])
    for _ in range(num_tokens):
        tokens.append(int(run_chunks(model, [tokens], [[len(tokens)]])[0][-1].argmax()))
    return tokens[9:]


def test_save_pretrained_engram_tables_float(tmp_path) -> None:
    """`model.engram_tables.{layer}.weight` is the layer's table; a float table's `weight_scale_inv`
    is not read (transformers' model reads it only for FP8 rows), even when it is not all ones."""
    model, raw = folder_model(seed=5)
    plain = load_model(write_folder(tmp_path / "plain", model, raw, transformers_tensors(model), composite=False))
    tensors = _as_save_pretrained_tables(transformers_tensors(model))
    assert {"model.engram_tables.1.weight", "model.engram_tables.5.weight_scale_inv"} <= set(tensors)
    tensors["model.engram_tables.5.weight_scale_inv"] *= 4
    aliased = load_model(write_folder(tmp_path / "aliased", model, raw, tensors, composite=False))
    assert aliased.layers[1].engram.embed.weight.dtype == torch.float32
    assert torch.equal(run_chunks(aliased, [TOKENS], [[len(TOKENS)]])[0],
                       run_chunks(plain, [TOKENS], [[len(TOKENS)]])[0])
    assert _greedy(aliased, 4) == _greedy(plain, 4)
    tensors["model.engram_tables.1.weight_scale_inv"] = torch.ones(3, 1)
    with pytest.raises(WeightError, match=r"engram_tables\.1\.weight_scale_inv.*scale shape"):
        load_model(write_folder(tmp_path / "bad", model, raw, tensors, composite=False))


def test_save_pretrained_engram_tables_fp8(tmp_path) -> None:
    """An FP8 table under the alias keeps its rows FP8, its float32 `weight_scale_inv` becoming e8m0."""
    model, raw = folder_model(seed=6)
    official = official_tensors(model, quantised=True)
    plain = load_model(write_folder(tmp_path / "plain", model, raw, official, composite=True))
    tensors = _as_save_pretrained_tables(official)
    assert tensors["model.engram_tables.1.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.engram_tables.1.weight_scale_inv"].dtype == torch.float32
    aliased = load_model(write_folder(tmp_path / "aliased", model, raw, tensors, composite=True))
    for layer in (1, 5):
        for name in ("weight", "scale"):
            assert torch.equal(getattr(aliased.layers[layer].engram.embed, name).view(torch.uint8),
                               getattr(plain.layers[layer].engram.embed, name).view(torch.uint8))
    assert torch.equal(run_chunks(aliased, [TOKENS], [[len(TOKENS)]])[0],
                       run_chunks(plain, [TOKENS], [[len(TOKENS)]])[0])
    assert _greedy(aliased, 4) == _greedy(plain, 4)
    tensors["model.engram_tables.5.weight_scale_inv"][2, 0] = 3.0
    with pytest.raises(WeightError, match=r"engram_tables\.5\.weight_scale_inv.*not powers of two \(e\.g\. 3\.0\)"):
        load_model(write_folder(tmp_path / "bad", model, raw, tensors, composite=True))
