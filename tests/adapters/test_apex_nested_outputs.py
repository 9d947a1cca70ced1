"""O2 casts model outputs back to float32 wherever they sit, Hugging Face ModelOutput too."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from adapters.apex import amp
from adapters.apex.amp._nested import cast_nested

F16, F32 = torch.float16, torch.float32


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def test_hf_model_output_is_float32_at_o2_and_trains():
    model = _tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a fixed scale: the first steps of a dynamic 2**16 overflow in fp16 and are skipped
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    assert model.classifier.weight.dtype == F16
    ids, labels = torch.randint(0, 50, (2, 5)), torch.tensor([0, 2])
    out = model(input_ids=ids, labels=labels)
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert out.loss.dtype == F32 and out.logits.dtype == F32
    assert out["logits"].dtype == F32 and out[0].dtype == F32 and list(out.keys()) == \
        ["loss", "logits"]
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and [t.dtype for t in tup] == [F32, F32]
    before = model.classifier.weight.detach().clone()
    with amp.scale_loss(out.loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, model.classifier.weight)


def test_nested_containers_keep_their_types():
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Out:
        x: torch.Tensor
        extra: list

    h = torch.ones(2, dtype=F16)
    ids = torch.arange(3)
    tree = {"p": Pair(h, [h, (h, "s")]), "o": Out(h, [h, 3]), "ids": ids,
            "od": collections.OrderedDict(z=h)}
    got = cast_nested(tree, lambda t: t.float() if t.is_floating_point() else t)
    assert isinstance(got["p"], Pair) and got["p"].a.dtype == F32
    assert got["p"].b[0].dtype == F32 and got["p"].b[1][0].dtype == F32
    assert got["p"].b[1][1] == "s"
    assert isinstance(got["o"], Out) and got["o"].x.dtype == F32 and got["o"].extra[1] == 3
    assert got["ids"] is ids
    assert isinstance(got["od"], collections.OrderedDict) and got["od"]["z"].dtype == F32
    assert tree["o"].x.dtype == F16  # the input is not changed


def test_o2_dict_output_of_plain_module():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            return {"y": y, "parts": [y, (y,)]}

    model = amp.initialize(Net(), opt_level="O2", verbosity=0)
    out = model(torch.ones(1, 2))
    assert out["y"].dtype == F32 and out["parts"][0].dtype == F32
    assert out["parts"][1][0].dtype == F32
