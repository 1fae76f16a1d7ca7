"""NPU bring-up in one command (`bash ci/npu_bringup.sh`): the NPU checks, smallest first, stopping at the first failure
with its evidence, and one text + JSON report to paste into an issue.

Each step is a pytest selection with what it needs from the host (an NPU, an Ascend 950 for the MX kernels, a number
of NPUs). A step whose need the host does not meet is skipped for that declared reason, before anything runs; so on a
host without an NPU (or with `--dry-run`) every step is reported skipped, and the report says why. Where the test a
step should run does not exist yet, the step runs the nearest existing NPU tests and its `note` says so.

    python -m equivalence.npu.bringup [--out DIR] [--dry-run] [--keep-going]
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE_LINES = 80  # the failing step's output tail kept in the report


def pytest_run(*args: str) -> tuple[str, ...]:
    """A pytest run in this process's Python (one process: -n 0), stopping at its first failure."""
    return ("-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-x", *args)


def bench_run(prompt_len: int) -> tuple[str, ...]:
    """One-layer qwen3_30b_a3b shapes, eager vs ge_graph decode after a `prompt_len`-token prefill."""
    return (
        "-m",
        "optimized",
        "bench",
        "--preset",
        "qwen3_30b_a3b",
        "--layers",
        "1",
        "--prompt-len",
        str(prompt_len),
        "--decode-steps",
        "4",
        "--repeats",
        "1",
        "--skip-hf",
        "--exe-mode",
        "ge_graph",
    )


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    runs: tuple[tuple[str, ...], ...]  # each the arguments after `python`, run in order, the first failure ends it
    needs_950: bool = False  # MX (FP4 / FP8) kernels: Ascend 950 only
    npus: int = 1  # NPUs the step needs
    note: str = ""  # where the step stands in for a test that does not exist yet

    def commands(self, python: str) -> list[list[str]]:
        return [[python, *run] for run in self.runs]


REPLAY = "equivalence/npu/test_npu_replay.py"
STEPS = (
    Step(
        "operator-replay",
        "every per-operator NPU test and every recorded single-process call on torch_npu vs the portable kernel",
        (pytest_run("-m", "npu", "equivalence/ops", REPLAY, "-k", "not mc2 and not optimized_model"),),
    ),
    Step(
        "layer-per-precision",
        "the optimized model on the NPU vs the reference on the CPU, per precision",
        (pytest_run("-m", "npu", REPLAY, "-k", "optimized_model_on_the_npu"),),
        note="no one-layer NPU test per precision exists yet: runs the whole tiny model (bf16; W4A8 on a 950)",
    ),
    Step(
        "ge-graph-decode",
        "ge_graph decode (torchair) beside eager after a 64- and a 1000-token prompt: two KV lengths",
        (bench_run(64), bench_run(1000)),
        note="no NPU-marked ge_graph test exists yet: `bench` compiles and runs the decode graph and prints its "
        "token agreement with eager (read the 'graph mode' lines of the output); it fails only on an error",
    ),
    Step(
        "w4a4-batch1-decode",
        "the FP4 x FP4 matmul calls of a batch-1 W4A4 decode (tp1-w4a4-batch1: the single row duplicated)",
        (pytest_run("-m", "npu", REPLAY, "-k", "npu_quant_matmul or npu_dynamic_mx_quant"),),
        needs_950=True,
        note="no whole W4A4 decode runs on the NPU yet: replays its recorded MX quantize and matmul calls",
    ),
    Step(
        "w4a8-nz-grouped-matmul",
        "the W4A8 grouped matmul on NZ-cast FP4 expert weights, and the NZ cast itself",
        (
            pytest_run(
                "-m", "npu", REPLAY, "equivalence/ops/test_ops_gmm.py", "-k", "grouped_matmul or format_cast or gmm"
            ),
        ),
        needs_950=True,
    ),
    Step(
        "sampler-vs-cpu",
        "the engine's sampler draws on the NPU against the CPU's, bitwise",
        (pytest_run("equivalence/serving/test_engine_sampling.py"),),
        note="no NPU-vs-CPU draw test exists yet: runs the sampling equivalence tests on this host's device",
    ),
    Step(
        "mc2-replay-2-ranks",
        "the recorded MC2 dispatch / combine as a 2-rank hccl job",
        (pytest_run("-m", "npu", REPLAY, "-k", "mc2 and sp2"),),
        npus=2,
    ),
    Step("latency", "the latency budgets (optimized/benchmarks/budgets.yaml)", (pytest_run("-m", "latency"),)),
)


@dataclass
class Host:
    backend: str
    soc: str
    npus: int
    torch: str
    torch_npu: str
    python: str
    machine: str
    commit: str

    @property
    def is_950(self) -> bool:
        return "950" in self.soc


@dataclass
class Result:
    name: str
    what: str
    status: str  # passed | failed | skipped | not run
    reason: str = ""
    note: str = ""
    command: str = ""
    seconds: float = 0.0
    evidence: list[str] = field(default_factory=list)


def probe_host() -> Host:
    """This host as the steps see it (torch_npu imported only through optimized.platform)."""
    import torch

    from optimized.platform import backend_name

    backend = backend_name()
    soc, npus, npu_version = "", 0, ""
    if backend == "npu":  # pragma: no cover - needs torch_npu
        import torch_npu

        soc, npus, npu_version = torch.npu.get_device_name(0), torch.npu.device_count(), torch_npu.__version__
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return Host(
        backend,
        soc,
        npus,
        torch.__version__,
        npu_version,
        sys.version.split()[0],
        host_platform.machine(),
        commit,
    )


def skip_reason(step: Step, host: Host, dry_run: bool) -> str:
    """Why `step` cannot run on `host` ('' when it can): the first need the host does not meet."""
    if dry_run:
        return "dry run: nothing executed"
    if host.backend != "npu":
        return f"no NPU: this host computes on {host.backend} (torch_npu absent or no device visible)"
    if step.needs_950 and not host.is_950:
        return f"needs an Ascend 950 (MX kernels); this NPU is {host.soc or 'unnamed'}"
    if host.npus < step.npus:
        return f"needs {step.npus} NPUs; {host.npus} visible"
    return ""


def run_step(step: Step, python: str) -> tuple[int, str, float]:
    """Run the step's commands in order until one fails -> (its exit code, the output of all, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    start, output, code = time.monotonic(), [], 0
    for command in step.commands(python):
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output.append(f"$ {shlex.join(command)}\n{proc.stdout}")
        code = proc.returncode
        if code != 0:
            break
    return code, "".join(output), time.monotonic() - start


def bring_up(host: Host, *, dry_run: bool = False, keep_going: bool = False, runner=run_step, python=None):
    """Run the steps in order; after the first failure the rest are 'not run' (unless keep_going)."""
    python = python or sys.executable
    results, failed = [], None
    for step in STEPS:
        command = " && ".join(shlex.join(c) for c in step.commands("python"))
        r = Result(step.name, step.what, "", note=step.note, command=command)
        reason = skip_reason(step, host, dry_run)
        if failed is not None and not keep_going:
            r.status, r.reason = "not run", f"stopped after {failed} failed"
        elif reason:
            r.status, r.reason = "skipped", reason
        else:
            code, output, r.seconds = runner(step, python)
            r.status = "passed" if code == 0 else "failed"
            if code != 0:  # pytest's 5: nothing selected (the step's tests are missing from this checkout)
                r.reason = f"exit code {code}" + (" (pytest: no test selected)" if code == 5 else "")
                r.evidence = output.splitlines()[-EVIDENCE_LINES:]
                failed = failed or step.name
        results.append(r)
    return results


def verdict(results: list[Result]) -> str:
    statuses = {r.status for r in results}
    if "failed" in statuses:
        return "FAILED: " + next(r.name for r in results if r.status == "failed")
    if statuses == {"passed"}:
        return "PASSED: every step"
    ran = sum(r.status == "passed" for r in results)
    return f"INCOMPLETE: {ran} of {len(results)} steps ran and passed; the others were skipped (reasons below)"


def text_report(host: Host, results: list[Result]) -> str:
    lines = [
        "NPU bring-up report (bash ci/npu_bringup.sh)",
        f"verdict: {verdict(results)}",
        f"host: backend {host.backend}, SoC {host.soc or '-'}, {host.npus} NPU(s), torch {host.torch}, "
        f"torch_npu {host.torch_npu or '-'}, Python {host.python}, {host.machine}, commit {host.commit or '-'}",
        "",
    ]
    for i, r in enumerate(results, 1):
        took = f" ({r.seconds:.0f} s)" if r.seconds else ""
        lines.append(f"{i}. {r.name}: {r.status}{took}{' - ' + r.reason if r.reason else ''}")
        lines.append(f"   {r.what}")
        if r.note:
            lines.append(f"   note: {r.note}")
        lines.append(f"   $ {r.command}")
        if r.evidence:
            lines.append("   evidence (output tail):")
            lines.extend(f"   | {line}" for line in r.evidence)
    return "\n".join(lines) + "\n"


def write_report(out: Path, host: Host, results: list[Result]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    txt, js = out / "npu_bringup.txt", out / "npu_bringup.json"
    txt.write_text(text_report(host, results))
    payload = {"verdict": verdict(results), "host": asdict(host), "steps": [asdict(r) for r in results]}
    js.write_text(json.dumps(payload, indent=1) + "\n")
    return txt, js


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/npu_bringup.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="npu_bringup", help="report directory (default ./npu_bringup)")
    parser.add_argument("--dry-run", action="store_true", help="run nothing; report each step skipped")
    parser.add_argument("--keep-going", action="store_true", help="run every step even after a failure")
    args = parser.parse_args(argv)
    host = probe_host()
    results = bring_up(host, dry_run=args.dry_run, keep_going=args.keep_going)
    txt, js = write_report(Path(args.out), host, results)
    print(txt.read_text(), end="")
    print(f"report: {txt} and {js}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
