"""Tests of models.py: loading (what is placed where, offloaded text encoders), float32 master weights under bf16
compute at real width, and the checks a loaded model gets before training (LoRA targets, sigma grid, CFG).
"""

import json
import shutil
from functools import partial

import pytest
import torch

import builders
import models
import rollouts
import train
import vgrpo
from helpers import BF16_TOKENS, SMALL_RUN, adapter_for, one_line_stop


def test_sharded_transformer_and_offloaded_text_encoders_are_not_placed_on_the_device_at_load(tiny_dirs):
    """Under FSDP2 the transformer stays on the CPU until fully_shard moves each shard (a whole copy per GPU cost
    24-61 GiB at load time); offloaded text encoders stay on the CPU; the VAE goes to the device (meta stands in for
    a GPU here)."""
    cfg = train.Config(model=str(tiny_dirs / "sd3"))
    model = models.load_pipeline(cfg, "sd3", torch.device("meta"), torch.float32, sharded=True)
    places = {name: next(m.parameters()).device.type for name, m in model.pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    assert places == {"transformer": "cpu", "text_encoder": "cpu", "text_encoder_2": "cpu", "text_encoder_3": "cpu",
                      "vae": "meta"}
    model = models.load_pipeline(train.Config(model=str(tiny_dirs / "sd3"), offload_text_encoders=False), "sd3",
                                 torch.device("meta"), torch.float32)
    assert all(next(m.parameters()).is_meta for m in model.pipe.components.values() if isinstance(m, torch.nn.Module))


def test_offloaded_text_encoders_visit_the_device_only_while_encoding(monkeypatch):
    model = adapter_for(builders.tiny_pipeline("sd3"), "sd3")
    moves = []
    for name, module in model.pipe.components.items():
        if name.startswith("text_encoder"):
            real_to = module.to
            monkeypatch.setattr(module, "to", lambda d, _to=real_to, _n=name: (moves.append((_n, str(d))), _to(d))[1])
    cond = rollouts.encode(model, ["a red car"], torch.device("cpu"), offload=True)
    assert [d for _, d in moves] == ["cpu"] * 3 + ["cpu"] * 3 and len({n for n, _ in moves}) == 3
    for k, v in model.encode(["a red car"]).items():
        torch.testing.assert_close(cond[k], v, rtol=0, atol=0)


def one_bf16_step(model_dir, family, dtype, *extra, init=None):
    """train.py's model setup in `dtype` and one vgrpo_update (AdamW lr 1e-4, the flux preset's, no weight decay) on a
    fixed rollout batch; returns the adapter, the trainable parameters before the step, the gradients the step
    used and the optimizer. init: trainable weights to start from (by name)."""
    cfg = train.parse_config(["--model", str(model_dir), *BF16_TOKENS, *extra])
    torch.manual_seed(0)  # the same LoRA initialisation in every call
    model = models.load_pipeline(cfg, family, torch.device("cpu"), dtype)
    models.make_trainable(model.transformer, cfg)
    params = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
    for n, p in params.items():
        if init is not None:
            p.data.copy_(init[n])
    optimizer = torch.optim.AdamW(params.values(), lr=1e-4, weight_decay=0.0)
    grads = {}
    # Parameters whose output nothing reads get no gradient (Qwen-Image's last to_add_out) and no AdamW step.
    optimizer.register_step_pre_hook(lambda *_: grads.update({n: p.grad.clone() for n, p in params.items()
                                                              if p.grad is not None}))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, *model.latent_shape(), generator=g)
    cond = {k: v.repeat(2, *[1] * (v.dim() - 1)) for k, v in model.encode(["a red car"]).items()}
    t, eps = vgrpo.draw_mc_pairs(1, 2, 2, x0.shape[1:], generator=g)
    surrogate = partial(vgrpo.elbo_surrogate, model.velocity)
    with torch.no_grad():
        s_old, _ = surrogate(x0, cond, t, eps)
    before = {n: p.detach().clone() for n, p in params.items()}
    vgrpo.vgrpo_update(surrogate, optimizer, vgrpo.Rollouts(x0, cond, torch.tensor([1.0, 0.0]), t, eps, s_old))
    return model, params, before, grads, optimizer


def assert_float32_master_step(params, before, grads, optimizer, frozen_modules, lr=1e-4):
    """Trainable weights, their gradients and both AdamW states are float32; everything frozen is bfloat16; and the
    realised update is AdamW's first step -lr g / (|g| + eps) from the gradient used, to float32 rounding of the
    weight (bf16 storage rounds most of an lr-sized update away)."""
    assert grads and all(params[n].dtype == torch.float32 for n in params)
    for n in grads:
        p, state = params[n], optimizer.state[params[n]]
        assert p.dtype == grads[n].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, n
        g = grads[n].double()
        intended = -lr * g / (g.abs() + 1e-8)
        realised = p.detach().double() - before[n].double()
        # Half an ULP of the stored float32 result, plus the step's own float32 arithmetic: about 10 roundings of
        # relative size 2^-24 on the lr-sized update (lerp into exp_avg, g*g and its scaling into exp_avg_sq, sqrt,
        # bias corrections, + eps, the quotient, x step size). Measured on this CI's CPU: 3.9 of those 10 beyond the
        # half ULP, which the former bound (|w| + lr) 2^-22 (4 in all near w = 0) failed; it passed on the CPU it was
        # written on. bf16 storage is off by ~|w| 2^-9, a missing bias correction by ~lr.
        bound = (p.detach().double().abs() + 10 * lr) * 2**-24
        assert ((realised - intended).abs() <= bound).all(), n
    # bf16, T5's wo too (transformers 5 keeps it only in fp16); float32 where diffusers keeps a module so in any dtype
    # (Wan's time embedder, norms and modulation tables: WanTransformer3DModel._keep_in_fp32_modules)
    frozen = {(n, p.dtype, any(k in n.split(".") for k in (getattr(m, "_keep_in_fp32_modules", None) or [])
                               if type(m).__module__.startswith("diffusers.")))
              for m in frozen_modules for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen and all(dtype == (torch.float32 if kept else torch.bfloat16) for _, dtype, kept in frozen)


@pytest.mark.parametrize("name,extra", [("flux.1-dev", ()), ("qwen-image", ()), ("flux.2-klein-4b", ()),
                                        ("wan2.1-t2v-1.3b", ("--num_frames", "5"))])
def test_bf16_lora_training_keeps_float32_master_weights_and_matches_an_fp32_step(name, extra, real_dirs,
                                                                                   bf16_matmul_fast):
    """Real width (FLUX.1-dev, Qwen-Image, FLUX.2 [klein] 4B, Wan2.1-1.3B on 5-frame videos), LoRA: bf16 compute,
    fp32 storage; the gradient agrees with an fp32-compute step to bf16 compute error (the realised update, checked
    exactly against AdamW, carries no bf16 storage error)."""
    family = builders.REAL_CONFIGS[name]["family"]
    model, params, before, grads, optimizer = one_bf16_step(real_dirs / name, family, torch.bfloat16, *extra)
    assert_float32_master_step(params, before, grads, optimizer,
                               [c for c in model.pipe.components.values() if isinstance(c, torch.nn.Module)])
    # peft initialises the adapter in the base layer's dtype: start the fp32 run from the same (bf16-rounded) values
    _, _, _, grads32, _ = one_bf16_step(real_dirs / name, family, torch.float32, *extra, init=before)
    g16 = torch.cat([grads[n].flatten() for n in sorted(grads)])
    g32 = torch.cat([grads32[n].flatten() for n in sorted(grads32)])
    # Compute error, not storage error: at this width with random weights the bf16 velocity itself is 4% off the
    # fp32 one (text embeddings 0.5%), and the gradient of the surrogate inherits it: measured relative error 0.43,
    # cosine 0.905, the same in every LoRA tensor (Qwen-Image 0.13 / 0.992, FLUX.2 [klein] 0.013 / 0.9999). A broken bf16 path (no gradient, wrong sign, a frozen adapter)
    # gives a cosine near 0 or below.
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0).item() > 0.8
    assert ((g16 - g32).norm() / g32.norm()).item() < 0.6


def test_bf16_full_finetuning_keeps_float32_master_weights(real_dirs, bf16_matmul_fast):
    """SD3.5-Medium width, every transformer weight trained: fp32 weights, gradients and AdamW states."""
    model, params, before, grads, optimizer = one_bf16_step(real_dirs / "sd3.5-medium", "sd3", torch.bfloat16,
                                                            "--lora_rank", "0")
    assert len(params) == len(list(model.transformer.parameters()))
    assert_float32_master_step(params, before, grads, optimizer, [model.pipe.text_encoder_3, model.pipe.vae])


def test_lora_targets_that_match_no_layer_stop_before_training(tiny_dirs, tmp_path, monkeypatch, capsys):
    """peft raises when no target matches and silently drops a target when another one does; both are refused."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started"))
    for targets in ("nope", "to_q,to_qq"):
        message = one_line_stop(train.main, ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl",
                                             "--run_dir", tmp_path / targets, *SMALL_RUN, "--lora_targets", targets], capsys)
        bad = targets.split(",")[-1]
        assert message.startswith(f"error: --lora_targets: {bad} match no Linear layer of the SD3Transformer2DModel; "
                                  "its Linear layers end in ") and "to_out.0" in message


def test_a_sigma_grid_that_is_not_finite_stops_before_training(tiny_dirs, tmp_path, monkeypatch, capsys):
    """A saved pipeline whose scheduler has shift 0 (sigma(1) = 0 / 0) is refused with one clear error after loading,
    instead of NaN rollouts that read as a diverged run."""
    monkeypatch.setattr(vgrpo, "vgrpo_update", lambda *a, **k: pytest.fail("training started"))
    model = tmp_path / "sd3"
    shutil.copytree(tiny_dirs / "sd3", model)
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift": 0.0}))
    message = one_line_stop(train.main, ["--model", model, "--prompts", tiny_dirs / "prompts.jsonl", "--run_dir",
                                         tmp_path / "run", *SMALL_RUN], capsys)
    assert message.startswith("error: StableDiffusion3Pipeline's scheduler gives a sigma grid that is not finite for "
                              "--sampling_steps 4")


def test_cfg_on_a_step_distilled_hub_checkpoint_is_refused_from_its_model_index(monkeypatch, tmp_path, capsys):
    """A FLUX.2 [klein] hub id the project does not list (the distilled 9B, say) is read from its model_index.json:
    is_distilled there refuses --cfg_scale, as Flux2KleinPipeline would ignore it; the base model trains with it."""
    from diffusers import DiffusionPipeline

    indexes = {"black-forest-labs/FLUX.2-klein-9B": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
               "black-forest-labs/FLUX.2-klein-base-9B": {"_class_name": "Flux2KleinPipeline", "is_distilled": False}}
    monkeypatch.setattr(DiffusionPipeline, "load_config", lambda model, **kw: indexes[model])
    monkeypatch.setattr(train, "train", lambda cfg, family, *a: pytest.fail(f"{cfg.model} reached training"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car\n")
    assert "klein-9B is step-distilled" in one_line_stop(train.main, ["--model", "black-forest-labs/FLUX.2-klein-9B",
                                                                      "--cfg_scale", "4", "--prompts", prompts], capsys)
    base = train.parse_config(["--model", "black-forest-labs/FLUX.2-klein-base-9B", "--cfg_scale", "4", "--prompts",
                               str(prompts)])
    assert train.validate(base, 1) == "flux2"


def test_init_lora_starts_the_adapters_from_an_export_as_diffusers_loads_it(sd3_run, tiny_dirs, tmp_path):
    """Each of the paper's SD3.5-M stages starts from the stage before's LoRA export (--init_lora RUN/final): the
    trainable float32 adapters then give the velocity of the base pipeline with pipe.load_lora_weights(export)."""
    from diffusers import DiffusionPipeline

    cfg = train.Config(model=str(tiny_dirs / "sd3"), init_lora=str(sd3_run / "final"), dtype="float32")
    model = models.load_pipeline(cfg, "sd3", torch.device("cpu"), torch.float32)
    models.make_trainable(model.transformer, cfg)
    g = torch.Generator().manual_seed(0)
    z, t, cond = torch.randn(2, *model.latent_shape(), generator=g), torch.tensor([0.3, 0.8]), model.encode(["a red car"] * 2)
    with torch.no_grad():
        fresh = model.velocity(z, t, cond)
        models.start_from_lora_export(model.transformer, cfg.init_lora, cfg)
        started = model.velocity(z, t, cond)
    pipe = DiffusionPipeline.from_pretrained(tiny_dirs / "sd3", dtype=torch.float32)
    pipe.load_lora_weights(sd3_run / "final")
    with torch.no_grad():
        want = adapter_for(pipe, "sd3", resolution=model.resolution).velocity(z, t, cond)
    assert (want - fresh).abs().max() > 1e-4  # the export moved the model, so the check below can fail
    torch.testing.assert_close(started, want, rtol=1e-5, atol=1e-5)
    assert all(p.dtype == torch.float32 for p in model.transformer.parameters() if p.requires_grad)
    # Through train.py: a step of lr 1e-30 moves no float32 weight, so the run exports what it started from.
    from safetensors.torch import load_file

    train.main([str(a) for a in ("--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN,
                                 "--iterations", "1", "--lr", "1e-30", "--init_lora", sd3_run / "final",
                                 "--run_dir", tmp_path / "stage2")])
    started, saved = (load_file(d / "pytorch_lora_weights.safetensors") for d in (tmp_path / "stage2" / "final",
                                                                                   sd3_run / "final"))
    assert started.keys() == saved.keys() and all(torch.equal(started[k], saved[k]) for k in saved)


def test_init_lora_that_is_not_this_runs_adapters_is_refused_in_one_line(sd3_run, tiny_dirs, tmp_path, capsys):
    common = ["--model", tiny_dirs / "sd3", "--prompts", tiny_dirs / "prompts.jsonl", *SMALL_RUN]
    for case, (extra, message) in enumerate([
            (["--init_lora", tmp_path], "no pytorch_lora_weights.safetensors there"),
            (["--init_lora", sd3_run / "final", "--lora_rank", "16"], "holds LoRA rank 32, alpha 64; this run trains rank 16"),
            (["--init_lora", sd3_run / "final", "--lora_targets", "to_q,to_k"], "does not hold this run's adapters"),
            (["--init_lora", sd3_run / "final", "--lora_rank", "0"], "it needs --lora_rank > 0")]):
        got = one_line_stop(train.main, [*common, "--run_dir", tmp_path / f"run{case}", *extra], capsys)
        assert message in got, got


def test_the_five_stage_presets_are_the_papers_curriculum():
    """Table 3's schedule (PAPER-TABLES, "The five SD3.5-M stages"): rewards, gradient steps 150/200/150/50/30 = 580,
    K 4/10/4/10/10 (NFE per step 40 + 2K = 48/60/48/60/60), 40-step rollouts, the soft clip in the fully on-policy
    stages, the x-space KL beta 0.3 in the OCR stage, each on Flow-GRPO's prompt files."""
    stages = [train.parse_config(["--preset", f"sd35m-stage{n}"]) for n in range(1, 6)]
    assert [c.iterations * c.num_grad_steps for c in stages] == [150, 200, 150, 50, 30]
    assert [c.num_mc for c in stages] == [4, 10, 4, 10, 10] and {c.sampling_steps for c in stages} == {40}
    assert [c.sampling_steps + 2 * c.num_mc for c in stages] == [48, 60, 48, 60, 60]
    assert [c.prompts for c in stages] == ["pickscore", "geneval", "pickscore", "geneval", "ocr"]
    assert [c.rewards for c in stages] == ["hpsv21:1,pickscore:1,clipscore:1", "geneval:1",
                                          "hpsv21:1,pickscore:1,clipscore:1", "geneval:1", "ocr:1"]
    assert [(c.num_grad_steps == 1, c.soft_clip_eta is not None) for c in stages] == [(True, True), (False, False)] * 2 + [
        (False, False)]
    assert [c.kl_coef for c in stages] == [0, 0, 0, 0, 0.3]
    assert {(c.lora_rank, c.lora_alpha, c.resolution, c.cfg_scale) for c in stages} == {(32, 64, 512, 1.0)}
