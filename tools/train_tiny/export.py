"""Assemble the shipped model folder from a training run and the tokenizer.

    PYTHONPATH=/tmp/mpl python tools/train_tiny/export.py --run RUN_DIR --data out/tiny \
        --dest packages/deepinfer-model/src/deepinfer/model/embedded

RUN_DIR is train.py's --out (model.safetensors, config.json, log.json). Writes into --dest:
model.safetensors, config.json (checked equal to model_config.py's), tokenizer.json,
tokenizer_config.json, generation_config.json, training_log.json, loss.png (needs matplotlib, which
is not a project dependency: `pip install --target /tmp/mpl matplotlib`) and heldout_sample.txt
(the first SAMPLE_LINES lines of the held-out file SAMPLE_FILE: the tests' fixed held-out text).
The model card (README.md) is written by hand from evaluate.py's numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from model_config import CONTEXT_LEN, config_json
from tokenizer import SPECIAL_TOKENS

SAMPLE_FILE = "plistlib.py"
SAMPLE_LINES = 230


def heldout_sample(data: Path) -> str:
    """The fixed held-out text the tests score (checked to be in the held-out split)."""
    manifest = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
    entry = next(e for e in manifest["files"] if e["path"] == SAMPLE_FILE)
    if entry["split"] != "heldout":
        raise ValueError(f"{SAMPLE_FILE} is in split {entry['split']!r}, not 'heldout'")
    text = (Path(manifest["stdlib"]) / SAMPLE_FILE).read_text(encoding="utf-8")
    return "".join(text.splitlines(keepends=True)[:SAMPLE_LINES])


def plot_loss(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [row["step"] for row in log["train"]]
    ax.plot(steps, [row["loss"] for row in log["train"]], lw=1, label="train (one batch, every 25 steps)")
    ax.plot([e["step"] for e in log["eval"]], [e["valid_loss"] for e in log["eval"]], "o-", label="valid split")
    result = log["result"]
    ax.axhline(result["heldout_unigram_loss"], color="grey", ls="--", label="unigram baseline (held-out)")
    ax.plot([result["best_step"]], [result["heldout_loss_fp32"]], "r*", ms=10, label="held-out, shipped weights")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_ylim(0, 9)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("tiny DeepSeek-V4 on the Python 3.11 standard library")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("out/tiny"))
    parser.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args()
    if json.loads((args.run / "config.json").read_text()) != config_json():
        raise ValueError(f"{args.run / 'config.json'} differs from model_config.py")
    args.dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.run / "model.safetensors", args.dest / "model.safetensors")
    shutil.copyfile(args.run / "config.json", args.dest / "config.json")
    shutil.copyfile(args.data / "tokenizer.json", args.dest / "tokenizer.json")
    bos, eos, pad = SPECIAL_TOKENS[:3]
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                        "pad_token": pad, "additional_special_tokens": SPECIAL_TOKENS[3:],
                        "add_bos_token": False, "model_max_length": CONTEXT_LEN, "clean_up_tokenization_spaces": False}
    generation_config = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False,
                         "max_new_tokens": 128}
    for name, content in (("tokenizer_config.json", tokenizer_config), ("generation_config.json", generation_config)):
        (args.dest / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    log = json.loads((args.run / "log.json").read_text())
    (args.dest / "training_log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    (args.dest / "heldout_sample.txt").write_text(heldout_sample(args.data), encoding="utf-8")
    plot_loss(log, args.dest / "loss.png")
    for path in sorted(args.dest.iterdir()):
        print(f"{path.stat().st_size:>10}  {path.name}")


if __name__ == "__main__":
    main()
