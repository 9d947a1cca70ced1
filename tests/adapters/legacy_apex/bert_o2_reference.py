"""Apex O2 + FusedAdam(bias_correction=False) written out in plain torch: the peer for
bert_finetune.py --optimizer adam --opt-level O2, computed from Apex's documented behaviour.

O2 as Apex did it: the model in float16 (BERT has no BatchNorm to keep in float32), float32
master weights, the loss multiplied by a dynamic scale (2**16, halved on overflow, doubled
after 2000 clean steps), each micro-batch's float16 grads unscaled into float32 master grads
that accumulate, the whole update skipped when any was non-finite. FusedAdam in AdamW mode
without bias correction: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2,
p -= lr (m / (sqrt(v) + eps) + wd p). Same model (the script's make_model), data, groups and
schedule as the script.
"""

import argparse

import torch
from bert_finetune import make_model, synthetic, warmup_linear


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--learning_rate", type=float, default=5e-3)
    p.add_argument("--warmup_proportion", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="")
    args = p.parse_args()
    model = make_model(args.device)
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    named = list(model.named_parameters())
    decay = {n: 0.0 if any(nd in n for nd in no_decay) else 0.01 for n, _ in named}
    model.half()
    params = dict(model.named_parameters())
    masters = {n: params[n].detach().float().clone() for n in params}
    m = {n: torch.zeros_like(w) for n, w in masters.items()}
    v = {n: torch.zeros_like(w) for n, w in masters.items()}
    grads = dict.fromkeys(params)
    scale, clean, overflow = 2.0**16, 0, False
    k, bs = args.gradient_accumulation_steps, args.train_batch_size
    ids, labels = synthetic(bs * args.steps)
    ids, labels = ids.to(args.device), labels.to(args.device)
    updates, log = args.steps // k, []
    for step in range(args.steps):
        sl = slice(step * bs, (step + 1) * bs)
        loss = model(input_ids=ids[sl], labels=labels[sl]).loss.float() / k
        (loss * scale).backward()
        for n, w in params.items():
            g = w.grad.float() / scale
            overflow = overflow or not bool(torch.isfinite(g).all())
            grads[n] = g if grads[n] is None else grads[n] + g
            w.grad = None
        if (step + 1) % k:
            continue
        lr = args.learning_rate * warmup_linear(len(log) / updates, args.warmup_proportion)
        if overflow:
            scale, clean = scale / 2, 0
        else:
            with torch.no_grad():
                for n, w in params.items():
                    g = grads[n]
                    m[n].mul_(0.9).add_(g, alpha=0.1)
                    v[n].mul_(0.999).addcmul_(g, g, value=0.001)
                    masters[n].add_(m[n] / (v[n].sqrt() + 1e-8) + decay[n] * masters[n],
                                    alpha=-lr)
                    w.copy_(masters[n])
            clean += 1
            if clean == 2000:
                scale, clean = scale * 2, 0
        log.append({"loss": loss.item() * k, "skipped": overflow, "loss_scale": scale})
        overflow, grads = False, dict.fromkeys(params)
    model.eval()
    with torch.no_grad():
        acc = (model(input_ids=ids).logits.argmax(-1) == labels).float().mean().item()
    if args.out:
        torch.save({"log": log, "accuracy": acc}, args.out)


if __name__ == "__main__":
    main()
