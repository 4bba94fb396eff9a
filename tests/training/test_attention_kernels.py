"""On a GPU, training tries flash and memory-efficient attention before cuDNN's (whose per-shape graphs cost host
time at every new batch length); the user's switched-off kernels stay off; torch's settings come back afterwards.
torch keeps these as process-wide flags, so they can be checked without a GPU."""

import torch
from torch.nn.attention import SDPBackend

from surefit.training.precision import attention_kernels, device_settings

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def _order() -> list[int]:
    return list(torch._C._get_sdp_priority_order())


def _enabled() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled()


def test_training_on_a_gpu_prefers_flash_then_efficient_over_cudnn_and_restores_torchs_order():
    before, enabled = _order(), _enabled()
    with device_settings(CUDA):
        order = _order()
        assert order[:4] == [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION),
                             int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.MATH)]
        assert _enabled() == enabled
    assert _order() == before and _enabled() == enabled


def test_kernels_the_user_switched_off_stay_off_and_a_cpu_run_changes_nothing():
    before = _order()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with attention_kernels(CUDA):
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert _order()[0] == int(SDPBackend.EFFICIENT_ATTENTION)
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    with attention_kernels(torch.device("cpu")):
        assert _order() == before
    with attention_kernels(CUDA, order=None):  # torch's own order, when asked for
        assert _order() == before
