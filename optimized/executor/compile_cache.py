"""Compile cache: compiled decode graphs kept under `compile_cache/<CASE_NAME>/` between runs.

Layout (as the recipe: `compile_cache/$CASE_NAME` next to the run's working directory):

    compile_cache/<CASE_NAME>/<key hash>/key.json        the full key, the artefact's size and sha256
    compile_cache/<CASE_NAME>/<key hash>/artifacts.bin   torch.compiler.save_cache_artifacts() bytes
    compile_cache/<CASE_NAME>/<key hash>/inductor/       inductor's cache while this graph compiles

One entry per compiled graph. The key (`cache_key`) holds everything a compiled decode graph depends on:
the model config, parallel layout and this rank, dtype, batch bucket, KV block size, KV cache dtype, exe_mode,
backend, and the torch / torch_npu / Python versions; a changed key is another directory, so a stale artefact is
never loaded. On CPU / CUDA an entry is inductor's cache (FX graph + AOTAutograd entries, the compiled
kernels) as `torch.compiler.save_cache_artifacts` serializes it; loading it hot-loads inductor's cache, so
the next compile skips code generation (dynamo still traces the step). The artefacts hold generated
source, not the compiled C++ kernels, so each entry also keeps inductor's own cache directory (where the
kernels' shared objects live): a restart on the same machine then skips the C++ compiler too, while the
artefact file alone still spares code generation on another machine. On NPU
torchair's `cache_compile` manages its own files under the same case directory (`platform.graph_compiler`).

An entry that cannot be read (missing or garbled key.json, wrong key, artefact size or checksum differing
from key.json, bytes torch cannot deserialize) is discarded with a `CompileCacheWarning` and the graph is
compiled fresh, then saved again. Entries are written artefact first, key.json last, each through a
temporary file and an atomic rename, so a crash mid-write leaves an entry that is discarded, not loaded.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE_ROOT = "compile_cache"
KEY_FILE, ARTIFACT_FILE = "key.json", "artifacts.bin"
_CASE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CompileCacheWarning(UserWarning):
    """A compile-cache entry was unusable and is being replaced by a fresh compile."""


def torch_npu_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("torch_npu")
    except PackageNotFoundError:
        return None


def cache_key(model, *, batch_bucket: int, block_size: int, exe_mode: str, kv_cache_dtype: torch.dtype) -> dict:
    """Everything a compiled decode graph of `model` depends on (JSON-able). kv_cache_dtype: the cache the graph
    reads and writes (a float8_e4m3fn cache adds the quantizing write and the scale caches to the graph)."""
    from optimized import platform

    parallel = model.groups.parallel
    return {
        "model_config": json.loads(model.config.to_json_string(use_diff=False)),
        "parallel_layout": {k: getattr(parallel, k) for k in sorted(vars(parallel))},
        "rank": model.groups.rank,
        "dtype": str(model.dtype).removeprefix("torch."),
        "batch_bucket": batch_bucket,
        "block_size": block_size,
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "exe_mode": exe_mode,
        "backend": platform.backend_name(),
        "torch": torch.__version__,
        "torch_npu": torch_npu_version(),
        "python": sys.version.split()[0],
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def check_case_name(name: str) -> str:
    if not _CASE_NAME_RE.match(name) or ".." in name:
        raise ValueError(f"CASE_NAME {name!r} must be a plain directory name (letters, digits, '.', '_', '-'; "
                         f"no '/' or '..')")
    return name


def default_case_name(model_name: str, dtype: str, parallel, exe_mode: str) -> str:
    """A case name derived from the config: model, dtype, layout and mode, e.g. tiny-float32-w2a2t1e2v1l2-ge_graph."""
    p = parallel
    layout = (f"w{p.world_size}a{p.attn_tp_size}t{p.moe_tp_size}e{p.moe_ep_size}"
              f"v{p.embed_tp_size}l{p.lmhead_tp_size}")
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_name.rstrip("/")).name or "model").lstrip("._-") or "model"
    return f"{model}-{dtype}-{layout}-{exe_mode}"


def case_dir(case_name: str, workdir: str | os.PathLike | None = None) -> Path:
    """`<workdir or cwd>/compile_cache/<case_name>`."""
    return Path(workdir or os.getcwd()) / CACHE_ROOT / check_case_name(case_name)


@dataclass
class CompileCache:
    """The entries of one case directory."""

    root: Path

    def __post_init__(self):
        self.root = Path(self.root)

    def entry(self, key: dict) -> "CacheEntry":
        return CacheEntry(self.root / key_hash(key), key)


@dataclass
class CacheEntry:
    path: Path
    key: dict

    @contextlib.contextmanager
    def inductor_cache(self):
        """Inductor's cache directory is this entry's `inductor/` inside the block."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        (self.path / "inductor").mkdir(parents=True, exist_ok=True)
        with temporary_cache_dir(str(self.path / "inductor")):
            yield

    def load(self) -> bool:
        """Hot-load the entry's artefacts into torch's compile caches. False when there is no usable entry
        (an unusable one is discarded with a CompileCacheWarning)."""
        if not (self.path / KEY_FILE).exists() and not (self.path / ARTIFACT_FILE).exists():
            return False
        try:
            manifest = json.loads((self.path / KEY_FILE).read_text())
            if manifest.get("key") != self.key:
                raise ValueError("its key.json holds another key")
            data = (self.path / ARTIFACT_FILE).read_bytes()
            if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
                raise ValueError(f"{ARTIFACT_FILE} has {len(data)} bytes / a checksum that differ from key.json "
                                 f"({manifest['bytes']} bytes): truncated or corrupt")
            if torch.compiler.load_cache_artifacts(data) is None:
                raise ValueError("torch could not deserialize the artefacts")
        except Exception as e:  # any unreadable entry: drop it and compile fresh
            self.discard(f"{type(e).__name__}: {e}")
            return False
        return True

    def save(self, artifacts) -> bool:
        """Write `torch.compiler.save_cache_artifacts()`'s result (None: nothing to save). True if written."""
        if artifacts is None:
            return False
        data = artifacts[0]
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = {"key": self.key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(self.path / ARTIFACT_FILE, data)
        _atomic_write(self.path / KEY_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return True

    def discard(self, why: str) -> None:
        warnings.warn(f"compile cache entry {self.path} is unusable ({why}); discarding it and compiling fresh",
                      CompileCacheWarning, stacklevel=3)
        shutil.rmtree(self.path, ignore_errors=True)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
