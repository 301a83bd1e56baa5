"""Mechanisms found on the outsiders' batch 14 (dev data): version breaks read by the
message the library prints (TCPStore's libuv refusal on Windows' torch >= 2.4, torch 1.7's reducer assert under a
framework's own DDP wrapper), a launched script's exit status 2 read as argparse refusing the launcher's argument,
and users counting extra processes on the first GPU. Each paste is made up in the shape of the library's message (its
source is cited in causes.yaml), not taken from a thread.
"""

from __future__ import annotations

from tests.helpers import likely_categories as _cats

# torch/distributed/rendezvous.py asks TCPStore for libuv by default from torch 2.4 (USE_LIBUV defaults to "1");
# TCPStore.cpp's TORCH_CHECK refuses on a build without it (the Windows wheels)
LIBUV = (
    'Traceback (most recent call last):\n'
    '  File "C:\\proj\\train.py", line 88, in main\n'
    '    dist.init_process_group(backend="gloo", init_method="env://")\n'
    '  File "C:\\proj\\venv\\lib\\site-packages\\torch\\distributed\\rendezvous.py", line 190, in _create_c10d_store\n'
    '    return TCPStore(\n'
    'RuntimeError: use_libuv was requested but PyTorch was build without libuv support')


def test_tcpstores_libuv_refusal_is_a_version_break() -> None:
    assert _cats(LIBUV)[0] == "library_version_regression"
    # the bare line, as a title or a one-line paste
    assert _cats(LIBUV.splitlines()[-1])[0] == "library_version_regression"


# reducer.cpp's rebuild_buckets internal assert, as torch 1.7 prints it
REDUCER = (
    'RuntimeError: replicas_[0].size() == rebuilt_param_indices_.size() INTERNAL ASSERT FAILED at '
    '"/pytorch/torch/csrc/distributed/c10d/reducer.cpp":1326, please report a bug to PyTorch. rebuilt parameter '
    'indices size is not same as original model parameters size.Original model param size is: 212 versus rebuilt '
    'params size of: 84800')


def test_the_reducers_rebuild_assert_is_a_version_break() -> None:
    assert _cats(REDUCER)[0] == "library_version_regression"


def _elastic(code: int) -> str:
    return (f"ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: {code}) local_rank: 0 (pid: 4242) "
            f"of binary: /usr/bin/python3")


def test_a_launched_script_exiting_2_reads_as_its_parser_refusing_the_launcher() -> None:
    assert _cats(_elastic(2))[0] == "library_version_regression"
    # another status, or an exception the paste states, is not argparse's exit
    assert "library_version_regression" not in _cats(_elastic(1))
    stated = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
              "23.69 GiB of which 1.10 GiB is free.\n" + _elastic(2))
    assert "library_version_regression" not in _cats(stated)


def test_extra_processes_counted_on_the_first_gpu_are_ranks_sharing_it() -> None:
    words = ("With torchrun --nproc_per_node 4 the memory is unbalanced: there are 3 additional processes on GPU 0, "
             "each holding about 600 MB.")
    assert _cats(words)[0] == "more_ranks_than_gpus"
    assert _cats("用 torchrun 启动 4 卡训练，4个进程都跑到第一张卡上了")[0] == "more_ranks_than_gpus"
    # processes spread one per card are not
    assert "more_ranks_than_gpus" not in _cats("nvidia-smi shows one process on each GPU and training is slow")


_ELASTIC = ("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 2) local_rank: 0 (pid: 4242) "
            "of binary: /usr/bin/python3")


def test_exit_2_for_another_stated_reason_or_launcher_is_no_version_break() -> None:
    """Exit status 2 reads as the launcher's argument only under the launchers that add it (torch.distributed.launch,
    DeepSpeed's; torch's elastic agent where the paste names neither torchrun nor accelerate) and
    where the script states no other refusal: argparse refusing another argument, Python not finding the script,
    Hydra's override error, or a Slurm step's exit code."""
    for log in ("/usr/bin/python3: can't open file '/w/train.py': [Errno 2] No such file or directory\n" + _ELASTIC,
                "usage: train.py [-h] --output_dir D\ntrain.py: error: the following arguments are required: "
                "--output_dir\n" + _ELASTIC,
                "Error executing job with overrides: []\nCould not override 'trainer.devices'.\n"
                "[ERROR] [launch.py:321:sigkill_handler] exits with return code = 2",
                "srun: error: gpu-node12: task 0: Exited with exit code 2",
                # torchrun and accelerate pass the rank in the environment, never as an argument
                "$ torchrun --nproc_per_node 2 train.py\n" + _ELASTIC,
                "accelerate launch train.py\n" + _ELASTIC):
        assert "library_version_regression" not in _cats(log), log
    # argparse refusing the launcher's own argument still is one
    refusal = "usage: train.py [-h]\ntrain.py: error: unrecognized arguments: --local-rank=0\n" + _ELASTIC
    assert _cats(refusal)[0] == "library_version_regression"
    # the legacy launcher, or its elastic agent alone, adds the argument
    for log in ("python -m torch.distributed.launch --nproc_per_node 2 train.py\n" + _ELASTIC, _ELASTIC):
        assert _cats(log)[0] == "library_version_regression", log


def test_workers_data_or_listed_gpus_on_gpu_0_are_not_ranks_sharing_it() -> None:
    """DataLoader workers on the first GPU, a list of GPUs that starts with 0, or data (not processes) on cuda:0 say
    nothing about ranks sharing a card."""
    for log in ("I set 8 workers on the first GPU for the dataloader and it is slow",
                "I launch with torchrun and see 4 processes on GPU 0,1,2,3 as expected but training hangs",
                "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
                "and cuda:1! 我的数据都在cuda:0上，模型在cuda:1"):
        assert "more_ranks_than_gpus" not in _cats(log), log
