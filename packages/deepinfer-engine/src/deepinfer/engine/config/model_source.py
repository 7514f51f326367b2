"""Where a model's files are: a folder, the embedded default, or a Hugging Face repo id already in
the local Hugging Face cache (never downloaded: DeepInfer reads the cache offline), and the dtype
its config.json asks for."""

from __future__ import annotations

import json
import re
from pathlib import Path

# "org/name": what the Hub accepts as a model repo id (letters, digits, '-', '_', '.'; no '..').
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


class ModelNotCached(ValueError):
    """`model` is neither a folder nor a repo id in the local Hugging Face cache."""


def resolve_model_source(model: str, *, revision: str | None = None) -> str:
    """`model` when it is a folder (or not shaped like a repo id: the engine reports the missing
    folder); else the local snapshot folder of the Hugging Face repo `model` ("org/name", at
    `revision`: a branch, tag or commit; None = main) found in huggingface_hub's cache (HF_HUB_CACHE /
    HF_HOME), without any network access.

    Raises:
        ModelNotCached: a repo id that is not in the cache (or huggingface_hub is missing).
    """
    if not _REPO_ID.fullmatch(model) or ".." in model or _is_dir(model):
        return model
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ModelNotCached(f"model={model!r} is not a folder, and resolving it as a Hugging Face repo id needs "
                             "huggingface_hub") from None
    try:
        return snapshot_download(model, revision=revision, local_files_only=True)
    except (OSError, ValueError):          # LocalEntryNotFoundError is an OSError
        at = "" if revision is None else f" at revision {revision!r}"
        fetch = f"hf download {model}" + ("" if revision is None else f" --revision {revision}")
        raise ModelNotCached(f"model={model!r} is not a folder, nor a Hugging Face repo in the local cache "
                             f"{constants.HF_HUB_CACHE!r}{at}; DeepInfer does not download: fetch it first "
                             f"(`{fetch}`) or pass a folder") from None


def _is_dir(model: str) -> bool:
    try:
        return Path(model).is_dir()
    except OSError:           # e.g. a name too long for the file system: the engine says so
        return False


def config_dtype(model_dir: str | Path) -> str | None:
    """config.json's `torch_dtype` (or `dtype`) as a name like "bfloat16"; None when absent or unreadable
    (the engine reports a bad config when it loads it)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    return value.removeprefix("torch.") if isinstance(value, str) else None
