"""Put a trained draft head into a model folder, next to the unchanged backbone.

    python tools/train_tiny/ship_draft.py --run out/draft \
        --dest packages/deepinfer-model/src/deepinfer/model/embedded

Copies the run's `mtp.safetensors` and `log.json` (as `draft_training_log.json`) into `--dest` and
writes `model.safetensors.index.json`, the Hugging Face shard index that maps every backbone key to
`model.safetensors` and every `mtp.*` key to `mtp.safetensors`. DeepInfer's loader reads the index
and sets the `mtp.*` tensors aside as the draft weights; `model.safetensors` stays byte for byte
the backbone's (transformers loads it alone).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors import safe_open


def keys_of(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args()
    backbone, head = keys_of(args.dest / "model.safetensors"), keys_of(args.run / "mtp.safetensors")
    if any(key.startswith("mtp.") for key in backbone) or not all(key.startswith("mtp.") for key in head):
        raise ValueError("model.safetensors must hold the backbone only and mtp.safetensors the mtp.* keys only")
    shutil.copyfile(args.run / "mtp.safetensors", args.dest / "mtp.safetensors")
    shutil.copyfile(args.run / "log.json", args.dest / "draft_training_log.json")
    sizes = {name: (args.dest / name).stat().st_size for name in ("model.safetensors", "mtp.safetensors")}
    index = {"metadata": {"total_size": sum(sizes.values())},
             "weight_map": {**dict.fromkeys(backbone, "model.safetensors"), **dict.fromkeys(head, "mtp.safetensors")}}
    (args.dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    total = sum(p.stat().st_size for p in args.dest.iterdir() if p.is_file())
    print(f"{sizes['mtp.safetensors']} bytes of mtp.* tensors; the folder holds {total} bytes")


if __name__ == "__main__":
    main()
