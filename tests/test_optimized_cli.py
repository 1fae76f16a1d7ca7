"""`python -m optimized generate | bench | convert`: the optimized CLI prints what the reference computes
(single process and under torchrun), and user errors are one line on stderr with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.checkpoints import checkpoint
from reference.tokenizer import decode, encode, eos_token_ids, load_tokenizer
from optimized.__main__ import main as cli_main
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "fixtures" / "configs"
SINGLE, TP2 = str(CONFIGS / "tiny_single.yaml"), str(CONFIGS / "tiny_tp2.yaml")


def reference_tokens(prompt: list[int], n: int, name: str = "tiny") -> list[int]:
    """The reference's greedy tokens, ending at the checkpoint's first EOS id (as the CLI stops there)."""
    tokens = greedy_generate(load_model(checkpoint(name)), torch.tensor([prompt]), n)[0].tolist()
    return trim_at_eos(tokens, eos_token_ids(checkpoint(name)))


def tokenizer(name: str = "tiny"):
    return load_tokenizer(checkpoint(name))


def ids_line(ids) -> str:
    return ",".join(map(str, ids))


def run_error(argv, capsys) -> str:
    """Run the CLI in-process, expect exit status 2; return stderr (asserted to be one line)."""
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m optimized: error: "), err
    return err


# ------------------------------------------------------------------------------------------- generate

def test_generate_single_process_equals_reference(capsys):
    tok = tokenizer()
    prompt = encode(tok, "hello")
    assert cli_main(["generate", "--config", SINGLE, "--prompt", "hello", "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = reference_tokens(prompt, 6)
    assert f"prompt ids: {ids_line(prompt)}" in lines
    assert f"generated ids: {ids_line(expected)}" in lines
    assert f"text: {decode(tok, prompt + expected)!r}" in lines
    assert f"completion: {decode(tok, expected)!r}" in lines
    assert any(line.startswith("prefill: ") and " ms " in line for line in lines)
    assert any(line.startswith("decode: ") and "ms/token" in line for line in lines)


def test_generate_batch_from_config_prompts_equals_reference(capsys):
    """No --prompt: the config's prompts (2 requests, fp32, max_new_tokens 8); ids given as --prompt-ids too."""
    assert cli_main(["generate", "--config", SINGLE, "--max-new-tokens", "5", "--model-path", "fixture:tiny-dense"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for i, text in enumerate(["The capital of France is", "1, 2, 3,"]):
        expected = reference_tokens(encode(tokenizer("tiny-dense"), text), 5, "tiny-dense")
        assert f"[{i}] generated ids: {ids_line(expected)}" in lines


def test_generate_under_torchrun_two_ranks_equals_reference():
    prompt = encode(tokenizer(), "1, 2, 3,")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "optimized", "generate", "--config", TP2, "--prompt-ids", ids_line(prompt),
                          "--max-new-tokens", "6"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"generated ids: {ids_line(reference_tokens(prompt, 6))}" in lines
    assert sum(line.startswith("generated ids:") for line in lines) == 1, "only rank 0 prints"
    assert any(line.startswith("model: ") and "world_size 2" in line for line in lines)
    assert any(line.startswith("prefill path: tensor parallel") for line in lines)   # tiny_tp2: no SP prefill


# --------------------------------------------------------------------------------------------- errors

def test_missing_config_is_one_line_without_traceback():
    out = subprocess.run([sys.executable, "-m", "optimized", "generate", "--config", "no/such.yaml"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "python -m optimized: error: config file 'no/such.yaml' not found\n"
    assert out.stdout == ""


def test_world_size_mismatch_single_process(capsys):
    err = run_error(["generate", "--config", TP2], capsys)
    assert "parallel_config.world_size is 2" in err and "single process" in err and "torchrun" in err


def test_world_size_mismatch_with_launcher(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    err = run_error(["generate", "--config", TP2], capsys)
    assert "parallel_config.world_size is 2" in err and "WORLD_SIZE=4" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,600"], "token id 600 is outside the vocabulary [0, 512)"),
    (["--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["--prompt-ids", "1,-3"], "token ids must be >= 0"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "a", "--block-size", "24"], "must be a multiple of 16"),
    (["--prompt", "a", "--model-path", "fixture:nope"], "unknown fixture 'nope'"),
    (["--prompt", "a", "--model-path", "/nonexistent/dir"], "model_path '/nonexistent/dir' does not exist"),
    (["--prompt", "a", "--model-path", "preset:nope"], "unknown preset 'nope'"),
])
def test_bad_input_exits_2_naming_the_problem(args, message, capsys):
    assert message in run_error(["generate", "--config", SINGLE, *args], capsys)


def test_bad_config_contents_and_graph_mode(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config:\n  dtype: float16\n  bogus: 1\n")
    err = run_error(["generate", "--config", str(bad)], capsys)
    assert "model_config.dtype" in err and "model_config.bogus: unknown key" in err
    graph = tmp_path / "graph.yaml"
    graph.write_text("model_config:\n  model_path: fixture:tiny\n  exe_mode: graph\n")
    err = run_error(["generate", "--config", str(graph)], capsys)
    assert "model_config.exe_mode: must be one of eager, ge_graph, acl_graph; got 'graph'" in err


def test_graph_config_with_a_bad_case_name_is_a_usage_error(monkeypatch, capsys):
    """The graph-mode example config is accepted; CASE_NAME must be a plain directory name."""
    monkeypatch.setenv("CASE_NAME", "../elsewhere")
    graph = str(CONFIGS / "tiny_tp2_ep2_graph.yaml")
    err = run_error(["generate", "--config", graph], capsys)
    assert "CASE_NAME '../elsewhere' must be a plain directory name" in err


def test_preset_model_path_writes_config(tmp_path, monkeypatch):
    from transformers import Qwen3MoeConfig

    from optimized.model_loader.model_path import preset_dir
    monkeypatch.setenv("QWEN3_MOE_FIXTURE_CACHE", str(tmp_path / "fixtures"))
    path = preset_dir("qwen3_30b_a3b")
    config = Qwen3MoeConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_experts, config.num_hidden_layers) == (2048, 128, 48)
    assert preset_dir("Qwen3-30B-A3B") == path


def test_convert_needs_quant_src_and_dst(capsys):
    assert "--quant" in run_error(["convert", "a", "b"], capsys)


def test_convert_w4a8_then_generate_and_refuse_reconversion(tmp_path, capsys):
    dst = tmp_path / "w4a8"
    assert cli_main(["convert", "--quant", "w4a8", str(checkpoint("tiny")), str(dst)]) == 0
    out, err = capsys.readouterr()
    assert "117 tensors" in out and "convert w4a8" in err and "100%" in err   # summary line, progress bar
    assert "already quantized" in run_error(["convert", "--quant", "w4a8", str(dst), str(tmp_path / "x")], capsys)
    assert cli_main(["generate", "--config", SINGLE, "--model-path", str(dst), "--dtype", "bfloat16",
                     "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    assert "generated ids:" in capsys.readouterr().out
    err = run_error(["generate", "--config", SINGLE, "--model-path", str(dst), "--dtype", "float32"], capsys)
    assert "W4A8 checkpoints run with bfloat16 or float16 activations" in err


# ---------------------------------------------------------------------------------------------- bench

def test_bench_tiny_prints_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli_main(["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "8", "--decode-steps", "2",
                     "--warmup", "0", "--repeats", "1", "--dtype", "float32", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for needle in ("reference", "optimized", "HF transformers", "reference/optimized", "hf/optimized",
                   "copy bandwidth", "floor:"):
        assert needle in out, needle
    report = json.loads(out_json.read_text())
    assert set(report["results"]) == {"reference", "optimized", "hf"}
    for r in report["results"].values():
        assert r["prefill_ms"]["median"] > 0 and len(r["decode_ms_per_token"]["samples"]) == 2
    assert report["ratios"]["reference/optimized"]["decode"] > 0
    assert report["tokens"] == {"optimized": "same", "hf": "same"}  # fp32, same weights
    assert report["floor"]["copy_bandwidth_gb_s"] > 0 and report["floor"]["floor_ms_per_token"] > 0


def test_bench_bad_arguments(capsys):
    assert "--layers must be >= 1" in run_error(["bench", "--preset", "tiny", "--layers", "0"], capsys)


def test_bench_kv_pool_and_context_sweeps(tmp_path, capsys):
    """--kv-pool-blocks sizes the optimized model's pool; --pool-sweep / --context-sweep print one row per point
    and model, and the JSON holds every sample."""
    out_json = tmp_path / "bench.json"
    assert cli_main(["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "8", "--decode-steps", "2",
                     "--warmup", "0", "--repeats", "1", "--dtype", "float32", "--skip-hf", "--block-size", "16", "--kv-pool-blocks", "5",
                     "--pool-sweep", "1,4", "--context-sweep", "8,40", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "decode vs KV pool size" in out and "decode vs context length" in out
    report = json.loads(out_json.read_text())
    pool, context = report["sweeps"]["pool"], report["sweeps"]["context"]
    assert [(r["value"], r["pool_blocks"]) for r in pool] == [(1, 2), (4, 8)]   # 8 + 3 tokens: one block of 16 + null
    assert [(r["value"], r["pool_blocks"]) for r in context] == [(8, 2), (40, 4)]
    assert context[1]["kv_bytes"] > context[0]["kv_bytes"]
    for r in pool + context:
        assert r["model"] == "optimized" and len(r["decode_ms_per_token"]["samples"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--kv-pool-blocks", "1"], "--kv-pool-blocks must be >= 2"),
    (["--kv-pool-blocks", "2", "--batch", "2"], "--kv-pool-blocks 2 is too small"),
    (["--pool-sweep", "1,0"], "--pool-sweep takes comma-separated integers >= 1"),
    (["--context-sweep", "8,x"], "--context-sweep takes comma-separated integers >= 1"),
    (["--context-sweep", "100000"], "--context-sweep 100000 + --decode-steps exceed max_position_embeddings"),
])
def test_bench_pool_and_context_flags_reject_bad_values_naming_the_flag(argv, message, capsys):
    base = ["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "8", "--decode-steps", "2", "--skip-hf"]
    if "sweep takes" in message:   # argparse rejects the value itself (exit status 2, message on stderr)
        with pytest.raises(SystemExit):
            cli_main(base + argv)
        assert message in capsys.readouterr().err
    else:
        assert message in run_error(base + argv, capsys)


def test_prompt_longer_than_input_max_len_is_an_error_not_truncated(capsys):
    err = run_error(["generate", "--config", SINGLE, "--prompt-ids", ",".join(["7"] * 65)], capsys)
    assert "prompt 0 has 65 tokens, more than data_config.input_max_len=64" in err


def test_chat_sampling_eos_and_saved_logits(tmp_path, capsys):
    """--chat through the template, seeded sampling (same seed, same output), EOS reported, logits saved."""
    tok = tokenizer()
    argv = ["generate", "--config", SINGLE, "--prompt", "hi", "--chat", "--max-new-tokens", "12",
            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", "1"]
    outs = []
    for i in range(2):
        assert cli_main(argv + ["--save-logits", str(tmp_path / f"logits{i}.pt")]) == 0
        lines = capsys.readouterr().out.splitlines()
        outs.append([line for line in lines if not line.startswith(("prefill", "decode"))])  # timings vary
    assert outs[0] == outs[1]
    chat = encode(tok, "hi", "chat")
    assert f"prompt ids: {ids_line(chat)}" in outs[0]
    generated = [int(i) for i in next(x for x in outs[0] if x.startswith("generated ids: "))[15:].split(",")]
    finish = "eos" if generated[-1] in eos_token_ids(checkpoint("tiny")) else "length"
    assert f"finish: {finish}" in outs[0] and (finish == "eos" or len(generated) == 12)
    assert f"completion: {decode(tok, generated)!r}" in outs[0]
    saved = torch.load(tmp_path / "logits0.pt")
    assert saved["tokens"] == [generated] and saved["prompts"] == [chat]
    assert saved["prompt_logits"][0].shape == (len(chat), 512) and saved["logits"][0].shape == (len(generated), 512)
