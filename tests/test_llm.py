"""The library API (`optimized.LLM`): greedy tokens equal the reference's, seeded sampling equals the runner's,
logprobs, chat, batches beyond the planned one, overrides refused by name, and an import that stays light."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.checkpoints import checkpoint
from optimized import LLM, SamplingParams
from optimized.config import SECTIONS, InferenceConfig
from optimized.errors import UsageError
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos
from reference.tokenizer import decode, encode, eos_token_ids, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SINGLE = str(REPO / "fixtures" / "configs" / "tiny_single.yaml")


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = greedy_generate(load_model(checkpoint("tiny")), torch.tensor([prompt]), n)[0].tolist()
    return trim_at_eos(tokens, eos_token_ids(checkpoint("tiny")))


@pytest.fixture(scope="module")
def llm():
    with LLM(SINGLE) as llm:
        yield llm


def test_greedy_equals_the_reference_with_logprobs_and_a_larger_batch_later(llm):
    tok = load_tokenizer(checkpoint("tiny"))
    prompts = ["The capital of France is", [5, 6, 7, 8]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2))
    assert llm.plan.batch == 2  # planned for the first call's prompts
    for prompt, out in zip(prompts, outs):
        ids = encode(tok, prompt) if isinstance(prompt, str) else prompt
        expected = reference_tokens(ids, 6)
        assert out.prompt_token_ids == ids and out.token_ids == expected
        stopped = expected[-1] in eos_token_ids(checkpoint("tiny"))
        assert out.finish_reason == ("stop" if stopped else "length")
        assert out.text == decode(tok, expected[:-1] if stopped else expected)
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
        assert [lp.token_id for lp in out.logprobs] == expected
        for lp in out.logprobs:  # greedy: the chosen token is the most likely, with its own logprob
            assert len(lp.top) == 2 and lp.top[0] == (lp.token_id, lp.logprob) and lp.logprob >= lp.top[1][1]
    # three prompts on a run planned for two: they wait their turn, each still the reference's tokens
    more = ["1, 2, 3,", "Hello", [9, 10]]
    outs = llm.generate(more, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == [
        reference_tokens(encode(tok, p) if isinstance(p, str) else p, 5) for p in more
    ]
    assert all(o.logprobs is None for o in outs)


def test_seeded_sampling_equals_the_runner_and_repeats(llm):
    q = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    first = [o.token_ids for o in llm.generate(prompts, q)]
    runner = llm._run.runner.generate(prompts, 6, sampling=q.engine_params(), eos_token_id=llm._eos)
    assert first == runner.tokens
    assert first == [o.token_ids for o in llm.generate(prompts, q)]
    ignored = llm.generate(prompts, dataclasses.replace(q, ignore_eos=True, max_tokens=8))
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in ignored)


def test_chat_is_generate_over_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=4))
    ids = llm.tokenizer.encode_messages(messages)
    assert out.prompt == messages and out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], SamplingParams(max_tokens=4))[0].token_ids
    assert len(llm.chat([messages, messages[1:]])) == 2
    with pytest.raises(UsageError, match=r"messages 0\[0\] must be a dict"):
        llm.chat([{"role": "user"}])


def test_bad_calls_are_usage_errors_naming_what(llm):
    with pytest.raises(UsageError, match=r"^prompt 1: token id 1000000 is outside the vocabulary"):
        llm.generate([[1], [10**6]])
    with pytest.raises(UsageError, match=r"^prompt 1\b.*at least one token"):
        llm.generate([[1], []])
    with pytest.raises(UsageError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


def test_overrides_by_bare_key_or_section_and_unknown_names_refused():
    with LLM("fixture:tiny", max_new_tokens=3, dtype="float32", scheduler_config={"block_size": 16}) as llm:
        assert llm.config.scheduler_config.max_new_tokens == 3 and llm.config.scheduler_config.block_size == 16
        (out,) = llm.generate([[1, 2, 3]])
        assert len(out.token_ids) <= 3
    with pytest.raises(UsageError, match=r"no setting 'max_new_token'; allowed: .*max_new_tokens"):
        LLM(SINGLE, max_new_token=3)
    with pytest.raises(UsageError, match=r"scheduler_config.block_size"):
        LLM(SINGLE, block_size="big")
    cfg = InferenceConfig.from_yaml(SINGLE)
    assert LLM(cfg, world_size=1).config.parallel_config.moe_ep_size == 1  # derived sizes follow the overrides
    with pytest.raises(UsageError, match="takes an inference config YAML path"):
        LLM(42)


def test_every_config_key_names_one_section():
    """A bare override key is unambiguous: no key sits in two sections."""
    seen: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in seen, f"{f.name} is in {seen[f.name]} and {name}"
            seen[f.name] = name


def test_importing_the_package_does_not_load_the_library():
    code = "import sys, optimized.cli.main; assert 'optimized.llm' not in sys.modules; print(optimized.LLM.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "LLM", out.stderr[-2000:]


def test_enable_profiler_writes_the_calls_trace(tmp_path):
    with LLM(SINGLE, enable_profiler=True, output_path=str(tmp_path)) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert (tmp_path / "profile" / "rank0.json").stat().st_size > 0


def test_rank_before_the_first_call_is_the_launchers(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # nothing started yet: the launcher's word
    assert LLM("fixture:tiny").rank == 3
    monkeypatch.delenv("RANK")
    assert LLM("fixture:tiny").rank == 0
