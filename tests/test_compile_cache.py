"""The compile cache's own rules, without compiling anything: the kernels' source hash in inductor's cache key
tag, owner-only directories, and refusal of a cache or key that others can open (graph-mode decoding from the
cache is proven in equivalence/graph/test_graph.py)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from optimized.executor.compile_cache import KEY_ENV, CompileCache, CompileCacheError, user_key


def test_inductor_cache_keys_carry_the_kernels_source_hash():
    """Inductor's own caches key on the traced graph, not on a decomposition's code: graph mode's settings add the
    kernels' source hash to their key tag (once, however nested, beside a tag the user set)."""
    from optimized.executor.graph import compile_settings
    from optimized.ops.registry import kernels_source_hash

    ours = f"qwen3_moe_kernels={kernels_source_hash()}"
    with torch.compiler.config.patch(cache_key_tag="user-tag"), compile_settings():
        with compile_settings():
            assert torch.compiler.config.cache_key_tag == f"user-tag|{ours}"
    assert ours not in torch.compiler.config.cache_key_tag


def test_cache_open_to_others_or_of_another_user_is_refused(tmp_path, monkeypatch):
    """Owner-only directories on creation; a case directory, entry or key that others can write (or read, for
    the key), or that another user owns, is a CompileCacheError naming it: never loaded, never discarded."""
    cache = CompileCache(tmp_path / "compile_cache" / "case")
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in (cache.root, cache.root.parent))
    entry = cache.entry({"any": "key"})
    entry.path.mkdir()
    entry.path.chmod(0o777)
    with pytest.raises(CompileCacheError, match=r"compile cache entry .* has mode drwxrwxrwx .*chmod go-w"):
        entry.verify()
    cache.root.chmod(0o775)
    with pytest.raises(CompileCacheError, match=r"compile cache directory .* has mode drwxrwxr-x"):
        CompileCache(cache.root)
    cache.root.chmod(0o700)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "keys" / "compile_cache.key"))  # not the module's shared key
    assert len(user_key()) == 32 and stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    (tmp_path / "keys" / "compile_cache.key").chmod(0o644)
    with pytest.raises(CompileCacheError, match=r"compile cache key .* has mode -rw-r--r-- .*chmod 600"):
        user_key()
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(CompileCacheError, match=f"belongs to user id {uid}, not to this user"):
        CompileCache(cache.root)
