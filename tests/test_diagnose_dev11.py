"""Mechanisms found on the outsiders' batches 9 and 11 (dev since each was replaced as the blind set): library
messages the paste carries altered (retyped, cut, wrapped, or in an older release's numbered form), the GPU
architecture limit told in Chinese, and the c10d store's TCP failures told in words. Each paste is made up in the
shape of the library's message (its source is cited in causes.yaml), not taken from a thread.
"""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze


def _cats(log: str) -> list[str]:
    return [x.category for x in analyze(log).likely]


@pytest.mark.parametrize("log", [
    # torch <= 1.10's THC form names the runtime's code (209: cudaErrorNoKernelImageForDevice), text retyped
    "THCudaCheck FAIL file=/src/ops/roi_cuda.cu line=121 error=209 : no kernel image is available fro execution\n"
    "RuntimeError: cuda runtime error (209) : no kernel image is available fro execution on the device at "
    "/src/ops/roi_cuda.cu:121",
    # the message cut short by the paste
    "RuntimeError: CUDA error: no kernel image is available [...]",
])
def test_the_no_kernel_image_error_reads_when_retyped_cut_or_numbered(log: str) -> None:
    assert _cats(log)[0] == "gpu_arch_unsupported"


@pytest.mark.parametrize("log", [
    "RuntimeError: Function MmBackward0 returned an invalid gradient at index 1 - expected device\n"
    "    meta but got cuda:2",
    "RuntimeError: Function AddmmBackward0 returned an invalid gradient at index 0 - expected device meta but got "
    "cuda:0",
])
def test_autograds_meta_gradient_check_is_an_offloaded_weight(log: str) -> None:
    a = analyze(log)
    assert a.likely[0].category == "meta_device_offload"
    assert a.answer != "confident"  # the message alone does not show the device_map that offloaded it


@pytest.mark.parametrize("log", [
    "V100 不支持 bf16，只能用 fp16 训练吗",
    "flash-attn 2 不支持图灵架构，RTX 2080 Ti 上跑不起来",
    "bf16 在这张卡上不支持，换 T4 也一样",
])
def test_the_architecture_limit_in_chinese(log: str) -> None:
    assert _cats(log)[0] == "gpu_arch_unsupported"
    # the card and the format named without the refusal ("支持" = supports) are no such limit
    assert "gpu_arch_unsupported" not in _cats("A100 支持 bf16，训练正常，但是 loss 为 nan")


@pytest.mark.parametrize("log", [
    "When I relaunch torchrun after the first run ended, it says the tcp address is already taken.",
    "重新启动 torchrun 训练，提示地址已被占用",
])
def test_a_taken_address_in_words_is_the_port(log: str) -> None:
    a = analyze(log)
    assert a.likely[0].category == "dist_port_in_use"
    assert a.answer != "confident"


@pytest.mark.parametrize("log", [
    "A TCP connection problem on two of the hosts keeps distributed initialization from finishing.",
    "Distributed init fails: a socket error each time node 3 joins the rendezvous.",
])
def test_a_tcp_failure_at_distributed_set_up_is_an_unreachable_rendezvous(log: str) -> None:
    a = analyze(log)
    assert a.likely[0].category == "rendezvous_unreachable"
    assert a.answer != "confident"
    # a TCP failure elsewhere (a data server, a download) is not the store's
    assert "rendezvous_unreachable" not in _cats("The data server drops its TCP connection; the loader then fails.")
