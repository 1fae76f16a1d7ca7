"""`python -m optimized generate` (single process, or one process per rank under torchrun).

Reads the inference YAML (`--config`; options such as `--model-path`, `--max-new-tokens`, `--dtype` override it),
takes the batch from `--prompt TEXT` / `--prompt-ids 1,2,3` (one request each) or else from data_config, assembles
the run (optimized/executor/assembly.py: launch checks, rank agreement, the plan printed, the model) and runs the
engine to completion: greedy unless `--temperature` > 0, each request stopping at an EOS id unless `--ignore-eos`.
Rank 0 prints per request `prompt ids:`, `generated ids:`, `finish:` and, with a tokenizer, `text:` and
`completion:` (the lines `python -m reference generate` prints), then the prefill time and the decode time per token
(graph mode: the first decode step, which compiles or loads the graph, apart). `--save-logits FILE` writes the
prompts, the tokens, the logits at every prompt position and those each generated token was chosen from.
A prompt longer than data_config.input_max_len is an error, never truncated. docs/config.md.
"""

from __future__ import annotations

import sys

from optimized import datasets
from optimized.cli.common import parse_prompt_ids
from optimized.executor.assembly import say
from optimized.errors import UsageError
from optimized.executor.model_runner import check_prompts
from optimized.model_loader.tokenizer import encode_prompt, eos_token_ids


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="greedy generation from an inference config (single process or torchrun)")
    gen.add_argument("--config", required=True, help="inference config YAML (see optimized/config.py)")
    gen.add_argument("--model-path", help="overrides model_config.model_path (directory, fixture:NAME, preset:NAME)")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt, encoded by the checkpoint's tokenizer; repeat for a batch",
    )
    prompt.add_argument(
        "--prompt-ids",
        action="append",
        type=parse_prompt_ids,
        metavar="IDS",
        help="comma-separated token ids, e.g. 1,2,3; repeat for a batch",
    )
    gen.add_argument("--max-new-tokens", type=int, help="overrides scheduler_config.max_new_tokens")
    gen.add_argument("--dtype", choices=["bfloat16", "float32"], help="overrides model_config.dtype")
    gen.add_argument("--block-size", type=int, help="overrides scheduler_config.block_size (a multiple of 16)")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template (tokenizer_mode: chat)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching this mass")
    gen.add_argument("--seed", type=int, help="sampling seed (same seed, same tokens)")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    gen.add_argument("--save-logits", metavar="FILE", help="torch.save the prompt and generation logits (rank 0)")
    gen.add_argument(
        "--no-weight-check",
        action="store_true",
        help="skip the load-time check that every weight is finite (it reads each weight once more)",
    )


def build_prompts(args, cfg, vocab_size: int, tokenizer) -> list[list[int]]:
    data, batch = cfg.data_config, cfg.scheduler_config.batch_size
    mode = "chat" if args.chat else cfg.model_config.tokenizer_mode
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat applies the chat template to text prompts; it cannot be combined with --prompt-ids")
    if args.prompt is not None:
        prompts = [encode_prompt(tokenizer, p, mode, f"--prompt {i}") for i, p in enumerate(args.prompt)]
    elif args.prompt_ids is not None:
        prompts = list(args.prompt_ids)
    elif data.dataset == "random":
        import torch

        gen = torch.Generator().manual_seed(data.seed)
        prompts = torch.randint(0, vocab_size, (batch, data.input_max_len), generator=gen).tolist()
    elif data.dataset == "LongBench":
        if tokenizer is None:
            raise UsageError("data_config.dataset LongBench needs the checkpoint's tokenizer, and it has none")
        contexts = datasets.load_longbench(data.dataset_path, log=say)
        prompts = [
            datasets.longbench_prompt(
                tokenizer, contexts[i % len(contexts)], data.truncation, cfg.scheduler_config.max_new_tokens
            )
            for i in range(batch)
        ]
    else:  # prompts, or default: its default_prompt.json when dataset_path is set
        texts, key = data.prompts, "data_config.prompts"
        if data.dataset == "default" and data.dataset_path:
            texts = datasets.load_default_prompts(data.dataset_path)
            key = f"{data.dataset_path}/{datasets.DEFAULT_PROMPT_FILE}"
        prompts = [
            encode_prompt(tokenizer, texts[i % len(texts)], mode, f"{key}[{i % len(texts)}]") for i in range(batch)
        ]
    if data.truncation is not None and (args.prompt is None and args.prompt_ids is None):
        prompts, cut = datasets.truncate(prompts, data.truncation)  # the recipe's rule, said aloud
        if cut:
            say(f"data_config.input_truncated_len: {cut} prompt(s) cut to their first {data.truncation} tokens")
    for i, p in enumerate(prompts):
        if len(p) > data.input_max_len:  # never truncated silently
            raise UsageError(
                f"prompt {i} has {len(p)} tokens, more than data_config.input_max_len="
                f"{data.input_max_len}; shorten it or raise input_max_len"
            )
    return prompts


def run(args) -> int:
    from optimized.executor import assembly
    from optimized.executor.sampling import SamplingParams

    cfg = assembly.load_config(
        args.config,
        model_path=args.model_path,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
    )
    s = cfg.scheduler_config
    launch = assembly.prepare(cfg, "generate", check_weights=not args.no_weight_check)
    hf_config, model_dir, tokenizer = launch.hf_config, launch.model_dir, launch.tokenizer
    try:  # the library's ValueErrors about what the command line gave: --temperature / --top-k / --top-p / --seed,
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        prompts = build_prompts(args, cfg, hf_config.vocab_size, tokenizer)
        # before loading the model: a bad prompt should not cost a checkpoint load
        check_prompts(prompts, s.max_new_tokens, hf_config.vocab_size, hf_config.max_position_embeddings)
    except UsageError:  # PromptError, DatasetError: already named
        raise
    except ValueError as e:  # ... and the prompts (empty, ids outside the vocabulary, too long)
        raise UsageError(str(e)) from None
    eos = [] if args.ignore_eos else eos_token_ids(model_dir)  # PromptError naming the file

    from optimized.executor.plan import pool_blocks

    blocks = pool_blocks([len(q) + s.max_new_tokens for q in prompts], s.block_size, cfg.parallel_config.attn_dp_size)
    run = launch.start(
        batch=len(prompts),
        prefill_tokens=sum(len(q) for q in prompts),
        kv_pool_blocks=blocks,
        kv_pool_source="the prompts",
        prompts=prompts,
        agree=dict(sampling=repr(sampling), eos=eos, chat=args.chat),
    )
    try:
        with run.named_errors():
            positions = [list(range(len(q))) for q in prompts] if args.save_logits else None
            with run.profiled(args.config) as trace:
                result = run.runner.generate(
                    prompts,
                    s.max_new_tokens,
                    sampling=sampling,
                    eos_token_id=eos,
                    prompt_logits_positions=positions,
                    return_logits=bool(args.save_logits),
                )
            if trace is not None and run.env.rank == 0:
                print(f"profiler trace: {trace.parent if trace.suffix else trace} (one per rank)", flush=True)
        if run.env.rank == 0:
            _print_result(cfg, model_dir, prompts, result, run.env.world_size, tokenizer)
            if cfg.model_config.exe_mode != "eager":
                _print_graph(run.runner.decode_forward, result, launch.compile_cache)
            if args.save_logits:
                _save_logits(args.save_logits, prompts, result)
    finally:
        run.close()
    return 0


def _save_logits(path, prompts, result) -> None:
    import torch

    try:
        with open(path, "wb") as f:
            torch.save(
                {
                    "prompts": prompts,
                    "tokens": result.tokens,
                    "prompt_logits": result.prompt_logits,
                    "logits": result.logits,
                    "finish_reasons": result.finish_reasons,
                },
                f,
            )
    except OSError as e:  # a read-only or missing directory, a full disk
        raise UsageError(f"--save-logits: cannot write {path!r}: {e.strerror or e}") from None


def _print_result(cfg, model_dir, prompts, result, world_size: int, tokenizer) -> None:
    m, p = cfg.model_config, cfg.parallel_config
    layout = ", ".join(
        f"{k} {getattr(p, k)}"
        for k in ("attn_tp_size", "moe_tp_size", "moe_ep_size", "embed_tp_size", "lmhead_tp_size")
    )
    print(
        f"model: {m.model_path} ({model_dir}), {m.dtype}, {'checkpoint' if m.with_ckpt else 'random weights'}, "
        f"world_size {world_size} ({layout}), exe_mode {m.exe_mode}"
    )
    many = len(prompts) > 1
    for i, (prompt, new) in enumerate(zip(prompts, result.tokens)):
        tag = f"[{i}] " if many else ""
        print(f"{tag}prompt ids: {','.join(map(str, prompt))}")
        print(f"{tag}generated ids: {','.join(map(str, new))}")
        print(f"{tag}finish: {result.finish_reasons[i]}")
        if tokenizer is not None:
            print(f"{tag}text: {tokenizer.decode(prompt + new)!r}")
            print(f"{tag}completion: {tokenizer.decode(new)!r}")
    n_tokens = sum(len(q) for q in prompts)
    print(f"prefill: {1000 * result.prefill_seconds:.2f} ms ({n_tokens} tokens in {len(prompts)} request(s))")
    steps = len(result.decode_seconds)
    print(f"decode: {result.decode_ms_per_token:.2f} ms/token ({steps} step(s), batch {len(prompts)})")
    sys.stdout.flush()


def _print_graph(decoder, result, compile_cache) -> None:
    for line in decoder.describe():
        print(line)
    if compile_cache is not None:
        print(f"compile cache: {compile_cache.root}")
    steady = result.decode_seconds[1:]
    if steady:
        print(
            f"decode (graph, steps after the first): {1000 * sum(steady) / len(steady):.2f} ms/token "
            f"({len(steady)} step(s))"
        )
    sys.stdout.flush()
