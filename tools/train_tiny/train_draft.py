"""Train the embedded model's DSpark draft head (`mtp.*`) by self-distillation, on CPU.

    python tools/train_tiny/train_draft.py --model packages/deepinfer-model/src/deepinfer/model/embedded \
        --data out/tiny --out out/draft

The target stays frozen (its embedding and LM head are shared with the head, never updated). Each
step samples `--seqs-per-step` sequences of `draft_data.pt` (draft_data.py) and `--anchors-per-seq`
anchor positions in each; the head drafts [anchor, noise × (k − 1)] with `draft_forward` (DeepInfer's
own draft modules) and learns the target's next k greedy tokens: cross-entropy per block position,
weighted `--decay`^j (a later draft only counts when the earlier ones were accepted), plus
`--confidence-weight` × binary cross-entropy of the confidence head on whether each draft equals
the target's token. AdamW (β 0.9 / 0.95, `--weight-decay` on matrices except mHC), linear warm-up
then cosine to zero, gradient clip 1.0. The Markov walk is teacher-forced with the target's tokens, which are the
drafts it sees whenever the drafts before were accepted.

Initialisation: each stage starts as a copy of the target's last layer (attention, MoE, mHC sites,
norms; the router bias keeps the target's balance), the last stage's `hc_head` and `norm` as the
target's; the context projection and the Markov embedding normal(0, 0.02), the Markov projection
and the confidence projection zero (no correction until it helps).

The last `--val-seqs` sequences are held out: every `--eval-every` steps the script reports the
mean accepted length (1 + the accepted prefix of the k greedy drafts) over every anchor in their
continuations, and keeps the best head. Writes `mtp.safetensors` (matrices bf16; norms, mHC and
the confidence projection float32, as the backbone stores them) and `log.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from draft_forward import context_keys, draft_forward
from safetensors.torch import save_file
from torch import Tensor

from deepinfer.model import DSparkDraft, load_model


def warm_start(draft: DSparkDraft, seed: int) -> None:
    """The initialisation described in the module docstring."""
    target = draft.target
    draft.init_weights(seed, std=0.02)
    source = dict(target.layers[-1].named_parameters())
    with torch.no_grad():
        for stage in draft.mtp:
            for name, p in stage.named_parameters():
                if name.split(".")[0] in ("attn", "ffn", "attn_norm", "ffn_norm") or name.startswith("hc_"):
                    if name in source and source[name].shape == p.shape:
                        p.copy_(source[name])
        last = draft.mtp[-1]
        for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            getattr(last, name).copy_(getattr(target, name))
        last.norm.weight.copy_(target.norm.weight)
        last.markov_head.projection.weight.zero_()
        last.confidence_head.proj.weight.zero_()


def block_targets(data: dict[str, Tensor], seq_index: Tensor, anchor_positions: Tensor,
                  k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(anchor ids [A], target tokens [A, k], Markov inputs [A, k]) of anchors in `data`'s sequences."""
    offsets = torch.arange(k)
    labels = data["greedy_ids"][seq_index[:, None], anchor_positions[:, None] + offsets]
    anchor_ids = data["token_ids"][seq_index, anchor_positions]
    return anchor_ids, labels, torch.cat((anchor_ids[:, None], labels[:, :-1]), dim=1)


def accepted_lengths(logits: Tensor, labels: Tensor) -> Tensor:
    """[A] tokens per verify step with these drafts: the target's token + the accepted prefix."""
    match = (logits.argmax(-1) == labels).long()
    return 1 + match.cumprod(dim=1).sum(dim=1)


def run_block(draft: DSparkDraft, data: dict[str, Tensor], seqs: Tensor, anchor_seq: Tensor,
              anchor_positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, confidence logits and target tokens of anchors in `seqs` (`anchor_seq` indexes `seqs`)."""
    keys = context_keys(draft, data["features"][seqs])
    anchor_ids, labels, prev_ids = block_targets(data, seqs[anchor_seq], anchor_positions, draft.block_size)
    out = draft_forward(draft, keys, anchor_seq, anchor_positions, anchor_ids, prev_ids)
    return out.logits, out.confidence_logits, labels


@torch.no_grad()
def evaluate(draft: DSparkDraft, data: dict[str, Tensor], seqs: Tensor) -> float:
    """Mean accepted length over every anchor in the continuations of `seqs`."""
    k, start, total, count = draft.block_size, int(data["prompt_len"]), 0.0, 0
    for s in seqs.tolist():
        positions = torch.arange(start, int(data["seq_lens"][s]) - k + 1)
        logits, _, labels = run_block(draft, data, torch.tensor([s]), torch.zeros_like(positions), positions)
        total += accepted_lengths(logits, labels).sum().item()
        count += positions.numel()
    return total / count


def sample_anchors(data: dict[str, Tensor], seqs: Tensor, per_seq: int, k: int,
                   gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """`per_seq` uniform anchor positions in [1, seq_len − k] of each sequence: (row in seqs, position)."""
    highs = data["seq_lens"][seqs] - k
    positions = 1 + (torch.rand(len(seqs), per_seq, generator=gen) * highs[:, None]).long()
    return torch.arange(len(seqs)).repeat_interleave(per_seq), positions.flatten()


def export(draft: DSparkDraft) -> dict[str, Tensor]:
    """The head's `mtp.*` tensors as shipped: matrices bf16, the rest float32."""
    out = {}
    for name, value in draft.state_dict().items():
        fp32 = value.dim() < 2 or ".hc_" in name or "hc_head" in name or "confidence_head" in name
        out[name] = value.detach().to(torch.float32 if fp32 else torch.bfloat16).contiguous()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("out/tiny"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seqs-per-step", type=int, default=16)
    parser.add_argument("--anchors-per-seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--decay", type=float, default=0.8)
    parser.add_argument("--confidence-weight", type=float, default=0.1)
    parser.add_argument("--val-seqs", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    target = load_model(args.model, dtype=torch.float32, device="cpu").requires_grad_(False)
    data = torch.load(args.data / "draft_data.pt")
    num_seqs = data["token_ids"].shape[0]
    train_seqs, val_seqs = torch.arange(num_seqs - args.val_seqs), torch.arange(num_seqs - args.val_seqs, num_seqs)
    draft = DSparkDraft(target, args.num_stages)
    warm_start(draft, args.seed)
    k = draft.block_size
    weights = torch.tensor([args.decay**j for j in range(k)])
    weights = weights / weights.sum()
    evaluate(draft, data, val_seqs[:1])       # settles the shared experts' stacked weights before the optimiser
    named = [(name, p) for name, p in draft.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    decayed = [p for name, p in named if p.dim() >= 2 and "hc_" not in name]
    groups = [{"params": decayed, "weight_decay": args.weight_decay},
              {"params": [p for _, p in named if all(p is not q for q in decayed)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    args.out.mkdir(parents=True, exist_ok=True)
    log: dict = {"args": {k_: str(v) for k_, v in vars(args).items()}, "train": [], "val": []}
    best, begin, recent = -1.0, time.perf_counter(), []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            score = evaluate(draft, data, val_seqs)
            log["val"].append({"step": step, "mean_accepted_length": score, "s": time.perf_counter() - begin})
            print(f"step {step}: val mean accepted length {score:.3f} ({time.perf_counter() - begin:.0f} s)",
                  flush=True)
            if score > best:
                best = score
                save_file(export(draft), str(args.out / "mtp.safetensors"))
            if step == args.steps:
                break
        seqs = train_seqs[torch.randperm(len(train_seqs), generator=gen)[:args.seqs_per_step]]
        anchor_seq, positions = sample_anchors(data, seqs, args.anchors_per_seq, k, gen)
        logits, confidence, labels = run_block(draft, data, seqs, anchor_seq, positions)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        match = (logits.argmax(-1) == labels).float()
        bce = F.binary_cross_entropy_with_logits(confidence, match, reduction="none")
        loss = (ce * weights).sum(1).mean() + args.confidence_weight * (bce * weights).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        recent.append((loss.item(), accepted_lengths(logits, labels).float().mean().item()))
        if (step + 1) % 50 == 0:
            mean_loss, mean_len = (sum(v) / len(recent) for v in zip(*recent))
            log["train"].append({"step": step + 1, "loss": mean_loss, "mean_accepted_length": mean_len})
            print(f"step {step + 1}: loss {mean_loss:.3f} train accepted {mean_len:.3f} "
                  f"({(time.perf_counter() - begin) / (step + 1):.2f} s/step)", flush=True)
            recent = []
    log["best_val_mean_accepted_length"] = best
    log["train_s"] = time.perf_counter() - begin
    (args.out / "log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
