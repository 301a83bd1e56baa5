"""Round 20: the outsiders' batch 17 (dev data since its blind score was recorded) and three known defects.

The evaluator's one-line form now picks the line a user would copy as the error (never a cut mark, an image, a code
fence or a metric). Each paste below is made up in the shape of the library's message (its source is cited in
causes.yaml, facts.py or parse.py), not taken from a thread.
"""

from __future__ import annotations

from tests.diagnose_real.evaluate import shorten


def test_the_line_form_skips_cut_marks_images_and_fences() -> None:
    thread = ("Multi-GPU training runs out of memory on the second card.\n"
              "```\n[...]\n```\n![image](https://example.org/shot.png)\n")
    assert shorten(thread, "line") == "Multi-GPU training runs out of memory on the second card."


def test_the_line_form_takes_a_warning_quoted_in_prose_over_a_question() -> None:
    thread = ("I'm training with gradient checkpointing and a LoRA adapter.\n"
              "And I got this message, `UserWarning: None of the inputs have requires_grad=True. Gradients will be "
              "None`\nCould someone help with this?\n")
    assert "None of the inputs have requires_grad=True" in shorten(thread, "line")


def test_the_line_form_skips_a_metric_named_error() -> None:
    thread = ("I believe my system runs out of RAM and the OS kills the script.\n"
              "$ python run_nerf.py --config lego.txt\nMean Projection Error: 1.336129034424327\n"
              "near/far: 1.2 6.08\n")
    assert shorten(thread, "line").startswith("I believe my system runs out of RAM")
    # a CUDA runtime's own "error = 48" is no metric
    thc = ("THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCTensorMath.cu line=40 error=48 : no kernel image "
           "is available for execution on the device\n/torch/cuda/__init__.py:97: UserWarning:\n")
    assert shorten(thc, "line").startswith("THCudaCheck FAIL")


def test_the_line_form_prefers_the_error_to_the_launchers_report() -> None:
    log = ("loss is nan after 200 steps and the run stops\n"
           "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 77) of "
           "binary: /usr/bin/python\n")
    assert shorten(log, "line") == "loss is nan after 200 steps and the run stops"
    # a rank killed by a signal: the exit code is the news
    killed = log.replace("exitcode: 1", "exitcode: -9")
    assert "exitcode: -9" in shorten(killed, "line")
