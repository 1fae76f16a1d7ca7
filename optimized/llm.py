"""The library: `LLM(config_or_model_dir, **overrides)` and `llm.generate(prompts, SamplingParams(...))`.

A thin layer over the one assembly (optimized/executor/assembly.py): the constructor loads and checks the config,
the model's config and the tokenizer (`prepare`); the first `generate` / `chat` starts the run (`Launch.start`:
the job, the plan, the process groups, the model, the runner) with the batch and the KV pool sized from its
prompts; every call runs its requests through the continuous-batching engine. Under torchrun every rank
constructs the same LLM and makes the same calls; rank 0 returns the outputs and every other rank an empty list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from optimized.errors import UsageError
from optimized.executor import sampling as engine_sampling

_MODEL_PATH_PREFIXES = ("fixture:", "preset:")  # a model path given in place of a config
PROMPT_0 = re.compile(r"\b(prompts?(?:\[| ))0\b")  # how check_prompts names the first prompt


@dataclass(frozen=True)
class SamplingParams(engine_sampling.SamplingParams):
    """The engine's sampling (temperature, top_k, top_p, seed, penalties, logit_bias, min_tokens) and, per request:
    max_tokens (None: scheduler_config.max_new_tokens), logprobs (None: none; k: the chosen token's logprob and
    the k most likely), ignore_eos (always generate max_tokens)."""

    max_tokens: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        super().__post_init__()
        m, k = self.max_tokens, self.logprobs
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_tokens={m!r} must be an integer >= 1 or None")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
            raise ValueError(f"logprobs={k!r} must be an integer in [0, 20] or None")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a boolean")

    def engine_params(self) -> engine_sampling.SamplingParams:
        """The part the engine samples with."""
        base = engine_sampling.SamplingParams
        return base(**{f.name: getattr(self, f.name) for f in fields(base)})


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the `logprobs` most likely tokens of its step, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """One prompt's generation. text: the generated tokens decoded (a final stop token left out; None without a
    tokenizer); token_ids: every generated id (a stop id kept); finish_reason: "stop" (a stop id) or "length"."""

    prompt: str | list[dict] | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


def config_of(source, overrides: dict):
    """The InferenceConfig of an inference YAML, an InferenceConfig or a checkpoint directory (or `fixture:NAME` /
    `preset:NAME`), with `overrides` (bare keys of any section, or a section name with a dict) applied."""
    from optimized.config import ConfigError, InferenceConfig
    from optimized.executor import assembly

    if isinstance(source, InferenceConfig):
        cfg = source
    elif isinstance(source, (str, Path)) and (Path(source).is_dir() or str(source).startswith(_MODEL_PATH_PREFIXES)):
        model = {"model_path": str(source)}
        if str(source).startswith("preset:"):
            model["with_ckpt"] = False  # a preset has shapes, not weights
        cfg = InferenceConfig.from_dict({"model_config": model})
    elif isinstance(source, (str, Path)):
        cfg = assembly.load_config(source)  # UsageError naming the file
    else:
        raise UsageError(
            f"LLM(...) takes an inference config YAML path, an InferenceConfig or a checkpoint directory; "
            f"got {type(source).__name__}"
        )
    if not overrides:
        return cfg
    d = _plain_dict(cfg)
    for key, value in overrides.items():
        section, key = _section_of(key, value)
        if key is None:  # a whole section's dict
            d[section].update(value)
        else:
            d[section][key] = value
    try:
        out = InferenceConfig.from_dict(d, source=str(getattr(cfg, "source", None) or "LLM(...)"))
    except ConfigError as e:
        raise UsageError("LLM(...) overrides: " + "; ".join(f"{k}: {m}" for k, m in e.errors)) from None
    out.source = getattr(cfg, "source", None)
    return out


def _plain_dict(cfg) -> dict:
    """cfg as from_dict takes it, the derived parallel sizes left out (they follow the overrides)."""
    d = cfg.to_dict()
    p = cfg.parallel_config
    for key in ("moe_ep_size", "attn_dp"):
        if p.derived(key):
            d["parallel_config"][key] = None
    return d


def _section_of(key: str, value) -> tuple[str, str | None]:
    from optimized.config import SECTIONS

    if key in SECTIONS:
        if not isinstance(value, dict):
            raise UsageError(f"LLM(...) override {key}= must be a dict of that section's keys")
        return key, None
    # no key sits in two sections (tests/test_llm.py keeps it so): a bare name is never ambiguous
    owners = [name for name, cls in SECTIONS.items() if key in {f.name for f in fields(cls)}]
    if not owners:
        allowed = sorted({f.name for cls in SECTIONS.values() for f in fields(cls)} | set(SECTIONS))
        raise UsageError(f"LLM(...) has no setting {key!r}; allowed: {', '.join(allowed)}")
    return owners[0], key


class LLM:
    """A model ready to generate; see the module docstring. `close()` (or `with LLM(...) as llm:`) ends the run."""

    def __init__(self, model, **overrides):
        from optimized.executor import assembly

        self.config = config_of(model, overrides)
        self._launch = assembly.prepare(self.config, "generate")
        self.tokenizer = self._launch.tokenizer  # None when the checkpoint ships none (token ids still work)
        self._run = None
        self._eos = None
        self._closed = False

    @property
    def plan(self):
        """The run's ExecutionPlan (None until the first call starts it)."""
        return None if self._run is None else self._run.plan

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 for a single process)."""
        if self._run is not None:
            return self._run.env.rank
        from optimized import envs

        return envs.rank() or 0

    # ---- the calls
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """One output per prompt (text, or a list of token ids), in order; greedy when sampling_params is None.
        Rank 0 returns the outputs, every other rank of a torchrun job an empty list."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
        return self._generate(list(prompts), ids, sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """One conversation ([{role, content}]) or a list of them, through the checkpoint's chat template."""
        if not isinstance(messages, list) or not messages:
            raise UsageError("chat(messages): give a non-empty list of {role, content} (or a list of such lists)")
        conversations = messages if isinstance(messages[0], list) else [messages]
        if self.tokenizer is None:
            raise UsageError(f"chat(...) needs the checkpoint's tokenizer; {self._launch.model_dir} has none")
        ids = [self.tokenizer.encode_messages(_checked(c, i), f"messages {i}") for i, c in enumerate(conversations)]
        return self._generate(conversations, ids, sampling_params)

    def close(self) -> None:
        """The run's process groups are destroyed; further calls are refused."""
        self._closed = True
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inside
    def _prompt_ids(self, prompt, i: int) -> list[int]:
        from optimized.model_loader.tokenizer import encode_prompt

        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, self.config.model_config.tokenizer_mode, f"prompt {i}")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise UsageError(f"prompt {i} must be a string or a list of token ids; got {type(prompt).__name__}")

    def _generate(self, prompts, ids: list[list[int]], sampling_params):
        from optimized.executor.model_runner import check_prompts

        if self._closed:
            raise UsageError("this LLM is closed")
        if not ids:
            raise UsageError("generate(...) needs at least one prompt")
        params = self._params_per_prompt(sampling_params, len(ids))
        hf, s = self._launch.hf_config, self.config.scheduler_config
        budgets = [q.max_tokens or s.max_new_tokens for q in params]
        for i, (p, n) in enumerate(zip(ids, budgets)):
            try:
                check_prompts([p], n, hf.vocab_size, hf.max_position_embeddings)
            except ValueError as e:  # checked alone, it is prompt 0 in the message: name it by its index
                msg = str(e) if re.search(PROMPT_0, str(e)) else f"prompt 0: {e}"
                raise UsageError(re.sub(PROMPT_0, rf"\g<1>{i}", msg)) from None
        self._start(ids, budgets, params)
        run = self._run
        # enable_profiler: each rank's trace of the last call, under output_path (else the YAML's directory or the cwd)
        with run.named_errors(), run.profiled(getattr(self.config, "source", None) or "LLM"):
            requests = self._requests(ids, budgets, params)
            logprobs = self._drain(requests, budgets)
        if run.env.rank != 0:
            return []
        return [self._output(p, q, r, lp) for p, q, r, lp in zip(prompts, ids, requests, logprobs)]

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise UsageError(f"{len(sampling_params)} SamplingParams for {n} prompts; give one, or one each")
            out = sampling_params
        else:
            out = [sampling_params] * n
        for q in out:
            if not isinstance(q, engine_sampling.SamplingParams):
                raise UsageError(f"sampling_params must be SamplingParams; got {type(q).__name__}")
        return [q if isinstance(q, SamplingParams) else SamplingParams(**_fields_of(q)) for q in out]

    def _start(self, ids, budgets, params) -> None:
        """The first call starts the run, planned for its prompts; later calls are checked to agree across ranks."""
        from optimized.distributed.guard import check_ranks_agree, run_fingerprint
        from optimized.executor.plan import pool_blocks

        agree = dict(sampling=repr(params), budgets=budgets)
        if self._run is not None:
            with self._run.named_errors():
                check_ranks_agree(run_fingerprint({}, self._launch.model_dir, ids, command="generate", **agree))
            return
        from optimized.model_loader.tokenizer import eos_token_ids

        p = self.config.parallel_config
        self._eos = frozenset(eos_token_ids(self._launch.model_dir))  # PromptError naming the file
        block_size = self.config.scheduler_config.block_size
        blocks = pool_blocks([len(q) + n for q, n in zip(ids, budgets)], block_size, p.attn_dp_size)
        self._run = self._launch.start(
            batch=len(ids),
            prefill_tokens=sum(map(len, ids)),
            kv_pool_blocks=blocks,
            kv_pool_source="the prompts",
            prompts=ids,
            agree=agree,
        )

    def _requests(self, ids, budgets, params):
        from optimized.executor.engine import shared_seed
        from optimized.executor.scheduler import Request

        out = []
        for i, (prompt, n, q) in enumerate(zip(ids, budgets, params)):
            engine_q = q.engine_params()
            if not engine_q.greedy and engine_q.seed is None:  # the same seed on every rank (one broadcast)
                engine_q = replace(engine_q, seed=shared_seed(self._run.runner.device))
            stops = frozenset() if q.ignore_eos else self._eos
            out.append(Request(str(i), list(prompt), n, engine_q, stops, logprobs=q.logprobs, stream=i))
        return out

    def _drain(self, requests, budgets) -> list[list[TokenLogprob]]:
        """The requests through one engine to completion (a batch beyond the plan's waits its turn); the logprobs
        of each request's tokens, when it asked for them."""
        from optimized.executor.engine import Engine
        from optimized.executor.model_runner import NonFiniteLogitsError
        from optimized.executor.plan import pool_blocks

        run, s = self._run, self.config.scheduler_config
        batch = min(len(requests), run.plan.batch)  # the MC2 window and graph buckets were sized for plan.batch
        largest = sorted((len(r.prompt) + n for r, n in zip(requests, budgets)), reverse=True)[:batch]
        try:
            engine = Engine(
                run.runner,
                batch_size=batch,
                max_prefill_tokens=s.max_prefill_tokens,
                num_blocks=pool_blocks(largest, s.block_size, run.plan.dp_groups),
            )
            for r in requests:
                engine.add(r)
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(str(e)) from None
        logprobs = {r.request_id: [] for r in requests}
        while not engine.idle:
            _, events = engine.step()
            for e in events:
                if e.error is not None:
                    raise NonFiniteLogitsError(e.error)
                if e.logprob is not None:
                    logprobs[e.request.request_id].append(TokenLogprob(e.token, e.logprob, e.top_logprobs or []))
        return [logprobs[r.request_id] for r in requests]

    def _output(self, prompt, ids, request, logprobs) -> RequestOutput:
        tokens = list(request.tokens)
        stopped = request.finish_reason == "stop"
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens[:-1] if stopped else tokens)
        return RequestOutput(
            prompt=prompt if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], dict) else None,
            prompt_token_ids=ids,
            text=text,
            token_ids=tokens,
            finish_reason="stop" if stopped else "length",
            logprobs=logprobs if request.logprobs is not None else None,
        )


def _fields_of(q) -> dict:
    return {f.name: getattr(q, f.name) for f in fields(engine_sampling.SamplingParams)}


def _checked(conversation, i: int) -> list[dict]:
    if not isinstance(conversation, list) or not conversation:
        raise UsageError(f"messages {i} must be a non-empty list of {{role, content}}")
    for j, m in enumerate(conversation):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"messages {i}[{j}] must be a dict with a string 'role' and a string 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in conversation]
