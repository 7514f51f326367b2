"""Train the tiny DeepSeek-V4 with transformers' DeepseekV4ForCausalLM and a plain PyTorch loop.

    python tools/train_tiny/train.py --data out/tiny --out OUTDIR [--budget-s 330] [--max-steps auto]

Reads `train.npy` / `valid.npy` / `heldout.npy` / `unigram.json` from --data; writes to --out:
`model.safetensors` (transformers names; matrices bf16, the float32-kept parameters float32),
`config.json`, `log.json` (losses, evaluations, the run's settings) and prints a summary.
The LR schedule (linear warm-up, cosine decay to 10 %) spans --max-steps; `auto` times the first
steps and picks the count that fits --budget-s. The wall-clock guard stops early in any case, and
the checkpoint kept is the one with the best `valid` loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from hooks import IndexerDistillation, RouterBalance, init_hash_table
from model_config import ARCH, CONTEXT_LEN, write_config
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

# Parameters transformers keeps in float32 (norms, mHC, sinks, compressor position bias, router bias).
FP32_MARKERS = ("norm", "_hc.", "hc_head", "sinks", "position_bias", "e_score_correction_bias")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("out/tiny"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-steps", default="auto", help="an int, or 'auto' (fit --budget-s and --max-epochs)")
    p.add_argument("--max-epochs", type=int, default=20, help="cap of the `auto` step count, in train-split passes")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock limit of the training loop")
    p.add_argument("--dense-frac", type=float, default=0.1, help="fraction of steps with a dense indexer")
    p.add_argument("--balance-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=0, help="0 = whole split; N = first N windows")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def windows(ids: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs/targets [len(starts), CONTEXT_LEN] int64 from a token stream."""
    rows = torch.stack([ids[s: s + CONTEXT_LEN + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def tiled_starts(num_tokens: int) -> torch.Tensor:
    """Non-overlapping windows covering the stream (every target token once, the tail dropped)."""
    return torch.arange(0, num_tokens - CONTEXT_LEN - 1 + 1, CONTEXT_LEN)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, device: str, batch: int = 32, autocast: bool = True) -> float:
    """Mean next-token NLL (nats) over the tiled windows of `ids`."""
    model.eval()
    total, count = 0.0, 0
    starts = tiled_starts(ids.numel())
    for i in range(0, len(starts), batch):
        x, y = windows(ids, starts[i: i + batch])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and device == "cuda"):
            logits = model(input_ids=x.to(device), use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def unigram_nll(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Add-one-smoothed train-split unigram NLL (nats) on the same targets as `evaluate`."""
    logp = np.log((counts + 1.0) / (counts.sum() + counts.size))
    starts = tiled_starts(ids.numel())
    targets = np.concatenate([ids[s + 1: s + CONTEXT_LEN + 1].numpy() for s in starts.tolist()])
    return float(-logp[targets.astype(np.int64)].mean())


def lr_at(step: int, max_steps: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, max_steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for name, p in model.named_parameters():
        mixing = "_hc." in name or "hc_head" in name          # mHC projections stay undecayed
        (decay if p.ndim >= 2 and not mixing else plain).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def pick_experts_implementation(model: torch.nn.Module, device: str) -> str:
    """transformers' fused `grouped_mm` experts if one forward+backward runs here, else `eager`."""
    x = torch.arange(2 * CONTEXT_LEN, device=device).view(2, -1) % ARCH["vocab_size"]
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x, use_cache=False).logits
        logits.float().square().mean().backward()
        with torch.no_grad():                     # the float32 evaluation path too
            model(input_ids=x, use_cache=False)
        choice = "grouped_mm"
    except (RuntimeError, NotImplementedError, ValueError) as error:
        print(f"grouped_mm experts failed ({str(error)[:200]}); using eager", flush=True)
        model.set_experts_implementation("eager")
        choice = "eager"
    model.zero_grad(set_to_none=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, experts={choice}", flush=True)
    return choice


def save(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> int:
    """Write model.safetensors + config.json; returns the safetensors size in bytes."""
    tensors = {}
    for name, t in state.items():
        keep = t.dtype != torch.float32 or any(m in name for m in FP32_MARKERS)
        tensors[name] = (t if keep else t.to(torch.bfloat16)).contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_config(out)
    return (out / "model.safetensors").stat().st_size


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    data = {split: torch.from_numpy(np.load(args.data / f"{split}.npy").astype(np.int32))
            for split in ("train", "valid", "heldout")}
    if args.eval_windows:                 # smoke runs: evaluate on a prefix of each split only
        for split in ("valid", "heldout"):
            data[split] = data[split][: args.eval_windows * CONTEXT_LEN + 1]
    counts = np.asarray(json.loads((args.data / "unigram.json").read_text()), dtype=np.float64)
    device = args.device
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**ARCH)).to(device).train()
    init_hash_table(model, args.seed + 1)
    experts = pick_experts_implementation(model, device)
    distill = IndexerDistillation(model, top_k=ARCH["index_topk"])
    balance = RouterBalance(model, args.balance_rate)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                  eps=1e-8, fused=device == "cuda")
    num_params = sum(p.numel() for p in model.parameters())
    sampler = torch.Generator().manual_seed(args.seed + 2)
    high = data["train"].numel() - CONTEXT_LEN - 1
    max_steps = None if args.max_steps == "auto" else int(args.max_steps)
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "num_params": num_params,
                 "torch": torch.__version__, "transformers": transformers.__version__, "experts": experts,
                 "python": sys.version.split()[0], "train": [], "eval": [],
                 "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    best = (float("inf"), -1, None)
    t0 = time.perf_counter()
    step, t_first = 0, 0.0
    while max_steps is None or step < max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            print(f"wall-clock budget reached at step {step}", flush=True)
            break
        if step == 10:
            t_first = elapsed                     # steps 10..40 time the loop, past CUDA warm-up
        if max_steps is None and step == 40:
            per_step = (elapsed - t_first) / 30.0
            epoch_steps = data["train"].numel() // (args.batch * CONTEXT_LEN)
            max_steps = min(int(40 + (args.budget_s - elapsed) / per_step * 0.92), args.max_epochs * epoch_steps)
            log["ms_per_step"] = round(per_step * 1e3, 2)
            print(f"auto: {per_step * 1e3:.1f} ms/step -> max_steps={max_steps}", flush=True)
        planned = max_steps or 10 ** 9
        distill.dense = step < int(args.dense_frac * planned) if max_steps else True
        lr = lr_at(step, planned, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = windows(data["train"], torch.randint(0, high, (args.batch,), generator=sampler))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x.to(device), use_cache=False).logits
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
        kl = distill.loss()
        optimizer.zero_grad(set_to_none=True)
        (lm_loss + kl).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        load_ratio = balance.update()
        step += 1
        if step % 25 == 0 or step == 1:
            if not math.isfinite(lm_loss.item()):
                print(f"non-finite loss at step {step}: stopping, keeping the best checkpoint", flush=True)
                break
            row = {"step": step, "time_s": round(time.perf_counter() - t0, 1), "lr": lr, "loss": lm_loss.item(),
                   "indexer_kl": kl.item(), "grad_norm": grad_norm.item(), "dense": distill.dense,
                   "max_load_ratio": round(max(load_ratio), 3)}
            log["train"].append(row)
            if step % 100 == 0 or step == 1:
                print(json.dumps(row), flush=True)
        if step % args.eval_every == 0 or step == max_steps:
            valid = evaluate(model, data["valid"], device)
            log["eval"].append({"step": step, "valid_loss": valid, "dense": distill.dense})
            print(f"step {step} valid {valid:.4f}", flush=True)
            if valid < best[0] and not distill.dense:
                best = (valid, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    train_s = time.perf_counter() - t0
    if not log["eval"] or log["eval"][-1]["step"] != step:
        valid = evaluate(model, data["valid"], device)
        log["eval"].append({"step": step, "valid_loss": valid, "dense": distill.dense})
        if valid < best[0] and not distill.dense:
            best = (valid, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    if best[2] is None:                       # no sparse-phase evaluation happened: keep the last state
        best = (float("nan"), step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    size = save(model, best[2], args.out)
    torch.backends.cuda.matmul.allow_tf32 = False
    shipped = DeepseekV4ForCausalLM(DeepseekV4Config(**ARCH)).to(device)   # the stored (bf16-rounded) weights
    shipped.set_experts_implementation(experts)
    shipped.load_state_dict({k: v.float() if v.is_floating_point() else v
                             for k, v in load_file(str(args.out / "model.safetensors")).items()}, strict=True)
    heldout = evaluate(shipped, data["heldout"], device, autocast=False)
    log["result"] = {"steps": step, "max_steps": max_steps, "train_s": round(train_s, 1), "best_step": best[1],
                     "best_valid_loss": best[0], "heldout_loss_fp32": heldout,
                     "heldout_unigram_loss": unigram_nll(counts, data["heldout"]),
                     "heldout_tokens": int(tiled_starts(data["heldout"].numel()).numel() * CONTEXT_LEN),
                     "tokens_seen": step * args.batch * CONTEXT_LEN, "safetensors_bytes": size,
                     "num_params": num_params,
                     "peak_gpu_mib": torch.cuda.max_memory_allocated() >> 20 if device == "cuda" else 0}
    (args.out / "log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(log["result"], indent=1), flush=True)


if __name__ == "__main__":
    main()
