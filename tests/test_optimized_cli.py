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

from equivalence.support.plans import planned_paths
from equivalence.support.cli_errors import run_error
from fixtures.checkpoints import checkpoint
from optimized.__main__ import main as cli_main
from optimized.path_plan import DP, MC2, TP
from reference.checkpoint import load_model
from reference.generate import greedy_generate, trim_at_eos
from reference.tokenizer import decode, encode, eos_token_ids, load_tokenizer

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
    assert (
        cli_main(["generate", "--config", SINGLE, "--max-new-tokens", "5", "--model-path", "fixture:tiny-dense"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    for i, text in enumerate(["The capital of France is", "1, 2, 3,"]):
        expected = reference_tokens(encode(tokenizer("tiny-dense"), text), 5, "tiny-dense")
        assert f"[{i}] generated ids: {ids_line(expected)}" in lines


def test_generate_under_torchrun_two_ranks_equals_reference():
    prompt = encode(tokenizer(), "1, 2, 3,")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "optimized",
            "generate",
            "--config",
            TP2,
            "--prompt-ids",
            ids_line(prompt),
            "--max-new-tokens",
            "6",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"generated ids: {ids_line(reference_tokens(prompt, 6))}" in lines
    assert sum(line.startswith("generated ids:") for line in lines) == 1, "only rank 0 prints"
    assert any(line.startswith("model: ") and "world_size 2" in line for line in lines)
    assert planned_paths(TP2).prefill == TP  # tiny_tp2: no SP prefill


def _torchrun_four_ranks_equals_reference(config: str, texts) -> list[str]:
    """`generate` on 4 ranks for `texts`: each request's greedy tokens are the reference's, printed once by rank 0;
    returns the output lines."""
    prompts = [encode(tokenizer(), t) for t in texts]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    args = [a for p in prompts for a in ("--prompt-ids", ids_line(p))]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "optimized",
            "generate",
            "--config",
            str(CONFIGS / config),
            *args,
            "--max-new-tokens",
            "6",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for i, p in enumerate(prompts):
        assert f"[{i}] generated ids: {ids_line(reference_tokens(p, 6))}" in lines, out.stdout
    assert sum(line.startswith("[0] generated ids:") for line in lines) == 1, "only rank 0 prints"
    return lines


def test_generate_attention_dp_under_torchrun_four_ranks_equals_reference():
    """tiny_attn2dp2_ep4 (attention TP 2 x DP 2, MoE EP 4): three prompts (padded to 4 with a dummy request)."""
    _torchrun_four_ranks_equals_reference("tiny_attn2dp2_ep4.yaml", ("1, 2, 3,", "Once upon a time", "Hello"))
    paths = planned_paths(CONFIGS / "tiny_attn2dp2_ep4.yaml")
    assert (paths.prefill, paths.decode) == (DP, DP), paths


def test_generate_mc2_decode_under_torchrun_four_ranks_equals_reference():
    """tiny_ep4_mc2 (the recipe's EP-only decode: moe_tp 1, MoE EP 4): two prompts of different lengths; the plan
    decodes through MC2 (its window: test_execution_plan.py)."""
    _torchrun_four_ranks_equals_reference("tiny_ep4_mc2.yaml", ("1, 2, 3,", "Once upon a time"))
    assert planned_paths(CONFIGS / "tiny_ep4_mc2.yaml").decode == MC2


# --------------------------------------------------------------------------------------------- errors


def test_missing_config_is_one_line_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "optimized", "generate", "--config", "no/such.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
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


def test_world_size_exported_without_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # matches the config, but no RANK / MASTER_*: not a torchrun job
    monkeypatch.delenv("RANK", raising=False)
    err = run_error(["generate", "--config", TP2, "--prompt-ids", "1,2"], capsys)
    assert "environment variable RANK is not set (WORLD_SIZE=2); start multi-process runs with torchrun" in err


def test_config_path_that_is_a_directory(capsys):
    err = run_error(["generate", "--config", str(CONFIGS)], capsys)
    assert f"config file {str(CONFIGS)!r} is a directory" in err and "not found" not in err


def test_config_with_a_duplicate_key_names_it_and_both_lines(tmp_path, capsys):
    config = tmp_path / "dup.yaml"
    config.write_text("scheduler_config:\n  max_new_tokens: 4\n  batch_size: 1\n  max_new_tokens: 8\n")
    err = run_error(["generate", "--config", str(config)], capsys)
    assert "duplicate key 'max_new_tokens' on line 2 and again on line 4" in err and str(config) in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,600"], "token id 600 is outside the vocabulary [0, 512)"),
        (["--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["--prompt-ids", "1,-3"], "token ids must be >= 0"),
        (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", "a", "--block-size", "24"], "must be a multiple of 16"),
        (["--prompt", "a", "--model-path", "fixture:nope"], "unknown fixture 'nope'"),
        (["--prompt", "a", "--model-path", "/nonexistent/dir"], "model_path '/nonexistent/dir' does not exist"),
        (["--prompt", "a", "--model-path", "preset:nope"], "unknown preset 'nope'"),
    ],
)
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
    assert "model_config.exe_mode: must be one of eager, ge_graph, acl_graph, npugraph_ex; got 'graph'" in err


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
    assert "117 tensors" in out and "convert w4a8" in err and "100%" in err  # summary line, progress bar
    assert "already quantized" in run_error(["convert", "--quant", "w4a8", str(dst), str(tmp_path / "x")], capsys)
    assert (
        cli_main(
            [
                "generate",
                "--config",
                SINGLE,
                "--model-path",
                str(dst),
                "--dtype",
                "bfloat16",
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    assert "generated ids:" in capsys.readouterr().out
    err = run_error(["generate", "--config", SINGLE, "--model-path", str(dst), "--dtype", "float32"], capsys)
    assert "W4A8 / W8A8 checkpoints run with bfloat16 or float16 activations" in err


def test_convert_w8a8_then_generate(tmp_path, capsys):
    """`convert --quant w8a8`: the same 117 tensors, the experts MXFP8 (float8_e4m3fn) like attention, and the
    model generates from it."""
    from safetensors import safe_open

    dst = tmp_path / "w8a8"
    assert cli_main(["convert", "--quant", "w8a8", "--no-progress", str(checkpoint("tiny")), str(dst)]) == 0
    assert "117 tensors" in capsys.readouterr().out
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        expert = f.get_slice("model.layers.0.mlp.experts.0.down_proj.weight")
        assert expert.get_dtype() == "F8_E4M3"
    assert (
        cli_main(
            [
                "generate",
                "--config",
                SINGLE,
                "--model-path",
                str(dst),
                "--dtype",
                "bfloat16",
                "--prompt",
                "Hi",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    assert "generated ids:" in capsys.readouterr().out


def test_convert_bad_quant_names_the_allowed_values(tmp_path, capsys):
    err = run_error(["convert", "--quant", "w2a2", str(checkpoint("tiny")), str(tmp_path / "x")], capsys)
    assert "--quant" in err and "'w2a2'" in err and "w4a8" in err and "w8a8" in err and "w4a4" in err, err
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------ read-only destinations


@pytest.fixture
def read_only(monkeypatch):
    """`read_only(path)`: a directory nothing can be written under. Mode 0o555, and where that does not stop this
    process (root), creating or opening for writing anything under it raises PermissionError as the kernel would."""
    import builtins
    import errno
    import io

    made = []

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        made.append(path)
        if os.access(path, os.W_OK):  # root: mode bits do not bind, simulate them

            def denied(target) -> bool:
                return isinstance(target, (str, os.PathLike)) and Path(os.path.abspath(target)).is_relative_to(path)

            def refuse(target):
                raise PermissionError(errno.EACCES, "Permission denied", str(target))

            real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

            def fake_open(file, mode="r", *args, **kwargs):
                return (
                    refuse(file) if denied(file) and set(mode) & set("wax+") else real_open(file, mode, *args, **kwargs)
                )

            def fake_os_open(file, flags, *args, **kwargs):
                writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                return refuse(file) if denied(file) and writes else real_os_open(file, flags, *args, **kwargs)

            monkeypatch.setattr(builtins, "open", fake_open)
            monkeypatch.setattr(io, "open", fake_open)
            monkeypatch.setattr(os, "open", fake_os_open)
            monkeypatch.setattr(os, "mkdir", lambda p, *a, **k: refuse(p) if denied(p) else real_mkdir(p, *a, **k))
        return path

    yield make
    for path in made:
        path.chmod(0o755)


def test_convert_to_a_read_only_destination(tmp_path, read_only, capsys):
    dst = read_only(tmp_path / "ro") / "w4a8"
    err = run_error(["convert", "--quant", "w4a8", "--no-progress", str(checkpoint("tiny")), str(dst)], capsys)
    assert f"cannot write the converted checkpoint to {dst}: Permission denied" in err


def test_save_logits_to_a_read_only_directory(tmp_path, read_only, capsys):
    target = read_only(tmp_path / "ro") / "logits.pt"
    err = run_error(
        ["generate", "--config", SINGLE, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--save-logits", str(target)],
        capsys,
    )
    assert f"--save-logits: cannot write {str(target)!r}: Permission denied" in err


def _graph_config(tmp_path: Path, monkeypatch) -> str:
    """A graph-mode config with the compile cache on (its MAC key under tmp_path, never the user's ~/.config)."""
    from optimized.executor.compile_cache import KEY_ENV

    monkeypatch.setenv(KEY_ENV, str(tmp_path / "compile_cache.key"))
    config = tmp_path / "graph.yaml"
    config.write_text("model_config: {model_path: 'fixture:tiny', exe_mode: ge_graph, enable_cache_compile: true}\n")
    return str(config)


def test_compile_cache_in_a_read_only_directory(tmp_path, read_only, capsys, monkeypatch):
    config = _graph_config(tmp_path, monkeypatch)
    monkeypatch.chdir(read_only(tmp_path / "ro"))
    err = run_error(["generate", "--config", config], capsys)
    assert f"cannot create the compile cache directory {tmp_path / 'ro' / 'compile_cache'} (Permission denied)" in err
    assert "enable_cache_compile: false" in err


def test_compile_cache_directory_open_to_others_is_refused(tmp_path, capsys, monkeypatch):
    config = _graph_config(tmp_path, monkeypatch)
    case = tmp_path / "compile_cache" / "shared_case"
    case.mkdir(parents=True)
    case.chmod(0o777)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CASE_NAME", "shared_case")
    err = run_error(["generate", "--config", config], capsys)
    assert f"the compile cache directory {case} has mode drwxrwxrwx (open to group or others)" in err


# ---------------------------------------------------------------------------------------------- bench


def test_bench_tiny_prints_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert (
        cli_main(
            [
                "bench",
                "--preset",
                "tiny",
                "--layers",
                "1",
                "--prompt-len",
                "8",
                "--decode-steps",
                "2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--dtype",
                "float32",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for needle in (
        "reference",
        "optimized",
        "HF transformers",
        "reference/optimized",
        "hf/optimized",
        "copy bandwidth",
        "floor:",
        "kernel ceiling: the lm_head GEMV alone",
    ):
        assert needle in out, needle
    report = json.loads(out_json.read_text())
    assert set(report["results"]) == {"reference", "optimized", "hf"}
    for r in report["results"].values():
        assert r["prefill_ms"]["median"] > 0 and len(r["decode_ms_per_token"]["samples"]) == 2
    assert report["ratios"]["reference/optimized"]["decode"] > 0
    assert report["tokens"] == {"optimized": "same", "hf": "same"}  # fp32, same weights
    fl = report["floor"]
    assert fl["copy_bandwidth_gb_s"] > 0 and fl["floor_ms_per_token"] > 0
    assert len(fl["copy_bandwidth_gb_s_per_round"]) == 1, "one bandwidth measurement per timed round"
    assert fl["copy_bandwidth_gb_s"] == fl["copy_bandwidth_gb_s_per_round"][0]
    # the floor at the GEMV's bandwidth is the same bytes over that bandwidth
    same_bytes = fl["floor_ms_per_token"] * fl["copy_bandwidth_gb_s"]
    assert abs(fl["floor_at_gemv_bandwidth_ms_per_token"] * fl["lm_head_gemv_gb_s"] - same_bytes) < 1e-6 * same_bytes


def test_bench_bad_arguments(capsys):
    assert "--layers must be >= 1" in run_error(["bench", "--preset", "tiny", "--layers", "0"], capsys)


def test_bench_memory_check_counts_the_packed_cpu_weights(capsys, monkeypatch):
    """On a CPU, bf16: the optimized model also holds oneDNN's packed copies (ops/cpu_gemm.py); memory for the two
    models but not for the packed copies is refused, naming them, before anything is built."""
    from optimized.benchmarks import bench
    from optimized.benchmarks.common import bench_config
    from optimized.benchmarks.reference_timing import reference_shapes
    from optimized.ops import cpu_gemm

    if not cpu_gemm.ONEDNN_BF16:
        pytest.skip("oneDNN bf16 is not available on this CPU")
    model_bytes = 2 * sum(t.numel() for t in reference_shapes(bench_config("qwen3_30b_a3b", 1)).values())
    monkeypatch.setattr(bench, "_available_memory", lambda: 2.5 * model_bytes)  # 2 models fit, 3 copies do not
    err = run_error(["bench", "--preset", "qwen3_30b_a3b", "--layers", "1", "--dtype", "bfloat16", "--skip-hf"], capsys)
    assert "packed CPU weights included" in err and "use fewer --layers" in err


def test_bench_kv_pool_and_context_sweeps(tmp_path, capsys):
    """--kv-pool-blocks sizes the optimized model's pool; --pool-sweep / --context-sweep print one row per point
    and model, and the JSON holds every sample."""
    out_json = tmp_path / "bench.json"
    assert (
        cli_main(
            [
                "bench",
                "--preset",
                "tiny",
                "--layers",
                "1",
                "--prompt-len",
                "8",
                "--decode-steps",
                "2",
                "--warmup",
                "0",
                "--repeats",
                "1",
                "--dtype",
                "float32",
                "--skip-hf",
                "--block-size",
                "16",
                "--kv-pool-blocks",
                "5",
                "--pool-sweep",
                "1,4",
                "--context-sweep",
                "8,40",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "decode vs KV pool size" in out and "decode vs context length" in out
    report = json.loads(out_json.read_text())
    pool, context = report["sweeps"]["pool"], report["sweeps"]["context"]
    assert [(r["value"], r["pool_blocks"]) for r in pool] == [(1, 2), (4, 8)]  # 8 + 3 tokens: one block of 16 + null
    assert [(r["value"], r["pool_blocks"]) for r in context] == [(8, 2), (40, 4)]
    assert context[1]["kv_bytes"] > context[0]["kv_bytes"]
    for r in pool + context:
        assert r["model"] == "optimized" and len(r["decode_ms_per_token"]["samples"]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-pool-blocks", "1"], "--kv-pool-blocks must be >= 2"),
        (["--kv-pool-blocks", "2", "--batch", "2"], "--kv-pool-blocks 2 is too small"),
        (["--pool-sweep", "1,0"], "--pool-sweep takes comma-separated integers >= 1"),
        (["--context-sweep", "8,x"], "--context-sweep takes comma-separated integers >= 1"),
        (["--context-sweep", "100000"], "--context-sweep 100000 + --decode-steps exceed max_position_embeddings"),
    ],
)
def test_bench_pool_and_context_flags_reject_bad_values_naming_the_flag(argv, message, capsys):
    base = ["bench", "--preset", "tiny", "--layers", "1", "--prompt-len", "8", "--decode-steps", "2", "--skip-hf"]
    if "sweep takes" in message:  # argparse rejects the value itself (exit status 2, message on stderr)
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
    argv = [
        "generate",
        "--config",
        SINGLE,
        "--prompt",
        "hi",
        "--chat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--seed",
        "1",
    ]
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


# -------------------------------------------------------------------------------------------- latency


def test_latency_npu_budget_on_another_host_names_the_hardware(capsys):
    from optimized.benchmarks.budgets import this_host

    if this_host().backend == "npu":
        pytest.skip("this host has NPUs: the budget's hardware rule decides, not this test")
    err = run_error(["latency", "--budget", "a3_235b_bf16_decode", "--json", "unused.json"], capsys)
    assert (
        "budget a3_235b_bf16_decode needs Atlas A3 (8 cards, 16 dies): 16 NPU devices with SoC name matching "
        "'Ascend910_93*' (torch_npu); this host: backend"
    ) in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("budgets:\n  a: [\n", "while parsing a flow node"),
        ("budgets:\n  a: {}\n  a: {}\n", "duplicate key 'a' on line 2 and again on line 3"),
    ],
)
def test_latency_budgets_file_that_is_not_valid_yaml(tmp_path, capsys, text, message):
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(text)
    err = run_error(["latency", "--budget", "a", "--budgets", str(budgets), "--json", "unused.json"], capsys)
    assert f"{budgets}: not valid YAML: {message}" in err
