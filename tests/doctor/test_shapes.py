"""The seed's `mat1 and mat2 shapes cannot be multiplied`, explained: input, layer, expectation, likely cause."""

import pytest
import torch
from torch import nn

from surefit.doctor.shapes import diagnose, trace


class Seed(nn.Module):
    def __init__(self, vocab: int = 271):
        super().__init__()
        self.projection = nn.Linear(vocab, 256)
        self.encoder = nn.GRU(256, 32, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, inputs_embeds, labels=None):
        out, _ = self.encoder(self.projection(inputs_embeds))
        return self.head(out.mean(1))


def _run(x):
    model = Seed()
    batch = {"inputs_embeds": x, "labels": torch.zeros(x.shape[0], dtype=torch.long)}
    return trace(model, batch, lambda: model(**batch)), batch


@pytest.mark.parametrize("x,cause", [
    (torch.randn(2, 20, 4000), "wrong feature (vocabulary) size: 'inputs_embeds' has 4000 features per position but "
                               "the layer was built for 271; if the data is right, build the model with --model_args "
                               "'{\"vocab\": 4000}'"),
    (torch.randn(2, 5420), "flattening: 5420 = 20 x 271, so [B, 5420] looks like [B, 20, 271] flattened"),
    (torch.randn(2, 271, 20), "transposed axes: 271 is dimension 1 of [2, 271, 20]; the features must be last"),
    (torch.randint(0, 2, (2, 20, 271)), "integer features (int64) reach a floating-point layer"),
])
def test_mismatch_names_input_layer_expectation_and_cause(x, cause):
    tr, batch = _run(x)
    message = diagnose(tr, batch, {"vocab": 271})
    assert message is not None
    assert "shape mismatch at layer 'projection' (nn.Linear(271 -> 256)): 'inputs_embeds' arrives as" in message
    assert "expects a last dimension of 271" in message
    assert f"likely cause: {cause}" in message


def test_healthy_model_reports_first_consumer_and_agreement():
    tr, batch = _run(torch.randn(2, 20, 271))
    assert diagnose(tr, batch) is None
    use = tr.uses["inputs_embeds"]
    assert (use.module, use.layer, use.shape, use.agrees) == ("projection", "nn.Linear(271 -> 256)", (2, 20, 271), True)
    assert "labels" not in tr.uses  # passed but never consumed by a layer
