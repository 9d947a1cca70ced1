"""A donated step traced whole by a raw torch.compile cannot copy the module's tensors
first (host-side work): it refuses instead of writing into them silently."""

import pytest
import torch
import torch.nn.functional as F

import fmp


def _setup(donate):
    net = torch.nn.Linear(4, 2)
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, x, y):
        return F.mse_loss(apply_fn(p, x), y)

    step = fmp.train_step(loss_fn, fmp.optim.sgd(0.1), "fp32", donate=donate)
    state = fmp.TrainState.create(params, fmp.optim.sgd(0.1))
    return net, step, state, torch.ones(3, 4), torch.zeros(3, 2)


@pytest.mark.slow
def test_raw_torch_compile_of_a_donated_step_refuses_and_writes_nothing():
    torch._dynamo.reset()
    net, step, state, x, y = _setup(donate=True)
    before = net.weight.detach().clone()
    with pytest.raises(Exception, match=r"fmp\.compile\(step\)"):
        torch.compile(step, backend="eager", fullgraph=True)(state, x, y)
    assert torch.equal(net.weight, before)


@pytest.mark.slow
def test_fmp_compile_whole_graph_of_a_donated_step_leaves_the_module():
    torch._dynamo.reset()
    net, step, state, x, y = _setup(donate=True)
    before = net.weight.detach().clone()
    new, _ = fmp.compile(step, whole_graph=True, backend="eager")(state, x, y)
    assert torch.equal(net.weight, before)
    assert not torch.equal(new.params["weight"], before)
