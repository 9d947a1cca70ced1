"""tests/test_cuda.py::test_cuda_compiled_step_matches_eager[torch.compile] step by step (CUDA).

    python3 benchmarks/compiled_step_trace.py [inductor|aot_eager|eager]

Prints, for each of the six steps, eager's and the compiled step's skip flag, loss scale
and loss, and the largest param difference: which of the test's asserts breaks, and where.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_cuda as T
import torch
from helpers import clone_tree

step, state, x, y = T._setup()
dev = x.device
one = torch.ones((), device=dev)
inf = torch.full((), float("inf"), device=dev)
backend = sys.argv[1] if len(sys.argv) > 1 else "inductor"
cstep = torch.compile(step, fullgraph=True, backend=backend)
s_e, s_c = clone_tree(state), clone_tree(state)
for i in range(6):
    f = inf if i == 3 else one
    s_e, m_e = step(s_e, x, y, f)
    s_c, m_c = cstep(s_c, x, y, f)
    d = max(float((s_c.params[k].float() - s_e.params[k].float()).abs().max()) for k in s_e.params)
    print(backend, i, "skipped", bool(m_e["skipped"]), bool(m_c["skipped"]), "scale",
          float(m_e["loss_scale"]), float(m_c["loss_scale"]), "loss", float(m_e["loss"]),
          float(m_c["loss"]), "maxdiff", d, flush=True)
