"""Compile cache: compiled decode graphs kept under `compile_cache/<CASE_NAME>/` between runs.

`CompileCache(case_dir(name), trust=False).entry(cache_key(...))` is one entry per compiled graph (rank and batch
bucket), in `compile_cache/<CASE_NAME>/<key hash>/`: key.json (the full key, every file's sha256, the entry's MAC),
artifacts.bin (`torch.compiler.save_cache_artifacts()`), inductor/ (inductor's cache; on an NPU torchair's
cache_compile files). The key holds everything the graph depends on (model config, layout and rank, dtype, bucket,
block size, KV cache dtype, exe_mode, backend, inlined kernels and their source hash, torch / torch_npu / Python
versions), so a changed key is another directory and a stale artefact is never loaded.

The cache is code (loading an entry unpickles and imports it), so: directories are created owner-only, a case
directory or entry owned by another user or writable by others is a CompileCacheError; every entry is checksummed
and authenticated by an HMAC under a per-user key outside the cache (`key_path()`); an entry this user did not write
is discarded with a CompileCacheWarning and compiled fresh unless `trust=True`. An unreadable entry is discarded and
compiled again; entries are written artefact first and key.json last, each through an atomic rename, so a crash
leaves an entry that is discarded, not loaded. docs/graph_mode.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from optimized import envs
from optimized.errors import UsageError

CACHE_ROOT = "compile_cache"
KEY_FILE, ARTIFACT_FILE = "key.json", "artifacts.bin"
KEY_ENV = envs.COMPILE_CACHE_KEY  # where the per-user MAC key lives (tests: a tmp_path)
_CASE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CompileCacheWarning(UserWarning):
    """A compile-cache entry was unusable and is being replaced by a fresh compile."""


class CompileCacheError(UsageError, ValueError):
    """The compile cache cannot be used safely (a directory or key of another user, or writable by others) or at
    all (it cannot be created): the message names the path and the fix."""


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
    from optimized.ops import batch_invariant
    from optimized.ops.registry import inline_in_inductor, kernels_source_hash

    parallel = model.groups.parallel
    # Inductor traces the portable kernels into the graph (their code is part of it); torchair's GE graph calls
    # torch_npu's kernels, so a portable kernel's source never invalidates an NPU entry.
    inductor = platform.backend_name() != "npu"
    return {
        "model_config": json.loads(model.config.to_json_string(use_diff=False)),
        "parallel_layout": {k: getattr(parallel, k) for k in sorted(vars(parallel))},
        "rank": model.groups.rank,
        "dtype": str(model.dtype).removeprefix("torch."),
        "force_eplb": bool(model.force_eplb),  # the balanced expert ids are built inside the traced step
        "weight_nz": bool(getattr(model, "weight_nz", False)),  # frozen parameters in the NZ or the ND layout
        # W4A4's learned rotations are graph constants: enable_hadamard and the rotation files' content
        "enable_hadamard": bool(getattr(model, "enable_hadamard", False)),
        "hadamard_rotation": getattr(model, "hadamard_rotation", None),
        "batch_bucket": batch_bucket,
        "batch_invariant": batch_invariant.enabled(),  # row-wise GEMM operators in the graph (model_config)
        "block_size": block_size,
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "exe_mode": exe_mode,
        "backend": platform.backend_name(),
        "torch": torch.__version__,
        "torch_npu": torch_npu_version(),
        "python": sys.version.split()[0],
        "inlined_kernels": inline_in_inductor() if inductor else [],  # what the graph traces through
        "kernels_source": kernels_source_hash() if inductor else None,  # and their code
    }


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def check_case_name(name: str) -> str:
    if not _CASE_NAME_RE.match(name) or ".." in name:
        raise ValueError(
            f"CASE_NAME {name!r} must be a plain directory name (letters, digits, '.', '_', '-'; no '/' or '..')"
        )
    return name


def default_case_name(model_name: str, dtype: str, parallel, exe_mode: str) -> str:
    """A case name derived from the config: model, dtype, layout and mode, e.g. tiny-float32-w2a2t1e2v1l2-ge_graph."""
    p = parallel
    layout = f"w{p.world_size}a{p.attn_tp_size}t{p.moe_tp_size}e{p.moe_ep_size}v{p.embed_tp_size}l{p.lmhead_tp_size}"
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_name.rstrip("/")).name or "model").lstrip("._-") or "model"
    return f"{model}-{dtype}-{layout}-{exe_mode}"


def case_dir(case_name: str, workdir: str | os.PathLike | None = None) -> Path:
    """`<workdir or cwd>/compile_cache/<case_name>`."""
    return Path(workdir or os.getcwd()) / CACHE_ROOT / check_case_name(case_name)


# ------------------------------------------------------------------------------------- ownership, the key


def private_dir(path: Path, what: str) -> Path:
    """`path` as an owner-only directory: the missing parts created 0o700, the whole checked `check_private`."""
    missing = []
    for part in (path, *path.parents):
        if part.exists():
            break
        missing.append(part)
    for part in reversed(missing):
        try:
            os.mkdir(part, 0o700)
        except FileExistsError:  # another rank made it meanwhile: checked below like any existing directory
            pass
        except OSError as e:
            raise CompileCacheError(
                f"cannot create the {what} {part} ({e.strerror}): run from a writable directory "
                f"or turn the compile cache off (enable_cache_compile: false)"
            ) from None
    return check_private(path, what)


def check_private(path: Path, what: str) -> Path:
    """`path` (a directory or the key file) owned by this user and not writable by group or others, else a
    CompileCacheError: whoever can write there can make this process run their code."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise CompileCacheError(
            f"the {what} {path} belongs to user id {st.st_uid}, not to this user ({os.geteuid()})"
            f": loading it would run another user's code; remove it or use another CASE_NAME"
        )
    loose = 0o077 if not stat.S_ISDIR(st.st_mode) else 0o022  # the key must not even be readable by others
    if st.st_mode & loose:
        raise CompileCacheError(
            f"the {what} {path} has mode {stat.filemode(st.st_mode)} (open to group or others): "
            f"whoever can {'read' if loose == 0o077 else 'write'} it can make this process run "
            f"their code; chmod {'600' if loose == 0o077 else 'go-w'} {path}"
        )
    return path


def key_path() -> Path:
    """The per-user MAC key: $QWEN3_MOE_COMPILE_CACHE_KEY, else ~/.config/qwen3-moe-npu/compile_cache.key."""
    return envs.compile_cache_key()


def user_key(path: Path | None = None) -> bytes:
    """The key entries are authenticated with: 32 random bytes, created owner-only on first use (atomically:
    written to a private temporary file and linked into place, so concurrent ranks agree on one key)."""
    path = path or key_path()
    if not path.exists():
        private_dir(path.parent, "compile cache key directory")
        tmp = _private_temporary(path, secrets.token_bytes(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    check_private(path, "compile cache key")
    key = path.read_bytes()
    if len(key) < 32:
        raise CompileCacheError(
            f"the compile cache key {path} holds {len(key)} bytes, fewer than 32: remove it (a "
            f"new key is made; entries written under the old one are then compiled again)"
        )
    return key


def file_digests(path: Path) -> dict[str, str]:
    """sha256 of every file under the entry `path` but its key.json, by relative path. A symbolic link inside an
    entry (which this code never writes) is a ValueError: it could point anywhere."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            full = Path(root, name)
            rel = full.relative_to(path).as_posix()
            if full.is_symlink():
                raise ValueError(f"{rel} is a symbolic link")
            if name in files and rel != KEY_FILE:
                out[rel] = hashlib.sha256(full.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def entry_mac(secret: bytes, key: dict, files: dict[str, str]) -> str:
    return hmac.new(secret, json.dumps({"key": key, "files": files}, sort_keys=True).encode(), "sha256").hexdigest()


# ----------------------------------------------------------------------------------------------- entries


@dataclass
class CompileCache:
    """The entries of one case directory, created owner-only (CompileCacheError when it cannot be created or is
    not this user's alone). trust: load entries this user did not write (see the module docstring)."""

    root: Path
    trust: bool = False

    def __post_init__(self):
        self.root = private_dir(Path(self.root), "compile cache directory")

    def entry(self, key: dict) -> "CacheEntry":
        return CacheEntry(self.root / key_hash(key), key, self.trust)


@dataclass
class CacheEntry:
    path: Path
    key: dict
    trust: bool = False

    @contextlib.contextmanager
    def inductor_cache(self):
        """Inductor's cache directory is this entry's `inductor/` inside the block."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        private_dir(self.path / "inductor", "compile cache entry")
        with temporary_cache_dir(str(self.path / "inductor")):
            yield

    def verify(self) -> bool:
        """Whether the entry exists and may be used: its key, every file's checksum, and its MAC under this user's
        key (or trust). An unusable entry is discarded with a CompileCacheWarning. An entry directory of another
        user, or writable by others, is a CompileCacheError."""
        if not self.path.exists():
            return False
        check_private(self.path, "compile cache entry")
        secret = user_key()
        try:
            files = file_digests(self.path)
            if not files and not (self.path / KEY_FILE).exists():
                return False  # an empty directory: nothing was ever written
            manifest = json.loads((self.path / KEY_FILE).read_text())
            if manifest.get("key") != self.key:
                raise ValueError("its key.json holds another key")
            written = manifest.get("files") or {}
            if files != written:
                changed = sorted(f for f in set(files) | set(written) if files.get(f) != written.get(f))
                raise ValueError(
                    f"{len(changed)} file(s) missing, added or differing from key.json's checksums "
                    f"(e.g. {changed[0]}): truncated, corrupt or modified"
                )
            mac = manifest.get("mac")
            if not (isinstance(mac, str) and hmac.compare_digest(mac, entry_mac(secret, self.key, files))):
                if not self.trust:
                    raise ValueError(
                        f"this user did not write it (its MAC does not verify under {key_path()}), and "
                        f"loading it would run its code; set model_config.trust_compile_cache: true to "
                        f"load entries copied from another node"
                    )
                warnings.warn(
                    f"compile cache entry {self.path} was written under another key; loading it because "
                    f"the cache is trusted (trust_compile_cache)",
                    CompileCacheWarning,
                    stacklevel=3,
                )
        except (OSError, ValueError, AttributeError, TypeError, RecursionError) as e:  # unreadable: drop it
            self.discard(f"{type(e).__name__}: {e}")
            return False
        return True

    def load(self) -> bool:
        """Hot-load the entry's artefacts into torch's compile caches (inside `inductor_cache()`). False when
        there is no usable entry (an unusable one is discarded with a CompileCacheWarning)."""
        if not self.verify():
            return False
        try:
            data = (self.path / ARTIFACT_FILE).read_bytes()
            if torch.compiler.load_cache_artifacts(data) is None:
                raise ValueError("torch could not deserialize the artefacts")
        except Exception as e:  # any unreadable artefact: drop the entry and compile fresh
            self.discard(f"{type(e).__name__}: {e}")
            return False
        return True

    def save(self, artifacts) -> bool:
        """Write `torch.compiler.save_cache_artifacts()`'s result (None: nothing to save), then sign the entry.
        True if written."""
        if artifacts is None:
            return False
        self.create()
        _atomic_write(self.path / ARTIFACT_FILE, artifacts[0])
        self.sign()
        return True

    def create(self) -> Path:
        """The entry's directory, owner-only (where this code or torchair's cache_compile writes its files)."""
        return private_dir(self.path, "compile cache entry")

    def sign(self) -> None:
        """key.json: the key, every file's checksum and their MAC under this user's key (written last)."""
        files = file_digests(self.path)
        manifest = {"key": self.key, "files": files, "mac": entry_mac(user_key(), self.key, files)}
        _atomic_write(self.path / KEY_FILE, json.dumps(manifest, indent=1, sort_keys=True).encode())

    def discard(self, why: str) -> None:
        warnings.warn(
            f"compile cache entry {self.path} is unusable ({why}); discarding it and compiling fresh",
            CompileCacheWarning,
            stacklevel=3,
        )
        shutil.rmtree(self.path, ignore_errors=True)


def _private_temporary(path: Path, data: bytes) -> Path:
    """`data` in an owner-only temporary file beside `path` (moved or linked into place by the caller)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def _atomic_write(path: Path, data: bytes) -> None:
    os.replace(_private_temporary(path, data), path)
