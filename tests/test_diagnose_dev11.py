"""Mechanisms found on the outsiders' batches 9 and 11 (dev since each was replaced as the blind set): library
messages the paste carries altered (retyped, cut, wrapped, or in an older release's numbered form), the GPU
architecture limit told in Chinese, and the c10d store's TCP failures told in words. Each paste is made up in the
shape of the library's message (its source is cited in causes.yaml), not taken from a thread.
"""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze
from tests.helpers import likely_categories as _cats


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


@pytest.mark.parametrize(("log", "wrong"), [
    # a configuration that turns both half precisions on, a card that has bf16, an NPU: not the architecture
    ("DeepSpeed 配置里 bf16 和 fp16 同时打开不支持", "gpu_arch_unsupported"),
    ("A100 上 bf16 不支持 吗, loss 变成 nan", "gpu_arch_unsupported"),
    ("npu 上 tf32 不支持", "gpu_arch_unsupported"),
    # an address taken with no distributed launch in sight is some other server's port
    ("vllm 推理，提示地址已被占用", "dist_port_in_use"),
    ("wandb sweep agent says the address is already used", "dist_port_in_use"),
    # a socket timeout in a collective after training ran is not the store's connect at set-up
    ("socket timeout in process group all_reduce at step 3000", "rendezvous_unreachable"),
])
def test_round_14s_words_stay_out_of_other_settings(log: str, wrong: str) -> None:
    assert wrong not in _cats(log)


def test_killing_a_hung_rank_on_p2p_channels_keeps_p2p_first() -> None:
    """Survivors print NCCL's remote-peer close when a hung rank is killed: on a consumer card whose channels run
    over P2P that is still the P2P hang's paste."""
    log = """h1:500:610 [1] NCCL INFO cudaDev 1 busId 3000 - Init START (RTX 4090)
h1:500:610 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/IPC
h1:500:611 [1] misc/socket.cc:538 NCCL WARN Net : Connection reset by peer
"""
    assert _cats(log)[0] == "nccl_p2p_hang"


def test_a_first_collective_that_moves_the_weights_is_no_confident_data_preparation() -> None:
    """A watchdog timeout at SeqNum 1 is data preparation's tell-tale when the collective is a barrier (one
    element); one of millions of elements is the model's weights broadcast (DDP's first parameter sync), after every
    rank passed data preparation: ranked, not asserted."""
    line = ("[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=1800000) ran "
            "for 1800047 milliseconds before timing out.")
    assert analyze(line).answer != "confident"
    barrier = line.replace("OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000", "OpType=ALLREDUCE, NumelIn=1, "
                           "NumelOut=1")
    assert analyze(barrier).likely[0].category == "nccl_timeout_preprocessing"
