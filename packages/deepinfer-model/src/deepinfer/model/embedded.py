"""The embedded default model: a tiny DeepSeek-V4 trained by the project (recipe: tools/train_tiny/)
and shipped inside this package, so every feature runs offline with no download."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_FOLDER = "embedded"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def embedded_model_dir() -> Path:
    """The shipped model folder (Hugging Face layout: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json, README.md model card), resolved through
    importlib.resources, so it is the installed package's copy, wheel or editable alike.

    Returns:
        An existing directory; pass it to `load_model`.
    Raises:
        FileNotFoundError: the package was installed without its data files (or from a zip archive,
            which safetensors cannot read in place); the message names the missing path.
    """
    folder = Path(str(files("deepinfer.model").joinpath(_FOLDER)))
    for name in _REQUIRED:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: deepinfer-model was installed without its "
                                    f"embedded model files")
    return folder
