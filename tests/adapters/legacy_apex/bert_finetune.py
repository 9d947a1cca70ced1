"""A BERT fine-tuning loop in the manner of NVIDIA's Apex BERT scripts (run_squad.py /
run_pretraining.py): FusedLAMB or FusedAdam(bias_correction=False) over decay/no-decay
groups, amp O1/O2 with a dynamic scale, gradient accumulation, a warm-up schedule and
the grad norm logged through ``multi_tensor_applier(amp_C.multi_tensor_l2norm, ...)``.

Written for Apex, with only its imports changed (``apex`` -> ``adapters.apex``; ``import
amp_C`` -> ``from adapters.apex import amp_C``). A tiny randomly initialised BERT from
Hugging Face transformers and a synthetic task stand in for the checkpoint and SQuAD.
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

from adapters.apex import amp, amp_C  # was: from apex import amp; import amp_C
from adapters.apex.multi_tensor_apply import multi_tensor_applier  # was: from apex.multi_...
from adapters.apex.optimizers import FusedAdam, FusedLAMB  # was: from apex.optimizers ...


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", choices=["lamb", "adam"], default="lamb")
    p.add_argument("--opt-level", default="O1")
    p.add_argument("--learning_rate", type=float, default=None)
    p.add_argument("--warmup_proportion", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="")
    return p.parse_args()


def synthetic(n, seq=12, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, seq), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids[labels == 1, torch.randint(1, seq, (1,), generator=g)] = 3  # the marker token
    ids[:, 0] = 2  # [CLS]
    return ids, labels


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x / warmup
    return max((x - 1.0) / (warmup - 1.0), 0.0)


def make_model(device):
    """The tiny randomly initialised BERT (seed 42) standing in for the checkpoint."""
    torch.manual_seed(42)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).to(device)


def main():
    args = parse()
    model = make_model(args.device)
    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0}]
    if args.optimizer == "lamb":
        optimizer = FusedLAMB(optimizer_grouped_parameters, lr=args.learning_rate or 5e-2)
    else:
        optimizer = FusedAdam(optimizer_grouped_parameters, lr=args.learning_rate or 5e-3,
                              bias_correction=False)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      loss_scale="dynamic", verbosity=0)
    overflow_buf = torch.zeros(1, dtype=torch.int, device=args.device)
    ids, labels = synthetic(args.train_batch_size * args.steps)
    ids, labels = ids.to(args.device), labels.to(args.device)
    model.train()
    log = []
    global_step = 0
    lr0 = optimizer.param_groups[0]["lr"]
    updates = args.steps // args.gradient_accumulation_steps
    for step in range(args.steps):
        sl = slice(step * args.train_batch_size, (step + 1) * args.train_batch_size)
        loss = model(input_ids=ids[sl], labels=labels[sl]).loss
        if args.gradient_accumulation_steps > 1:
            loss = loss / args.gradient_accumulation_steps
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if (step + 1) % args.gradient_accumulation_steps == 0:
            grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
            overflow_buf.zero_()
            grad_norm = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf,
                                             [grads], False)[0]
            lr_this_step = lr0 * warmup_linear(global_step / updates, args.warmup_proportion)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_this_step
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            log.append({"loss": loss.item() * args.gradient_accumulation_steps,
                        "grad_norm": grad_norm.item(), "overflow_buf": int(overflow_buf.item()),
                        "skipped": amp.last_step_skipped(), "loss_scale": amp.loss_scale()})
            print(f"step {global_step} loss {log[-1]['loss']:.4f} "
                  f"grad_norm {log[-1]['grad_norm']:.4f} scale {log[-1]['loss_scale']}")
    model.eval()
    with torch.no_grad():
        acc = (model(input_ids=ids).logits.argmax(-1) == labels).float().mean().item()
    if args.out:
        torch.save({"log": log, "accuracy": acc,
                    "optimizer": type(optimizer).__name__}, args.out)


if __name__ == "__main__":
    main()
