"""A recipe config's W4A4 run on a pool rank: its generated tokens and its teacher-forced logits."""

from __future__ import annotations

import torch

from equivalence.support.logits_runs import teacher_forced_run
from equivalence.support.parallel_support import on_host, paged_cache, runner_of
from equivalence.support.parallel_support import test_device as worker_device


@torch.no_grad()
def recipe_task(rank, world, cfg_dict, prompts, forced):
    from optimized.config import InferenceConfig
    from optimized.distributed import ParallelState
    from optimized.model_loader.build import load_model
    from optimized.model_loader.hf_config import load_hf_config

    cfg = InferenceConfig.from_dict(cfg_dict)
    m = cfg.model_config
    cfg.validate_for_model(load_hf_config(m.model_path))
    model = load_model(
        m.model_path,
        parallel=ParallelState.build(cfg.parallel_config),
        dtype=m.torch_dtype,
        device=worker_device(),
        hadamard_weight_path=m.hadamard,
    )
    runner = runner_of(model)
    tokens = runner.generate(prompts[:1], cfg.scheduler_config.max_new_tokens).tokens
    cache, table = paged_cache(model, [len(p) + len(forced) for p in prompts])
    out = teacher_forced_run(model, runner, prompts, forced, cache, table)
    out.update(
        tokens=tokens,
        prefill_path=model.paths.prefill,
        decode_path=model.paths.decode,
    )
    return on_host(out)
