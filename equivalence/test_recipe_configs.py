"""The recipe's own Qwen3-MoE configs (fixtures/recipe_configs.py: the keys of its eight YAML files) run through
`torchrun -m optimized generate` as the recipe means them, pointed at a tiny fixture with the world size scaled to 4
or 8 (the recipe's ratios kept), and give the reference's greedy tokens (fp32; the W4A8 file: the fake-quant
reference's, within the W4A8 table entry). The files this build cannot run as the recipe means them are refused at
start-up with an error naming the key and why, never run as another layout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from equivalence.compare import token_agreement, tolerance
from fixtures.checkpoints import checkpoint, w4a8_checkpoint
from fixtures.recipe_configs import scaled
from reference.checkpoint import load_model
from reference.fake_quant import load_fake_quant_model
from reference.generate import greedy_generate, trim_at_eos
from reference.tokenizer import eos_token_ids

pytestmark = [pytest.mark.equivalence, pytest.mark.distributed]

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 4
CONTEXTS = {"narrativeqa.jsonl": ["The fox ran over the hill and the hill was green.", "Rain fell on the old town."],
            "data/qasper.jsonl": ["A model reads tokens and writes tokens."]}


@pytest.fixture(scope="module")
def longbench(tmp_path_factory) -> str:
    """A local LongBench-format directory (one subset at the top, one under data/, as the released archive has)."""
    root = tmp_path_factory.mktemp("longbench")
    for name, contexts in CONTEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("".join(json.dumps({"context": c, "input": "", "answers": []}) + "\n"
                                         for c in contexts))
    return str(root)


def _generate(config: dict, world: int, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # Graph-mode files compile on every rank: in-process (no inductor compile-worker pool per rank; 4-8 ranks share
    # two cores here). One 16tp run under full-suite load aborted at exit with "terminate called without an active
    # exception" after its generation; not reproduced alone (noted in the issue).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), "-m", "optimized", "generate", "--config", str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _requests(stdout: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, generated ids) of every request rank 0 printed."""
    lines = stdout.splitlines()
    prompts = [ln.split("prompt ids: ")[1] for ln in lines if "prompt ids: " in ln]
    generated = [ln.split("generated ids: ")[1] for ln in lines if "generated ids: " in ln]
    assert prompts and len(prompts) == len(generated), stdout
    ids = lambda s: [int(t) for t in s.split(",") if t]   # noqa: E731
    return [(ids(p), ids(g)) for p, g in zip(prompts, generated)]


# name: (world size, fixture, what the start-up lines must say about the layout the file means)
RUNS = {
    "qwen3_235b_16tp": (4, "tiny", "prefill path: tensor parallel"),                     # TP 4, graph decode
    "qwen3_235b_1tp_16ep": (4, "tiny", "prefill path: attention data parallel (4 DP groups"),
    "qwen3_235b_attn4tp8dp": (8, "tiny", "prefill path: attention data parallel (8 DP groups"),
    "qwen3_moe_pd_prefill": (4, "tiny-dense", "prefill path: tensor parallel"),
    # graph-mode decode under attention DP (DP + MC2 in ge_graph, as the recipe runs them)
    "qwen3_235b_128ep": (4, "tiny", "prefill path: attention data parallel (4 DP groups"),
    "qwen3_moe_pd_decode": (4, "tiny", "prefill path: attention data parallel (4 DP groups"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_config_gives_the_reference_greedy_tokens(name, longbench, tmp_path):
    world, fixture, layout_line = RUNS[name]
    config = scaled(name, world, f"fixture:{fixture}", max_new_tokens=NEW_TOKENS, dataset_path=longbench)
    out = _generate(config, world, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(line.startswith(layout_line) for line in out.stdout.splitlines()), out.stdout
    ref = load_model(checkpoint(fixture))
    eos = eos_token_ids(checkpoint(fixture))
    requests = _requests(out.stdout)
    expected_batch = config.get("scheduler_config", {}).get("batch_size") or config["data_config"]["batch_size"]
    assert len(requests) == expected_batch, out.stdout
    for prompt, generated in requests:
        want = trim_at_eos(greedy_generate(ref, torch.tensor([prompt]), NEW_TOKENS)[0].tolist(), eos)
        assert generated == want, (name, prompt, generated, want)


def test_recipe_mxfp48_config_runs_w4a8_within_the_fake_quant_reference(longbench, tmp_path):
    """qwen3_235b_mxfp48_opt (its model a MXFP4-expert / MXFP8 checkpoint; here the tiny fixture converted by
    `convert --quant w4a8`), bf16 as W4A8 runs: greedy agreement with the fake-quant reference's own greedy run at
    least the table's `model.w4a8.bfloat16` min_greedy."""
    path = w4a8_checkpoint("tiny")
    config = scaled("qwen3_235b_mxfp48_opt", 4, str(path), max_new_tokens=NEW_TOKENS, dataset_path=longbench,
                    dtype="bfloat16")
    out = _generate(config, 4, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    ref = load_fake_quant_model(checkpoint("tiny"), torch.bfloat16, router_dtype="float32")
    for prompt, generated in _requests(out.stdout):
        want = greedy_generate(ref, torch.tensor([prompt]), NEW_TOKENS)[0][:len(generated)]
        got = torch.tensor(generated)
        assert token_agreement(got[None], want[None]) >= tolerance("model.w4a8.bfloat16").min_greedy, (got, want)


@pytest.mark.parametrize("name, key, why", [
    ("qwen3_235b_mxfp4_hadamard", "model_config.enable_hadamard", "Hadamard-rotated checkpoints are not implemented"),
])
def test_recipe_config_this_build_cannot_run_is_refused_naming_the_key(name, key, why, longbench, tmp_path):
    """Refused before any process group exists (one line, exit 2), not run as another layout."""
    config = scaled(name, 4, "fixture:tiny", max_new_tokens=NEW_TOKENS, dataset_path=longbench)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "optimized", "generate", "--config", str(path)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and key in out.stderr and why in out.stderr, out.stderr
