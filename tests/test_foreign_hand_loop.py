"""A training script with its own loop (`loss.backward()`, `opt.step()`, no Trainer that trains) is planned as that
loop runs it (foreign/script_loop.py), not with the HF Trainer's defaults: the DataLoader's batch, the optimizer it
builds, its autocast or GradScaler, the checkpointing it calls and the wrapper that shares the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.convert import comments, to_config
from shardfit.foreign.read import JobOptions, read_job

HEAD = ("import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(\"Qwen/Qwen2.5-0.5B\", torch_dtype={dtype}).cuda()\n")
OPT = "opt = torch.optim.AdamW(model.parameters(), lr=1e-5)\n"
LOADER = "loader = torch.utils.data.DataLoader(ds, batch_size=4)\n"
LOOP = ("for batch in loader:\n"
        "    loss = model(**batch).loss\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n")


def _job(tmp_path: Path, body: str = OPT + LOADER + LOOP, dtype: str = "torch.bfloat16", launch: str = "python",
         **opts: object):
    (tmp_path / "train.py").write_text(HEAD.format(dtype=dtype) + body)
    (tmp_path / "run.sh").write_text(f"{launch} train.py\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0", **opts))


def test_the_example_is_read_as_its_loop_not_the_trainer(tmp_path: Path) -> None:
    """The brief's script: the loop is named with its lines, and no Trainer default is applied or said."""
    job = _job(tmp_path)
    notes = "\n".join(job.notes)
    assert "a hand-written training loop at train.py:6-10" in notes
    for trainer_default in ("per_device_train_batch_size not set", "num_train_epochs", "optim not set",
                            "the Trainer's default"):
        assert trainer_default not in notes, notes
    w = job.workload
    assert w.micro_batch == 4 and w.grad_accum == 1 and w.grad_ckpt == "none"
    assert "epochs" not in job.convert  # shardfit's own default, not the Trainer's 3
    assert job.words.say("micro_batch", "").startswith("DataLoader batch_size=1 with gradient accumulation")


def test_a_trainer_script_with_a_loop_of_its_own_is_still_the_trainers(tmp_path: Path) -> None:
    """A script whose Trainer's .train() runs is the Trainer's job even where another loop steps something; the
    hand loop's reading applies only without one."""
    body = (OPT + LOADER + LOOP + "from transformers import Trainer\n"
            "trainer = Trainer(model=model)\ntrainer.train()\n")
    assert any("the Trainer's default, 8" in n for n in _job(tmp_path, body).notes)
    assert any("hand-written" in n for n in _job(tmp_path).notes)


@pytest.mark.parametrize(("loader", "batch"), [
    ("loader = torch.utils.data.DataLoader(ds)\n", 1),  # torch's default
    ("loader = torch.utils.data.DataLoader(ds, 16, shuffle=True)\n", 16),
    ("BATCH = 6\nloader = torch.utils.data.DataLoader(ds, batch_size=BATCH)\n", 6),
])
def test_the_micro_batch_is_the_dataloaders(tmp_path: Path, loader: str, batch: int) -> None:
    job = _job(tmp_path, OPT + loader + LOOP.replace("in loader", "in enumerate(tqdm(loader))")
               .replace("for batch", "for i, batch"))
    assert job.workload.micro_batch == batch
    assert any(n.startswith(f"micro-batch {batch}: ") for n in job.notes), job.notes


def test_a_computed_batch_exits_2_naming_the_dataloader_unless_batch_is_given(tmp_path: Path) -> None:
    loader = "loader = torch.utils.data.DataLoader(ds, batch_size=args.bs)\n"
    with pytest.raises(UserError, match=r"train.py:5: the DataLoader at train.py:5 computes its batch .*--batch N"):
        _job(tmp_path, OPT + loader + LOOP)
    job = _job(tmp_path, OPT + loader + LOOP, batch=3)
    assert job.workload.micro_batch == 3 and any("micro-batch --batch 3" in n for n in job.notes)


def test_a_loop_over_no_dataloader_exits_2_naming_the_loop(tmp_path: Path) -> None:
    body = OPT + LOOP.replace("for batch in loader:", "for step in range(100):\n    batch = get_batch()")
    with pytest.raises(UserError, match=r"train.py:5: the loop at train.py:5-10 iterates no DataLoader"):
        _job(tmp_path, body)


@pytest.mark.parametrize(("kwargs", "fused", "said"), [
    ("", False, "torch's default foreach step"),
    (", fused=True", True, "fused=True: stepped in place"),
    (", foreach=False", True, "foreach=False: stepped one tensor at a time"),
])
def test_torch_adamw_by_its_kernel(tmp_path: Path, kwargs: str, fused: bool, said: str) -> None:
    """torch's AdamW on CUDA steps with foreach unless fused=True or foreach=False: the planner's multi-tensor
    copy only for the first (Workload.multi_tensor_step)."""
    job = _job(tmp_path, OPT.replace("lr=1e-5", f"lr=1e-5{kwargs}") + LOADER + LOOP)
    w = job.workload
    assert w.optimizer == "adamw" and w.fused_adamw is fused and w.multi_tensor_step is not fused
    assert any(n.startswith("optimizer: AdamW at train.py:4") and said in n for n in job.notes), job.notes


@pytest.mark.parametrize(("kwargs", "version", "loop"), [
    ("", "5.23.0", "foreach"), ("", "4.20.0", "for_loop"), (", fused=True", "4.20.0", "fused"),
    (", foreach=False", "5.23.0", "for_loop"),
])
def test_torch_adamw_steps_by_its_releases_loop(tmp_path: Path, kwargs: str, version: str, loop: str) -> None:
    """The launches of a hand loop's torch AdamW: its keywords' loop, else torch's default of the release the job's
    transformers came out with (one tensor at a time before torch 2.0), never the Trainer's default optim's."""
    body = OPT.replace("lr=1e-5", f"lr=1e-5{kwargs}") + LOADER + LOOP
    (tmp_path / "train.py").write_text(HEAD.format(dtype="torch.bfloat16") + body)
    (tmp_path / "run.sh").write_text("python train.py\n")
    w = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version)).workload
    assert w.optimizer_loop == loop


def test_bitsandbytes_8bit_adamw(tmp_path: Path) -> None:
    opt = "import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-5)\n"
    w = _job(tmp_path, opt + LOADER + LOOP.replace("4", "5")).workload
    assert w.optimizer == "adamw8bit" and w.bnb_optimizer


OVERRIDE = ("mng = bnb.optim.GlobalOptimManager.get_instance()\n"
            "mng.register_module_override(model.get_input_embeddings(), \"weight\", {\"optim_bits\": 32})\n")


@pytest.mark.parametrize("override", ["", OVERRIDE])
def test_a_loop_s_8bit_optimizer_keeps_the_embedding_in_8_bits_unless_it_registers_it(tmp_path: Path,
                                                                                       override: str) -> None:
    """bitsandbytes keeps 32-bit states for a parameter only where GlobalOptimManager was told so (optimizer.py
    `check_overrides`): the HF Trainer registers every nn.Embedding, a hand-written loop only where the script calls
    register_module_override (or override_config) itself; else the full fine-tune's embedding is stepped in 8 bits."""
    from shardfit.plan.optimizer_states import fp32_state_embedding

    opt = "import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-5)\n"
    w = _job(tmp_path, opt + override + LOADER + LOOP).workload
    assert w.method == "full" and w.optimizer == "adamw8bit"
    assert fp32_state_embedding(w) == bool(override)


@pytest.mark.parametrize("opt", ["torch.optim.NAdam(model.parameters(), lr=0.1)",
                                 "torch.optim.AdamW(model.parameters(), amsgrad=True)"])
def test_an_unmodelled_optimizer_exits_2_unless_optimizer_is_given(tmp_path: Path, opt: str) -> None:
    body = f"from transformers.optimization import Adafactor\nopt = {opt}\n" + LOADER + LOOP
    with pytest.raises(UserError, match=r"train.py:5: optim \w+.* is not modelled.*--optimizer NAME \(one of "
                                        r"adamw, adamw8bit, adafactor"):
        _job(tmp_path, body)
    job = _job(tmp_path, body, workload={"optimizer": "adamw"})
    assert job.workload.optimizer == "adamw" and any("--optimizer adamw in place of" in n for n in job.notes)


@pytest.mark.parametrize(("opt", "planned", "fused"), [
    ("torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)", "sgd_momentum", False),
    ("torch.optim.SGD(model.parameters(), lr=0.1)", "sgd", False),
    ("Adafactor(model.parameters())", "adafactor", False),
    ("Adafactor(model.parameters(), beta1=0.9)", "adafactor_beta1", False),
    ("torch.optim.Adafactor(model.parameters())", "adafactor_torch", False),
    ("torch.optim.Adagrad(model.parameters(), foreach=False)", "adagrad", True),
    ("torch.optim.RMSprop(model.parameters(), momentum=0.9)", "rmsprop_momentum", False),
    ("torch.optim.RMSprop(model.parameters(), centered=True, momentum=m)", "rmsprop_centered_momentum", False),
    ("bnb.optim.RMSprop32bit(model.parameters(), momentum=0.9)", "rmsprop", True),
    ("bnb.optim.Lion8bit(model.parameters())", "lion8bit", True),
    ("bnb.optim.AdEMAMix(model.parameters())", "ademamix", True)])
def test_the_loop_s_optimizer_is_planned_as_its_library_builds_it(tmp_path: Path, opt: str, planned: str,
                                                                  fused: bool) -> None:
    """torch.optim's classes, transformers' Adafactor (fp32 states; beta1: a first moment), bitsandbytes' (fp32
    32-bit states, stepped in place): each its own optimizer, no exit."""
    body = f"import bitsandbytes as bnb\nfrom transformers.optimization import Adafactor\nopt = {opt}\n"
    w = _job(tmp_path, body + LOADER + LOOP).workload
    assert (w.optimizer, w.bnb_optimizer, w.fused_adamw) == (planned, opt.startswith("bnb."), fused)


def test_an_optimizer_built_out_of_sight_exits_2(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"train.py:9: the optimizer .* cannot follow it; pass --optimizer"):
        _job(tmp_path, "opt = make_optimizer(model)\n" + LOADER + LOOP)


def test_precision_pure_16bit_without_autocast_and_amp_with_it(tmp_path: Path) -> None:
    """A bf16 load without autocast trains in bf16 with no fp32 masters; an fp32 load under bf16 autocast is AMP
    (fp32 weights and masters, bf16 compute)."""
    assert _job(tmp_path).workload.pure_16bit
    loop = LOOP.replace("    loss = model(**batch).loss\n", "    with torch.autocast(\"cuda\", dtype=torch.bfloat16):\n"
                        "        loss = model(**batch).loss\n")
    job = _job(tmp_path, OPT + LOADER + loop, dtype="torch.float32")
    assert job.workload.precision == "bf16" and not job.workload.pure_16bit
    assert any("precision: autocast at train.py:7: bf16" in n for n in job.notes), job.notes


def test_a_gradscaler_is_fp16_amp(tmp_path: Path) -> None:
    body = OPT + LOADER + "scaler = torch.cuda.amp.GradScaler()\n" + LOOP.replace(
        "    loss = model(**batch).loss\n", "    with torch.cuda.amp.autocast():\n        loss = model(**batch).loss\n"
    ).replace("loss.backward()", "scaler.scale(loss).backward()").replace("opt.step()", "scaler.step(opt)")
    job = _job(tmp_path, body, dtype="torch.float32")
    assert job.workload.precision == "fp16" and job.workload.optimizer == "adamw"
    # the same loop on an fp16 load: torch's GradScaler refuses fp16 gradients, named as the script's
    with pytest.raises(UserError, match=r"train.py:6: the script loads the model in fp16 .*Attempting to unscale"):
        _job(tmp_path, body, dtype="torch.float16")
    # fp16 autocast over an fp16 load without a scaler casts nothing: a pure fp16 run
    plain = body.replace("scaler.scale(loss).backward()", "loss.backward()").replace("scaler.step(opt)", "opt.step()")
    w = _job(tmp_path, plain.replace("scaler = torch.cuda.amp.GradScaler()\n", ""), dtype="torch.float16").workload
    assert w.precision == "fp16" and w.pure_16bit


def test_a_computed_autocast_dtype_exits_2(tmp_path: Path) -> None:
    loop = LOOP.replace("    loss = model(**batch).loss\n", "    with torch.autocast(\"cuda\", dtype=ptdtype):\n"
                        "        loss = model(**batch).loss\n")
    with pytest.raises(UserError, match=r"autocast at train.py:7 computes its dtype"):
        _job(tmp_path, OPT + LOADER + loop)


def test_torch_checkpointing_and_gradient_checkpointing_enable(tmp_path: Path) -> None:
    ckpt = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(block, x, use_reentrant=False)\n"
    job = _job(tmp_path, ckpt + OPT + LOADER + LOOP)
    assert job.workload.grad_ckpt == "full" and job.reentrant_ckpt is False
    job = _job(tmp_path, "model.gradient_checkpointing_enable()\n" + OPT + LOADER + LOOP)
    assert job.workload.grad_ckpt == "full"
    assert not any("checkpointing not set" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("ddp", "unused"), [("DDP(model)", False), ("DDP(model, find_unused_parameters=True)", True)])
def test_ddp_and_its_find_unused(tmp_path: Path, ddp: str, unused: bool) -> None:
    """DDP looks for unused parameters only where the script asks, checkpointing or not (the Trainer's rule, on
    without checkpointing and off with it, does not apply)."""
    ckpt = "model.gradient_checkpointing_enable()\n" if unused else ""
    body = f"from torch.nn.parallel import DistributedDataParallel as DDP\n{ckpt}model = {ddp}\n" + OPT + LOADER + LOOP
    job = _job(tmp_path, body, launch="torchrun --nproc_per_node 4")
    assert job.engine == "ddp" and job.find_unused is unused


@pytest.mark.parametrize(("wrap", "engine", "fsdp1"), [
    ("fully_shard(model)", "fsdp_full_shard", False),
    ("fully_shard(model, reshard_after_forward=False)", "fsdp_shard_grad_op", False),
    ("FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)", "fsdp_shard_grad_op", True),
])
def test_fsdp_wrappers(tmp_path: Path, wrap: str, engine: str, fsdp1: bool) -> None:
    job = _job(tmp_path, f"{wrap}\n" + OPT + LOADER + LOOP, launch="torchrun --nproc_per_node 4")
    assert job.engine == engine and job.workload.fsdp1 is fsdp1 and job.workload.flat_params is fsdp1
    # torch's own FSDP keeps no fp32 copy of a bf16 load (only accelerate upcasts), mixed-precision policy or not
    assert job.workload.pure_16bit


def test_fsdp2_policy_on_a_bf16_load_keeps_no_masters(tmp_path: Path) -> None:
    wrap = "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))\n"
    job = _job(tmp_path, wrap + OPT + LOADER + LOOP, launch="torchrun --nproc_per_node 4")
    assert job.engine == "fsdp_full_shard" and job.workload.pure_16bit


def test_deepspeed_initialize_reads_its_json(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    body = (OPT + LOADER + "engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, "
            "config=\"ds.json\")\n" + LOOP.replace("loss.backward()", "engine.backward(loss)"))
    job = _job(tmp_path, body, dtype="torch.float32", launch="deepspeed --num_gpus 4")
    assert job.engine == "deepspeed" and job.zero is not None and job.workload.precision == "bf16"
    with pytest.raises(UserError, match=r"deepspeed.initialize's config cannot be read"):
        _job(tmp_path, body.replace("config=\"ds.json\"", "config=cfg"), launch="deepspeed --num_gpus 4")


def test_several_ranks_without_a_wrapper_plan_ddp_and_say_so(tmp_path: Path) -> None:
    job = _job(tmp_path, launch="torchrun --nproc_per_node 4")
    assert job.engine == "ddp" and job.find_unused is False
    assert any("wraps the model in no DistributedDataParallel" in n for n in job.notes), job.notes


def test_two_kinds_of_wrapper_exit_2(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"wraps the model with ddp at train.py:4, fsdp2 at train.py:5"):
        _job(tmp_path, "model = DDP(model)\nfully_shard(model)\n" + OPT + LOADER + LOOP,
             launch="torchrun --nproc_per_node 4")


def test_speed_note_names_the_loops_host_syncs(tmp_path: Path) -> None:
    loop = LOOP + "    print(loss.item())\n"
    job = _job(tmp_path, OPT + LOADER + loop)
    note = next(n for n in job.notes if n.startswith("tokens/s is what a tuned stack"))
    assert "host syncs" in note and "at train.py:11 each time" in note


def test_accumulation_and_epochs_of_the_loop(tmp_path: Path) -> None:
    body = OPT + LOADER + ("for epoch in range(2):\n"
                           "    for i, batch in enumerate(loader):\n"
                           "        model(**batch).loss.backward()\n"
                           "        if (i + 1) % 8 == 0:\n"
                           "            opt.step()\n"
                           "            opt.zero_grad()\n")
    job = _job(tmp_path, body)
    assert job.workload.grad_accum == 8 and job.convert.get("epochs") == 2
    assert job.keys["for epoch in range"] == "2 (the loop's epochs, train.py:6)"
    said = comments(job, to_config(job))
    assert not any("names no epoch count" in n for n in said), said
    assert any("a hand-written training loop at train.py:7-11" in n for n in job.notes), job.notes


def test_a_step_done_in_the_scripts_own_function_is_the_loops(tmp_path: Path) -> None:
    """`for batch in loader: train_step(batch)` with the backward and the step in `train_step`: the hand loop (its
    optimizer and micro-batch), not the HF Trainer's defaults; the epoch loop around it stays the epochs."""
    body = (OPT.replace("AdamW(model.parameters(), lr=1e-5)", "AdamW(model.parameters(), lr=1e-5, fused=True)") +
            LOADER + "def train_step(batch):\n    loss = model(**batch).loss\n    loss.backward()\n"
            "    opt.step()\n    opt.zero_grad()\n"
            "for epoch in range(2):\n    for batch in loader:\n        train_step(batch)\n")
    job = _job(tmp_path, body)
    assert any("a hand-written training loop at train.py:12-13" in n for n in job.notes), job.notes
    assert not any("the Trainer's default" in n for n in job.notes), job.notes
    w = job.workload
    assert w.micro_batch == 4 and w.optimizer == "adamw" and w.fused_adamw


def test_a_gradscaler_under_any_name_steps_the_optimizer(tmp_path: Path) -> None:
    """The scaler is known by the call that builds it, not by its variable's name."""
    body = (OPT + LOADER + "gs = torch.amp.GradScaler(\"cuda\")\n" +
            LOOP.replace("loss.backward()", "gs.scale(loss).backward()").replace("opt.step()", "gs.step(opt)"))
    job = _job(tmp_path, body, dtype="torch.float32")
    assert job.workload.optimizer == "adamw" and any(n.startswith("optimizer: AdamW at train.py:4") for n in job.notes)


def test_arguments_passed_by_double_star_are_not_guessed(tmp_path: Path) -> None:
    """DataLoader(ds, **kw) may hold the batch: exit 2 asking --batch, never torch's default 1; AdamW(**okw) may
    hold fused=: planned as the foreach upper bound, said."""
    with pytest.raises(UserError, match=r"train.py:5: the DataLoader at train.py:5 takes its arguments from \*\*kw"):
        _job(tmp_path, OPT + "loader = torch.utils.data.DataLoader(ds, **kw)\n" + LOOP)
    job = _job(tmp_path, "opt = torch.optim.AdamW(model.parameters(), **okw)\n" + LOADER + LOOP)
    assert not job.workload.fused_adamw and any("computed in the script" in n for n in job.notes), job.notes


def test_batch_flag_over_the_dataloaders_is_planned_and_said(tmp_path: Path) -> None:
    job = _job(tmp_path, batch=2)
    assert job.workload.micro_batch == 2
    assert any(n.startswith("micro-batch --batch 2 in place of the loop's 4") for n in job.notes), job.notes


@pytest.mark.parametrize("lightning", [
    "import lightning as L\ntrainer = L.Trainer(max_epochs=1)\ntrainer.fit(module, loader)\n",
    "import pytorch_lightning as pl\npl.Trainer(devices=2).fit(module)\n",
    "from lightning.pytorch import Trainer\nTrainer(devices=2).fit(module)\n",
])
def test_a_lightning_script_is_refused_not_read_as_the_hf_trainer(tmp_path: Path, lightning: str) -> None:
    """Lightning's Trainer shares the HF Trainer's name, not its loop or defaults: exit 2 saying how to plan it."""
    with pytest.raises(UserError, match=r"train.py:\d+: the script trains with Lightning's Trainer.*shardfit plan "):
        _job(tmp_path, LOADER + lightning)


def test_accelerators_accumulation_and_module_constants_of_the_wrappers(tmp_path: Path) -> None:
    """Accelerator(gradient_accumulation_steps=4) with the loop under accelerator.accumulate() steps every 4
    micro-batches; a wrapper's keyword given by a module constant is read (find_unused_parameters=UNUSED)."""
    body = (OPT + LOADER + "from accelerate import Accelerator\nacc = Accelerator(gradient_accumulation_steps=4)\n"
            "model, opt, loader = acc.prepare(model, opt, loader)\n" +
            LOOP.replace("    loss = model", "    with acc.accumulate(model):\n        loss = model").replace(
                "    loss.backward()\n    opt.step()\n    opt.zero_grad()\n",
                "        acc.backward(loss)\n        opt.step()\n        opt.zero_grad()\n"))
    job = _job(tmp_path, body)
    assert job.workload.grad_accum == 4 and any("gradient_accumulation_steps=4" in n for n in job.notes), job.notes
    ddp = (OPT + LOADER + "UNUSED = True\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
           "model = DDP(model, find_unused_parameters=UNUSED)\n" + LOOP)
    assert _job(tmp_path, ddp, launch="torchrun --nproc_per_node 2").find_unused


def test_an_annotated_trainer_that_trains_is_the_trainers(tmp_path: Path) -> None:
    body = (OPT + LOADER + LOOP + "from transformers import Trainer\n"
            "trainer: Trainer = Trainer(model=model)\ntrainer.train()\n")
    assert not any("hand-written" in n for n in _job(tmp_path, body).notes)


def test_the_plan_s_offers_for_a_loop_are_said_in_its_code(tmp_path: Path) -> None:
    """A hand-written loop's 4-bit offer is its from_pretrained's BitsAndBytesConfig with peft, not the Trainer
    scripts' --q_lora flag."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.plan.plan import Alternative

    job = _job(tmp_path)
    said = tool_alternative(job, Alternative("QLoRA", (("method", "qlora"),), None, "single", 4.0)).how()
    assert said is not None and "BitsAndBytesConfig(load_in_4bit=True)" in said and "--q_lora" not in said


def test_a_loop_s_micro_batch_offer_says_the_accumulation_it_needs(tmp_path: Path) -> None:
    """Micro-batch 1 with the same global batch, as the loop's code: the count of micro-batches accumulated, not a
    number trailing the sentence."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.plan.plan import Alternative

    one = Alternative("micro-batch 1 with grad_accum 8", (("micro_batch", 1), ("grad_accum", 8)), None, "single", 4.0)
    said = tool_alternative(_job(tmp_path), one).how()
    assert said is not None and "batch_size=1" in said and "8 micro-batches" in said and not said.endswith(" 8"), said
