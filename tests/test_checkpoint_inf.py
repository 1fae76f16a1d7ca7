"""A 16/32-bit weight holding +inf, or -inf, among finite values is refused at load, naming the tensor, by both
models' loaders (the optimized `WeightSource.read` check and the reference's `model_from_state_dict`): a check that
only looked for NaN, or only at one end of the range, would let it through.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import optimized  # noqa: F401
from fixtures.checkpoints import checkpoint
from optimized.model_loader.build import load_model as load_optimized, model_from_source
from optimized.model_loader.hf_config import load_hf_config
from optimized.model_loader.loader import CheckpointError, StateDictSource, check_finite
from reference.checkpoint import CheckpointError as ReferenceCheckpointError
from reference.checkpoint import load_config, model_from_state_dict, read_state_dict
from reference.checkpoint import load_model as load_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SIGNS = (float("inf"), float("-inf"))


@functools.cache
def _state() -> dict[str, torch.Tensor]:
    return read_state_dict(checkpoint("tiny"))


def _with_inf(dtype: torch.dtype, name: str, position: int, value: float) -> dict[str, torch.Tensor]:
    state = {n: t.to(dtype) for n, t in _state().items()}
    t = state[name].clone()
    t.view(-1)[position % t.numel()] = value
    state[name] = t
    return state


names = st.sampled_from(sorted(n for n, t in read_state_dict(checkpoint("tiny")).items() if t.numel() > 1))


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(DTYPES), value=st.sampled_from(SIGNS), name=names, position=st.integers(0, 10**6))
def test_an_inf_weight_among_finite_values_is_refused_by_both_loaders(dtype, value, name, position):
    state = _with_inf(dtype, name, position, value)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds 1 non-finite value\(s\) \(NaN or inf\)"):
        model_from_source(
            load_hf_config(checkpoint("tiny")), StateDictSource(state, label="state"), dtype=torch.float32, device="cpu"
        )
    with pytest.raises(
        ReferenceCheckpointError, match=rf"tensor '{name}' holds 1 non-finite value\(s\) \(NaN or inf\)"
    ):
        model_from_state_dict(load_config(checkpoint("tiny")), state)


@given(
    dtype=st.sampled_from(DTYPES),
    value=st.sampled_from(SIGNS),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    position=st.integers(0, 10**6),
)
def test_check_finite_refuses_either_infinity_alone(dtype, value, shape, position):
    t = torch.randn(shape).to(dtype)
    t.view(-1)[position % t.numel()] = value
    with pytest.raises(CheckpointError, match=r"tensor 'w' holds 1 non-finite value\(s\)"):
        check_finite(t, "w", "ckpt")
    check_finite(t.nan_to_num(posinf=1.0, neginf=-1.0), "w", "ckpt")  # finite values pass


@pytest.mark.parametrize("value", SIGNS, ids=["+inf", "-inf"])
def test_a_checkpoint_file_with_an_inf_weight_is_refused_naming_it(value, tmp_path):
    """End to end through the files: the optimized and the reference `load_model`."""
    import shutil

    src = checkpoint("tiny")
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    files = sorted(d.glob("*.safetensors"))
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    for f in files:
        tensors = load_file(f)
        if name in tensors:
            tensors[name][2, 3] = value
            save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds 1 non-finite"):
        load_optimized(d, dtype=torch.float32, device="cpu")
    with pytest.raises(ReferenceCheckpointError, match=rf"tensor '{name}' holds 1 non-finite"):
        load_reference(d)
