"""An ImageNet-style training script in the manner of Apex's examples/imagenet/main_amp.py.

Written for Apex, with only its imports changed (``apex`` -> ``adapters.apex``; ``import
apex`` -> ``from adapters import apex``). A tiny ResNet-style model and a synthetic
dataset stand in for torchvision and ImageNet; on a machine without CUDA it runs on CPU
with the gloo backend. Launch: ``torchrun --nproc-per-node 2 imagenet_amp.py ...``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed

from adapters import apex  # was: import apex
from adapters.apex import amp, optimizers  # noqa: F401  (was: from apex import amp, optimizers)
from adapters.apex.fp16_utils import *  # noqa: F403  (was: from apex.fp16_utils import *)
from adapters.apex.multi_tensor_apply import multi_tensor_applier  # noqa: F401  (was: apex...)
from adapters.apex.parallel import DistributedDataParallel as DDP  # was: from apex.parallel ...


def parse():
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (tiny)")
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("-b", "--batch-size", default=16, type=int)
    parser.add_argument("--lr", "--learning-rate", default=0.4, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float)
    parser.add_argument("--print-freq", "-p", default=2, type=int)
    parser.add_argument("--resume", default="", type=str)
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar", type=str)
    parser.add_argument("--out", default="", type=str)
    parser.add_argument("--local_rank", default=0, type=int)
    parser.add_argument("--sync_bn", action="store_true")
    parser.add_argument("--opt-level", type=str, default="O1")
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    parser.add_argument("--samples", default=256, type=int)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def synthetic(n, classes=10, size=16):
    g = torch.Generator().manual_seed(1234)
    patterns = torch.randn(classes, 3, 1, 1, generator=g) * 1.5
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + torch.randn(n, 3, size, size, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class AverageMeter:
    def __init__(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


def adjust_learning_rate(optimizer, epoch, step, len_epoch):
    factor = 0.5 ** epoch
    lr = args.lr * factor
    if epoch < 1:  # warmup
        lr = lr * float(1 + step + epoch * len_epoch) / (1.0 * len_epoch)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def train(train_loader, model, criterion, optimizer, epoch, log):
    losses = AverageMeter()
    model.train()
    for i, (input, target) in enumerate(train_loader):
        input, target = input.to(args.device), target.to(args.device)
        adjust_learning_rate(optimizer, epoch, i, len(train_loader))
        output = model(input)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        reduced_loss = reduce_tensor(loss.data) if args.distributed else loss.data
        losses.update(to_python_float(reduced_loss), input.size(0))  # noqa: F405
        log.append({"epoch": epoch, "step": i, "loss": to_python_float(reduced_loss),  # noqa: F405
                    "skipped": amp.last_step_skipped(), "loss_scale": amp.loss_scale()})
        if i % args.print_freq == 0 and args.local_rank == 0:
            print(f"Epoch: [{epoch}][{i}/{len(train_loader)}] Loss {losses.val:.4f} "
                  f"({losses.avg:.4f})")


def validate(val_loader, model):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for input, target in val_loader:
            output = model(input.to(args.device))
            correct += (output.argmax(1) == target.to(args.device)).sum()
            total += target.numel()
    correct = torch.tensor([float(correct), float(total)])
    if args.distributed:
        dist.all_reduce(correct)
    return float(correct[0] / correct[1])


def main():
    global args
    args = parse()
    args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    args.local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.world_size = 1
    if args.distributed:
        if args.device == "cuda":
            torch.cuda.set_device(args.local_rank)
        dist.init_process_group(backend="nccl" if args.device == "cuda" else "gloo",
                                init_method="env://")
        args.world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    if args.sync_bn:
        print("using apex synced BN")
        model = apex.parallel.convert_syncbn_model(model)
    model = model.to(args.device)
    args.lr = args.lr * float(args.batch_size * args.world_size) / 256.0
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale, verbosity=0)
    if args.distributed:
        # delay_allreduce delays all communication to the end of the backward pass.
        model = DDP(model, delay_allreduce=True)
    criterion = nn.CrossEntropyLoss().to(args.device)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=args.device)
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
    train_dataset = synthetic(args.samples)
    val_dataset = synthetic(64)
    train_sampler = val_sampler = None
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset,
                                                                      shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               shuffle=(train_sampler is None),
                                               sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.batch_size,
                                             sampler=val_sampler)
    log = []
    prec1 = None
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, log)
        prec1 = validate(val_loader, model)
        if args.local_rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                       args.checkpoint)
    if args.out:
        net = model.module if args.distributed else model
        torch.save({"log": log, "prec1": prec1, "world_size": args.world_size,
                    "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
                    "bn_types": sorted({type(m).__name__ for m in net.modules()
                                        if isinstance(m, nn.modules.batchnorm._BatchNorm)}),
                    "ddp_type": type(model).__module__ + "." + type(model).__name__},
                   f"{args.out}.rank{args.local_rank}.pt")
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
