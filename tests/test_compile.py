"""torch.compile(fullgraph=True) of the whole train step equals eager, skips included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ScaleGrad, assert_trees_bit_equal, blobs, clone_tree, mlp

import fmp

pytestmark = pytest.mark.slow


def _run(backend):
    x, y = blobs(32)
    net = mlp(seed=1)
    apply_fn, params, _ = fmp.functional(net)

    def loss_fn(p, a, b, f):
        return F.cross_entropy(ScaleGrad.apply(apply_fn(p, a), f).float(), b)

    opt = fmp.optim.adamw(1e-2)
    step = fmp.train_step(loss_fn, opt, "fp16-mixed")
    state = fmp.TrainState.create(clone_tree(params), opt,
                                  fmp.DynamicLossScale.create(initial=2.0**10, period=2,
                                                              min_scale=0.25))
    cstep = fmp.compile(step, backend=backend)
    s_e, s_c = clone_tree(state), clone_tree(state)
    for i in range(6):
        f = torch.tensor(float("inf") if i in (2, 3) else 1.0)
        before = clone_tree(s_c)
        s_e, m_e = step(s_e, x, y, f)
        s_c, m_c = cstep(s_c, x, y, f)
        assert bool(m_c["skipped"]) == bool(m_e["skipped"]) == (i in (2, 3))
        assert float(m_c["loss_scale"]) == float(m_e["loss_scale"])
        assert s_c.loss_scale.min_scale == 0.25
        if i in (2, 3):
            assert_trees_bit_equal(s_c.params, before.params)
            assert_trees_bit_equal(s_c.opt_state, before.opt_state)
        for k in s_e.params:
            torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-4, atol=1e-5)


def test_compiled_step_matches_eager_aot_eager():
    _run("aot_eager")


def test_compiled_step_matches_eager_inductor():
    _run("inductor")


def test_workarounds_only_on_old_torch(monkeypatch):
    import fmp._compile as fc

    monkeypatch.setattr(fc, "_torch_version", lambda: (2, 11))
    assert fmp.inductor_workarounds() == {"loop_ordering_after_fusion": False}
    monkeypatch.setattr(fc, "_torch_version", lambda: (2, 13))
    assert fmp.inductor_workarounds() == {}
