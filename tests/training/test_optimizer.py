"""The loop's AdamW: torch's fused kernel where it runs, the same update as the default implementation."""

import torch

from surefit.training.loop import make_adamw


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((64, 32), (32,), (5, 7))]


def test_fused_adamw_on_cpu_gives_the_default_implementations_update():
    fused_params, ref_params = _params(), _params()
    fused = make_adamw(fused_params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True and not ref.defaults["fused"]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(fused_params, ref_params, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        fused.step()
        ref.step()
    for a, b, start in zip(fused_params, ref_params, _params(), strict=True):
        assert (a - start).abs().max() > 1e-3  # the steps moved the weights
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    # its state is the plain AdamW state: a checkpoint loads into either
    assert fused.state_dict()["state"][0].keys() == ref.state_dict()["state"][0].keys()


def test_parameters_the_fused_kernel_cannot_take_get_the_default_implementation():
    with torch.device("meta"):
        meta = [torch.nn.Parameter(torch.empty(4, 4))]
    assert not make_adamw(meta, lr=1e-3, weight_decay=0.0).defaults["fused"]
    assert make_adamw(_params(), lr=1e-3, weight_decay=0.0).defaults["fused"] is True
