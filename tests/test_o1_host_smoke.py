"""The O1 mode's host cost: benchmarks/o1_host.py runs, and casts-off regions skip the mode."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from adapters.apex import amp
from adapters.apex.amp import _o1_install
from adapters.apex.amp._o1_mode import O1Mode

ROOT = Path(__file__).resolve().parents[1]
F16, F32 = torch.float16, torch.float32


def _stack() -> list:
    c = torch._C
    out = [c._pop_torch_function_stack() for _ in range(c._len_torch_function_stack())][::-1]
    for m in out:
        c._push_on_torch_function_stack(m)
    return out


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_quick_benchmark_runs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    threads = torch.get_num_threads()
    try:
        import o1_host

        res = o1_host.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(ROOT / "benchmarks"))
    for name in ("gpt", "resnet"):
        assert res[name]["ratio_amp_over_apex"] > 0
        # forward casts only: optimizer.step and torch's zero_grad skip the mode (was > 300)
        assert 0 < res[name]["torch_function_calls_per_step"] < 120


def test_step_and_zero_grad_leave_the_mode_and_keep_their_results():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(net.state_dict())
    a = amp.Amp()
    net, opt = a.initialize(net, torch.optim.AdamW(net.parameters(), lr=0.1), opt_level="O1",
                            verbosity=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    mode = _o1_install.current()
    seen = []
    orig = O1Mode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return orig(self, func, types, args, kwargs)

    try:
        out = net(torch.randn(3, 4))
        assert out.dtype == F16
        with a.scale_loss(out.float().sum() * 1e-3, opt) as s:
            s.backward()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.clone()
        O1Mode.__torch_function__ = spy
        opt.step()
        opt.zero_grad()
        assert seen == [] and mode in _stack()
        O1Mode.__torch_function__ = orig
        assert torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype == F16  # casts on again
    finally:
        O1Mode.__torch_function__ = orig
        amp.deactivate()
    ref_opt.step()
    assert all(p.grad is None for p in net.parameters())
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_casts_off_takes_the_mode_off_and_back_in_place():
    other = Counting()
    x = torch.ones(2, 2)
    with other:
        m = _o1_install.install(O1Mode(F16, "cpu"))
        try:
            before = _stack()
            assert m in before
            with m.casts(False):
                assert m not in _stack() and torch.mm(x, x).dtype == F32
                with m.casts(True):  # back on inside: the mode is back on the stack
                    assert m in _stack() and torch.mm(x, x).dtype == F16
                assert m not in _stack()
            assert _stack() == before and torch.mm(x, x).dtype == F16
            n = other.n
            with m.casts(False):
                torch.mm(x, x)
            assert other.n == n + 1  # the other mode still sees every call
        finally:
            amp.deactivate()
    assert not any(isinstance(s, O1Mode) for s in _stack())


def test_uninstall_inside_casts_off_is_never_undone():
    m = _o1_install.install(O1Mode(F16, "cpu"))
    with m.casts(False):
        amp.deactivate()
    assert _o1_install.current() is None and m not in _stack()
    assert torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype == F32


def test_a_mode_entered_directly_comes_back_after_casts_off():
    m = O1Mode(torch.bfloat16, "cpu")
    x = torch.ones(2, 2)
    with m:
        with m.casts(False):
            assert torch.mm(x, x).dtype == F32
        assert torch.mm(x, x).dtype == torch.bfloat16
    assert m not in _stack()
