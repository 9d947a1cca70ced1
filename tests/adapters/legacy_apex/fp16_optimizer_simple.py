"""An FP16_Optimizer loop in the manner of Apex's examples/FP16_Optimizer_simple
(minimal.py, save_load.py) and the word_language_model example (clip_master_grads).

Written for Apex, with only its import changed (``apex`` -> ``adapters.apex``). Runs on
CUDA when there is one, else on CPU.
"""

import argparse

import torch

from adapters.apex.fp16_utils import FP16_Optimizer  # was: from apex.fp16_utils import ...


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--init-scale", type=float, default=None)
    p.add_argument("--static-loss-scale", type=float, default=128.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--checkpoint", default="saved.pth")
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="")
    return p.parse_args()


def build(args):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 16).to(args.device).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    if args.dynamic:
        dynamic_loss_args = None if args.init_scale is None else {"init_scale": args.init_scale}
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True,
                                   dynamic_loss_args=dynamic_loss_args, verbose=False)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=args.static_loss_scale,
                                   verbose=False)
    return model, optimizer


def main():
    args = parse()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g).to(args.device).half()
    w_true = torch.randn(256, 16, generator=g) / 16
    y = (x.float().cpu() @ w_true).to(args.device).half()
    model, optimizer = build(args)
    loss_fn = torch.nn.MSELoss()
    log = []
    for t in range(args.steps):
        optimizer.zero_grad()
        y_pred = model(x)
        loss = loss_fn(y_pred.float(), y.float())
        optimizer.backward(loss)
        norm = optimizer.clip_master_grads(args.clip) if args.clip > 0 else None
        optimizer.step()
        log.append({"loss": loss.item(), "loss_scale": optimizer.loss_scale,
                    "overflow": optimizer.overflow,
                    "norm": None if norm is None else float(norm)})
        if t == args.save_at:
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(checkpoint, args.checkpoint)
            # a fresh model and optimizer, restored from the file (save_load.py)
            model, optimizer = build(args)
            checkpoint = torch.load(args.checkpoint)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
    if args.out:
        torch.save({"log": log, "weight": model.weight.detach().cpu(),
                    "bias": model.bias.detach().cpu()}, args.out)


if __name__ == "__main__":
    main()
