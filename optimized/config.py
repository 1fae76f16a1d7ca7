"""Inference configuration: one YAML file with the cann-recipes-infer sections (model_config, data_config,
parallel_config, scheduler_config), validated with clear errors.

Every key is optional (the dataclass defaults below); unknown keys and repeated keys are rejected. `from_dict` /
`from_yaml` check what the file alone decides; `validate_for_model(hf_config)` what needs the model. All
violations are reported together in one `ConfigError`, one line each, starting with the dotted key. `model_path`
is `fixture:NAME`, `preset:NAME` (the product's presets, optimized/model_loader/presets.py) or a directory; this
module only checks its syntax. See docs/config.md for every key, what it does and whether it is honoured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from optimized import envs
from optimized.errors import UsageError

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0  # parallel_config.collective_timeout_s (distributed/guard.py applies it)

EXE_MODES = ("eager", "ge_graph", "acl_graph", "npugraph_ex")  # the recipe's names (npugraph_ex: its aclgraph mode)
GRAPH_MODES = EXE_MODES[1:]  # decode as one compiled graph
DTYPES = ("bfloat16", "float32")
DATASETS = ("prompts", "random", "default", "LongBench")
PLATFORM_VERSIONS = envs.PLATFORM_VERSIONS  # the recipe's platform_version values
PLATFORM_VERSION_ENV = envs.PLATFORM_VERSION  # the recipe's fallback when the YAML sets none
TOKENIZER_MODES = ("default", "chat")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float8")  # float8: the recipe's per-token FP8 KV cache
MODEL_PATH_SCHEMES = ("fixture", "preset")
RECIPE_INPUT_TRUNCATED_LEN = 256  # the recipe's data_config.input_truncated_len default


class ConfigError(UsageError, ValueError):
    """One or more invalid config entries. `errors` holds (dotted key, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        head = f"invalid inference config{f' {source}' if source else ''}"
        super().__init__(head + ":\n" + "\n".join(f"  {key}: {msg}" for key, msg in self.errors))


# ------------------------------------------------------------------------------------------------- YAML


class DuplicateKeyError(UsageError, yaml.constructor.ConstructorError):
    """A YAML mapping that repeats a key."""


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping repeating a key (SafeLoader keeps the last value silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden: not a repeat
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise DuplicateKeyError(
                            f"duplicate key {key!r} on line {first[key]} and again on line "
                            f"{line} (one of them would be ignored); remove one"
                        )
                    first[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
        return super().construct_mapping(node, deep)


def load_yaml(text: str):
    """`yaml.safe_load`, refusing duplicate keys (DuplicateKeyError, a yaml.YAMLError)."""
    return yaml.load(text, Loader=StrictLoader)


# ----------------------------------------------------------------------------------------------- checks


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(v: Any) -> str:
    return f"{v!r} ({type(v).__name__})"


class _Checker:
    """Collects (key, message) errors for one section."""

    def __init__(self, section: str, errors: list[tuple[str, str]]):
        self.section, self.errors = section, errors

    def fail(self, key: str, msg: str) -> None:
        self.errors.append((f"{self.section}.{key}", msg))

    def positive_int(self, obj, key: str, *, optional: bool = False) -> bool:
        v = getattr(obj, key)
        if optional and v is None:
            return True
        if not _is_int(v) or v <= 0:
            self.fail(key, f"must be a positive integer{' or null' if optional else ''}, got {_describe(v)}")
            return False
        return True

    def non_negative_int(self, obj, key: str) -> bool:
        v = getattr(obj, key)
        if not _is_int(v) or v < 0:
            self.fail(key, f"must be a non-negative integer, got {_describe(v)}")
            return False
        return True

    def boolean(self, obj, key: str) -> bool:
        v = getattr(obj, key)
        if not isinstance(v, bool):
            self.fail(key, f"must be a boolean (true/false), got {_describe(v)}")
            return False
        return True

    def choice(self, obj, key: str, choices: tuple[str, ...]) -> bool:
        v = getattr(obj, key)
        if v not in choices or not isinstance(v, str):
            self.fail(key, f"must be one of {', '.join(choices)}; got {_describe(v)}")
            return False
        return True


# --------------------------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    model_path: str = "fixture:tiny"
    exe_mode: str = "eager"
    dtype: str = "bfloat16"
    with_ckpt: bool = True
    enable_cache_compile: bool = False
    trust_compile_cache: bool = False
    num_hidden_layers: int | None = None
    tokenizer_mode: str = "default"
    kv_cache_dtype: str = "auto"
    batch_invariant: bool = False  # a request's logits bitwise the same whatever it is batched with (CPU kernels)
    # graph mode's captured decode batch sizes (ascending); null: 1, 2, 4, 8, then every 16 up to a DP group's batch
    graph_batch_sizes: list[int] | None = None
    # The recipe's other model_config keys: each does what the recipe does, or is refused naming why.
    model_name: str = "model"  # the run's name: printed, and the default compile-cache case name's head
    output_path: str = ""  # where enable_profiler writes its trace; "": the YAML file's directory
    platform_version: str | None = None  # A2 | A3 | 950; null: env PLATFORM_VERSION, else A3 (the recipe's order)
    next_n: int = 0  # speculative (MTP) steps: only 0 (no MTP layers in Qwen3-MoE)
    enable_profiler: bool = False  # a torch.profiler trace of the run, one file per rank, under output_path
    force_eplb: bool | None = None  # the recipe's forced balanced routing (benchmarks); null: not given (false)
    enable_static_kernel: bool = False  # npugraph_ex static kernels: refused when true
    enable_weight_nz: bool = True  # every linear, expert and MX weight cast once to FRACTAL_NZ after loading
    enable_hadamard: bool = False  # W4A4 checkpoints: the learned Hadamard rotation of hadamard_weight_path
    hadamard_weight_path: str = ""  # its directory of layer_{i}_self_attn.pt (optimized/layers/hadamard.py)
    custom_params: dict = field(default_factory=dict)  # model-specific switches: none are defined for Qwen3-MoE
    enable_online_split_weight: bool = True  # older recipe files: each rank splits the HF checkpoint as it loads
    perfect_eplb: bool | None = None  # older recipe files' name of force_eplb (both given: must agree)

    @property
    def hadamard(self) -> str | None:
        """load_model's hadamard_weight_path: the rotation directory with enable_hadamard, else None."""
        return self.hadamard_weight_path if self.enable_hadamard is True else None

    @property
    def platform(self) -> str:
        """platform_version as the recipe resolves it: the YAML's, else env PLATFORM_VERSION, else A3."""
        from optimized import envs

        return str(self.platform_version if self.platform_version is not None else envs.platform_version())

    @property
    def eplb(self) -> bool:
        """Whether the forced balanced routing is on: force_eplb, or its older name perfect_eplb."""
        return self.force_eplb is True or self.perfect_eplb is True

    @property
    def scheme(self) -> tuple[str | None, str]:
        """('fixture', NAME), ('preset', NAME) or (None, path)."""
        head, sep, rest = self.model_path.partition(":")
        if sep and head in MODEL_PATH_SCHEMES:
            return head, rest
        return None, self.model_path

    @property
    def torch_dtype(self):
        import torch

        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype]

    def _check(self, c: _Checker) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            c.fail("model_path", f"must be a non-empty string, got {_describe(self.model_path)}")
        else:
            scheme, name = self.scheme
            if scheme is not None and not name:
                c.fail("model_path", f"'{scheme}:' must be followed by a name, e.g. '{scheme}:tiny'")
        c.choice(self, "exe_mode", EXE_MODES)
        c.choice(self, "dtype", DTYPES)
        c.boolean(self, "with_ckpt")
        c.boolean(self, "enable_cache_compile")
        c.boolean(self, "trust_compile_cache")
        c.boolean(self, "batch_invariant")
        c.positive_int(self, "num_hidden_layers", optional=True)
        c.choice(self, "tokenizer_mode", TOKENIZER_MODES)
        c.choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        if self.enable_cache_compile is True and self.exe_mode == "eager":
            c.fail(
                "enable_cache_compile",
                "needs exe_mode: ge_graph or acl_graph (there is no compiled graph to cache in eager mode)",
            )
        self._check_graph_batch_sizes(c)
        if self.trust_compile_cache is True and self.enable_cache_compile is not True:
            c.fail("trust_compile_cache", "applies to the compile cache, which is off (enable_cache_compile: false)")
        if isinstance(self.model_path, str) and self.scheme[0] == "preset" and self.with_ckpt is True:
            c.fail("with_ckpt", "must be false with a 'preset:' model_path (presets have a config.json, no weights)")
        self._check_recipe_keys(c)

    def _check_graph_batch_sizes(self, c: _Checker) -> None:
        """graph_batch_sizes: ascending distinct positive batch sizes, in a graph mode (eager captures nothing); that
        the largest holds a DP group's batch is a rule across sections (InferenceConfig)."""
        sizes = self.graph_batch_sizes
        if sizes is None:
            return
        if not isinstance(sizes, list) or not sizes or not all(_is_int(b) and b > 0 for b in sizes):
            c.fail("graph_batch_sizes", f"must be a non-empty list of positive integers, got {_describe(sizes)}")
        elif sizes != sorted(set(sizes)):
            c.fail("graph_batch_sizes", f"must be ascending without repeats, e.g. {sorted(set(sizes))}; got {sizes}")
        if self.exe_mode == "eager":
            c.fail("graph_batch_sizes", "are graph mode's captured decode batches; exe_mode eager captures none")

    def _check_recipe_keys(self, c: _Checker) -> None:
        """The recipe's keys this model runs as the recipe means them, and those it refuses (naming why)."""
        for key in ("model_name", "output_path", "hadamard_weight_path"):
            if not isinstance(getattr(self, key), str):
                c.fail(key, f"must be a string, got {_describe(getattr(self, key))}")
        if (
            self.platform not in PLATFORM_VERSIONS
        ):  # the YAML's (envs.platform_version() refuses a bad $PLATFORM_VERSION)
            c.fail("platform_version", f"must be one of {', '.join(PLATFORM_VERSIONS)}; got {self.platform!r}")
        if c.non_negative_int(self, "next_n") and self.next_n:
            c.fail(
                "next_n",
                f"({self.next_n}) must be 0: speculative decoding (MTP) is not implemented, and "
                f"Qwen3-MoE checkpoints have no MTP layers",
            )
        for key in (
            "enable_profiler",
            "enable_static_kernel",
            "enable_weight_nz",
            "enable_hadamard",
            "enable_online_split_weight",
        ):
            c.boolean(self, key)
        given = [key for key in ("force_eplb", "perfect_eplb") if getattr(self, key) is not None]
        if all([c.boolean(self, key) for key in given]) and len(given) == 2 and self.force_eplb != self.perfect_eplb:
            force, perfect = (str(v).lower() for v in (self.force_eplb, self.perfect_eplb))
            c.fail(
                "force_eplb",
                f"({force}) and perfect_eplb ({perfect}, its older name) disagree; give one of them, or the same value",
            )
        if self.enable_static_kernel is True:
            c.fail("enable_static_kernel", "static kernels of npugraph_ex are not implemented; set it false")
        if self.enable_hadamard is True and self.hadamard_weight_path == "":
            c.fail(
                "hadamard_weight_path",
                "is empty, but enable_hadamard is true: give the directory of the "
                "layer_{i}_self_attn.pt rotation files",
            )
        elif (
            self.enable_hadamard is not True
            and isinstance(self.hadamard_weight_path, str)
            and self.hadamard_weight_path
        ):
            c.fail("hadamard_weight_path", "is only read with enable_hadamard: true; set that, or remove the path")
        if self.enable_online_split_weight is False:
            c.fail(
                "enable_online_split_weight",
                "false means checkpoints split offline per rank, which is not "
                "implemented: every rank reads its shard of the HF checkpoint",
            )
        if not isinstance(self.custom_params, dict):
            c.fail("custom_params", f"must be a mapping, got {_describe(self.custom_params)}")
        elif self.custom_params:
            c.fail(
                "custom_params",
                f"no custom_params are defined for Qwen3-MoE; got {', '.join(map(str, self.custom_params))}",
            )


@dataclass
class DataConfig:
    dataset: str = "prompts"
    prompts: list[str] = field(default_factory=lambda: ["The capital of France is"])
    input_max_len: int = 1024
    seed: int = 0
    dataset_path: str = ""  # default: its default_prompt.json; LongBench: the LongBench directory
    input_truncated_len: int | None = None  # prompts longer than this many tokens are cut to it (the recipe's rule)

    @property
    def truncation(self) -> int | None:
        """The token length prompts are cut to: input_truncated_len, or the recipe's 256 for LongBench."""
        if self.input_truncated_len is None and self.dataset == "LongBench":
            return RECIPE_INPUT_TRUNCATED_LEN
        return self.input_truncated_len

    def _check(self, c: _Checker) -> None:
        c.choice(self, "dataset", DATASETS)
        if not isinstance(self.prompts, list) or not all(isinstance(p, str) for p in self.prompts):
            c.fail("prompts", f"must be a list of strings, got {_describe(self.prompts)}")
        elif self.dataset == "prompts" and not self.prompts:
            c.fail("prompts", "must not be empty when dataset is 'prompts'")
        c.positive_int(self, "input_max_len")
        c.non_negative_int(self, "seed")
        c.positive_int(self, "input_truncated_len", optional=True)
        if not isinstance(self.dataset_path, str):
            c.fail("dataset_path", f"must be a string (a directory), got {_describe(self.dataset_path)}")
        elif self.dataset == "LongBench" and not self.dataset_path:
            c.fail(
                "dataset_path",
                "dataset LongBench reads a local LongBench directory (its <subset>.jsonl files); "
                "set dataset_path to it (nothing is downloaded)",
            )
        elif self.dataset_path and self.dataset not in ("default", "LongBench"):
            c.fail("dataset_path", f"is read only by the datasets default and LongBench (dataset: {self.dataset!r})")


PARALLEL_SIZES = ("attn_tp_size", "moe_tp_size", "moe_ep_size", "embed_tp_size", "lmhead_tp_size")
EPLB_KEYS = ("enable_eplb", "num_redundant_experts", "eplb_window_size", "eplb_step_interval")
PARALLEL_OPTIONS = ("prefill_opt", "moe_ep_scheme", "attn_dp", *EPLB_KEYS)
MOE_EP_SCHEMES = ("auto", "allgather", "alltoall")


@dataclass
class ParallelConfig:
    world_size: int = 1
    attn_tp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int | None = None  # null: world_size / moe_tp_size, as the recipe derives it
    embed_tp_size: int = 1
    lmhead_tp_size: int = 1
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    prefill_opt: bool | None = None
    moe_ep_scheme: str = "auto"
    attn_dp: bool | None = None  # null: attention DP whenever attn_tp_size < world_size (the recipe's rule);
    # false: replicated attention (every attention TP group runs the whole batch)
    # The recipe's other sizes. dense_tp_size / o_proj_tp_size null: the dense MLP is sharded over the MoE TP group
    # and o_proj over the attention TP group (the only layouts built here; a value must name that size).
    dense_tp_size: int | None = None
    o_proj_tp_size: int | None = None
    shared_tp_size: int = 1  # shared experts' TP: Qwen3-MoE has none, so it changes nothing
    cp_size: int = 1  # context parallel prefill: only 1
    # Expert load balancing (optimized/layers/eplb): redundant expert slots placed from the routed-token counts of the
    # last eplb_window_size steps, recomputed and moved every eplb_step_interval steps.
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000

    def __post_init__(self):
        """Derive what the recipe derives (moe_ep_size, attn_dp) when the file leaves it out."""
        derived = set()
        w, t, a = self.world_size, self.moe_tp_size, self.attn_tp_size
        if self.moe_ep_size is None and _is_int(w) and _is_int(t) and t > 0 and w > 0 and w % t == 0:
            self.moe_ep_size = w // t
            derived.add("moe_ep_size")
        if self.attn_dp is None and _is_int(w) and _is_int(a) and a > 0:
            self.attn_dp = a < w
            derived.add("attn_dp")
        object.__setattr__(self, "_derived", ",".join(sorted(derived)))  # not a field; a str: JSON round-trips

    def derived(self, key: str) -> bool:
        """Whether `key` was derived (left out of the config) rather than set."""
        return key in getattr(self, "_derived", "").split(",")

    @property
    def attn_dp_size(self) -> int:
        """Attention data-parallel groups: world_size / attn_tp_size with attn_dp, else 1 (replicated attention)."""
        return self.world_size // self.attn_tp_size if self.attn_dp is True else 1

    @property
    def sp_prefill(self) -> bool:
        """Whether the layout asks for the sequence-parallel prefill (prefill_opt, or its default when null). What
        runs is the plan's decision (optimized/path_plan.py), which also asks the checkpoint."""
        if self.prefill_opt is not None:
            return self.prefill_opt
        return self.world_size > 1 and self.attn_tp_size == self.moe_ep_size == self.world_size

    def expert_slots(self, num_experts: int) -> int:
        """Physical expert slots of a MoE layer: num_experts, plus num_redundant_experts with enable_eplb."""
        return num_experts + (self.num_redundant_experts if self.enable_eplb is True else 0)

    @property
    def mc2_decode(self) -> bool:
        """Whether the layout's decode MoE is MC2 dispatch / combine: experts spread over EP ranks untensor-split (the
        recipe's rule). The process groups build the MC2 group for it; the plan's decode path reads it."""
        return self.moe_tp_size == 1 and self.moe_ep_size > 1

    def _check(self, c: _Checker) -> None:
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            c.fail("collective_timeout_s", f"must be a positive number of seconds, got {_describe(t)}")
        ok = {
            k: (self.moe_ep_size is not None or k != "moe_ep_size") and c.positive_int(self, k)
            for k in ("world_size",) + PARALLEL_SIZES
        }  # an underivable moe_ep_size: moe_tp_size's error says why
        self._check_recipe_sizes(c, ok)
        self._check_prefill_opt(c, ok)
        self._check_attn_dp(c, ok)
        self._check_eplb(c)
        if not ok["world_size"]:
            return
        w = self.world_size
        for k in PARALLEL_SIZES:
            if ok[k] and w % getattr(self, k):
                c.fail(k, f"world_size ({w}) must be divisible by {k} ({getattr(self, k)})")
        if ok["moe_tp_size"] and ok["moe_ep_size"] and self.moe_tp_size * self.moe_ep_size != w:
            c.fail(
                "moe_ep_size",
                f"moe_tp_size * moe_ep_size must equal world_size ({self.moe_tp_size} * {self.moe_ep_size} != {w})",
            )

    def _check_recipe_sizes(self, c: _Checker, ok: dict[str, bool]) -> None:
        for key, follows in (("dense_tp_size", "moe_tp_size"), ("o_proj_tp_size", "attn_tp_size")):
            if (
                c.positive_int(self, key, optional=True)
                and getattr(self, key) is not None
                and ok[follows]
                and getattr(self, key) != getattr(self, follows)
            ):
                c.fail(
                    key,
                    f"({getattr(self, key)}) must equal {follows} ({getattr(self, follows)}) or be left out: "
                    f"that is the only layout built here",
                )
        if c.positive_int(self, "shared_tp_size") and ok["world_size"] and self.world_size % self.shared_tp_size:
            c.fail(
                "shared_tp_size",
                f"world_size ({self.world_size}) must be divisible by shared_tp_size ({self.shared_tp_size})",
            )
        if c.positive_int(self, "cp_size") and self.cp_size != 1:
            c.fail(
                "cp_size",
                f"({self.cp_size}) must be 1: the context-parallel prefill is not implemented "
                f"(the sequence-parallel prefill is: prefill_opt)",
            )

    def _check_prefill_opt(self, c: _Checker, ok: dict[str, bool]) -> None:
        """The recipe's rules for the sequence-parallel prefill and its MoE EP scheme."""
        if self.prefill_opt is not None and not c.boolean(self, "prefill_opt"):
            return
        if not c.choice(self, "moe_ep_scheme", MOE_EP_SCHEMES) or not all(ok.values()):
            return
        if self.prefill_opt:
            if self.attn_tp_size != self.moe_ep_size:
                c.fail(
                    "prefill_opt",
                    f"the sequence-parallel prefill needs attn_tp_size == moe_ep_size "
                    f"({self.attn_tp_size} != {self.moe_ep_size})",
                )
            elif self.moe_tp_size != 1:
                c.fail(
                    "prefill_opt",
                    f"the sequence-parallel prefill needs moe_tp_size == 1 (got "
                    f"{self.moe_tp_size}): its MoE is expert parallel over the attention TP ranks",
                )
        if self.moe_ep_scheme != "auto" and not self.sp_prefill:
            c.fail(
                "moe_ep_scheme",
                f"{self.moe_ep_scheme!r} selects the MoE path of the sequence-parallel prefill, "
                f"which is off (prefill_opt: {self.prefill_opt}, attn_tp_size "
                f"{self.attn_tp_size}, moe_ep_size {self.moe_ep_size}, world_size "
                f"{self.world_size}); use auto or enable prefill_opt",
            )

    def _check_eplb(self, c: _Checker) -> None:
        """Expert load balancing's keys; the model-dependent rules are validate_for_model's."""
        on = c.boolean(self, "enable_eplb") and self.enable_eplb
        c.positive_int(self, "eplb_window_size")
        c.positive_int(self, "eplb_step_interval")
        if c.non_negative_int(self, "num_redundant_experts") and self.num_redundant_experts and not on:
            c.fail("num_redundant_experts", "adds expert slots for expert load balancing: set enable_eplb: true")

    def _check_attn_dp(self, c: _Checker, ok: dict[str, bool]) -> None:
        """The layouts attention data parallel runs in (the recipe's attn_tp x dp with MoE EP over every rank)."""
        if self.attn_dp is None or not c.boolean(self, "attn_dp") or not self.attn_dp or not all(ok.values()):
            return
        w, a = self.world_size, self.attn_tp_size
        before = len(c.errors)
        if a >= w:
            c.fail(
                "attn_dp",
                f"needs attn_tp_size < world_size (attn_dp_size = world_size / attn_tp_size = "
                f"{w} / {a}); with attn_tp_size == world_size there is one attention group",
            )
        if self.moe_tp_size != 1:
            c.fail(
                "attn_dp",
                f"needs moe_tp_size 1 (got {self.moe_tp_size}): each rank holds its own tokens, so the "
                f"MoE is expert parallel over every rank (moe_ep_size == world_size)",
            )
        if a % self.embed_tp_size:
            c.fail(
                "attn_dp",
                f"needs embed_tp_size ({self.embed_tp_size}) to divide attn_tp_size ({a}): an embedding "
                f"group must look up the tokens of one attention DP group",
            )
        if self.prefill_opt:
            c.fail(
                "prefill_opt",
                "cannot be combined with attn_dp: the sequence-parallel prefill needs "
                "attn_tp_size == world_size; under attention DP the prefill already splits each DP "
                "group's tokens over its attention TP ranks",
            )
        if self.derived("attn_dp") and len(c.errors) > before:
            c.fail(
                "attn_dp",
                f"attention DP follows from attn_tp_size ({a}) < world_size ({w}), as the recipe "
                f"derives attn_dp_size = {w // a}; set attn_dp: false for replicated attention instead "
                f"(every attention TP group then runs the whole batch)",
            )

    def validate(self) -> "ParallelConfig":
        errors: list[tuple[str, str]] = []
        self._check(_Checker("parallel_config", errors))
        if errors:
            raise ConfigError(errors)
        return self


@dataclass
class SchedulerConfig:
    batch_size: int = 1
    max_new_tokens: int = 32
    block_size: int = 128
    max_prefill_tokens: int = 0  # prompt tokens one prefill step packs at most (0: every prompt at once)
    mem_fraction_static: float = 0.85  # share of the device memory the weights and the KV cache may take
    num_reserved_decode_tokens: int = 64  # the recipe's online PD decode admission reserve (offline runs ignore it)
    enable_prefix_caching: bool = False  # serve: reuse the KV of cached full-block prompt prefixes
    enable_chunked_prefill: bool = False  # prompts prefilled in chunks, in steps that also carry decode rows
    max_num_batched_tokens: int = 2048  # with enable_chunked_prefill: tokens one step carries per DP group
    async_scheduling: bool = False  # a decode step is scheduled and launched before the previous one is read back

    def _check(self, c: _Checker) -> None:
        for k in ("batch_size", "max_new_tokens", "block_size"):
            c.positive_int(self, k)
        c.non_negative_int(self, "max_prefill_tokens")
        c.non_negative_int(self, "num_reserved_decode_tokens")
        c.boolean(self, "enable_prefix_caching")
        c.boolean(self, "async_scheduling")
        c.positive_int(self, "max_num_batched_tokens")
        if c.boolean(self, "enable_chunked_prefill") and self.enable_chunked_prefill:
            if _is_int(self.max_prefill_tokens) and self.max_prefill_tokens:
                c.fail(
                    "max_prefill_tokens",
                    "budgets unchunked prefill steps; with enable_chunked_prefill the step budget is "
                    "max_num_batched_tokens: set max_prefill_tokens to 0",
                )
            if _is_int(self.batch_size) and _is_int(self.max_num_batched_tokens):
                if self.max_num_batched_tokens < self.batch_size:
                    c.fail(
                        "max_num_batched_tokens",
                        f"{self.max_num_batched_tokens} is less than batch_size={self.batch_size}: every decode row "
                        "needs its token in each step",
                    )
        f = self.mem_fraction_static
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            c.fail("mem_fraction_static", f"must be a number in (0, 1], got {_describe(f)}")


SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "data_config": DataConfig,
    "parallel_config": ParallelConfig,
    "scheduler_config": SchedulerConfig,
}


def _allowed(cls) -> list[str]:
    return [f.name for f in fields(cls)]


# The recipe's older files put a few keys at the top level and max_new_tokens / batch_size in data_config; its
# runner read them from there. They are folded into the sections that hold them now.
FLAT_KEYS = {
    "model_name": "model_config",
    "model_path": "model_config",
    "exe_mode": "model_config",
    "world_size": "parallel_config",
}
MOVED_KEYS = {("data_config", "max_new_tokens"): "scheduler_config", ("data_config", "batch_size"): "scheduler_config"}


def _fold_flat_layout(d: dict, errors: list[tuple[str, str]]) -> dict:
    """`d` with the older flat layout's keys moved into their sections; a key given in both places is an error."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items() if k not in FLAT_KEYS}
    moves = [(k, None, FLAT_KEYS[k], d[k]) for k in FLAT_KEYS if k in d]
    moves += [
        (key, old, new, out[old].pop(key))
        for (old, key), new in MOVED_KEYS.items()
        if isinstance(out.get(old), dict) and key in out[old]
    ]
    for key, old, new, value in moves:
        section = out.setdefault(new, {})
        if section is None:
            section = out[new] = {}
        if not isinstance(section, dict):
            continue  # the section's own error follows
        where = f"{old}.{key}" if old else f"top-level {key}"
        if key in section:
            errors.append((f"{new}.{key}", f"given twice: here and as {where} (the recipe's older layout); keep one"))
            continue
        section[key] = value
    return out


# ----------------------------------------------------------------------------------------------- config


@dataclass
class InferenceConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    # ---- construction
    @classmethod
    def from_dict(cls, d: dict | None, *, source: str | None = None) -> "InferenceConfig":
        """Build and validate (file-only rules). Raises ConfigError naming every bad dotted key."""
        errors: list[tuple[str, str]] = []
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError([("<top level>", f"must be a mapping of sections, got {_describe(d)}")], source)
        d = _fold_flat_layout(d, errors)
        sections: dict[str, Any] = {}
        for name, value in d.items():
            if name not in SECTIONS:
                errors.append((str(name), f"unknown section; allowed sections: {', '.join(SECTIONS)}"))
                continue
            if value is None:
                value = {}
            if not isinstance(value, dict):
                errors.append((name, f"must be a mapping, got {_describe(value)}"))
                continue
            sec_cls = SECTIONS[name]
            allowed = _allowed(sec_cls)
            unknown = [k for k in value if k not in allowed]
            for k in unknown:
                errors.append((f"{name}.{k}", f"unknown key; allowed keys: {', '.join(allowed)}"))
            sections[name] = sec_cls(**{k: v for k, v in value.items() if k in allowed})
        cfg = cls(**sections)
        for name in SECTIONS:
            getattr(cfg, name)._check(_Checker(name, errors))
        if not errors:
            cfg._check_attn_dp_batch(errors)
            cfg._check_graph_batch_sizes(errors)
        if errors:
            raise ConfigError(errors, source)
        return cfg

    def _check_attn_dp_batch(self, errors: list[tuple[str, str]]) -> None:
        """Rules across sections for attention DP: the batch splits evenly over the DP groups (the recipe's rule)."""
        p, s = self.parallel_config, self.scheduler_config
        dp = p.attn_dp_size
        if dp > 1 and s.batch_size % dp:
            errors.append(
                (
                    "scheduler_config.batch_size",
                    f"({s.batch_size}) must be a multiple of attn_dp_size = "
                    f"world_size / attn_tp_size = {dp} (parallel_config.attn_dp)",
                )
            )

    def _check_graph_batch_sizes(self, errors: list[tuple[str, str]]) -> None:
        """The largest captured decode batch holds a DP group's share of batch_size (a decode step never runs a
        batch no graph was captured for)."""
        sizes, dp = self.model_config.graph_batch_sizes, self.parallel_config.attn_dp_size
        share = -(-self.scheduler_config.batch_size // dp)
        if sizes is not None and max(sizes) < share:
            whose = f"a DP group's share of scheduler_config.batch_size ({share}, over {dp} groups)" if dp > 1 else ""
            errors.append(
                (
                    "model_config.graph_batch_sizes",
                    f"the largest ({max(sizes)}) must be at least {whose or f'scheduler_config.batch_size ({share})'}"
                    f": add a size of {share} or more",
                )
            )

    @classmethod
    def from_yaml(cls, path: str | Path) -> "InferenceConfig":
        path = Path(path)
        try:
            data = load_yaml(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError([("<yaml>", f"not valid YAML: {e}")], str(path)) from e
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---- model-dependent rules
    def validate_for_model(self, hf_config) -> "InferenceConfig":
        """Check the parallel layout against a Qwen3-MoE config (transformers `Qwen3MoeConfig` or alike).

        Rules: num_attention_heads % attn_tp_size == 0; KV heads either split evenly over attention-TP
        ranks or are replicated (attn_tp_size % num_key_value_heads == 0); moe_intermediate_size %
        moe_tp_size == 0; num_experts % moe_ep_size == 0; vocab_size % embed_tp_size == 0 and
        vocab_size % lmhead_tp_size == 0 (vocab padding is not implemented); intermediate_size %
        moe_tp_size == 0 when the (possibly truncated) model has dense MLP layers (the dense MLP is
        sharded over the moe_tp group); num_hidden_layers override <= the checkpoint's layers when
        with_ckpt.
        """
        p, m = self.parallel_config, self.model_config
        errors: list[tuple[str, str]] = []
        pc, mc = "parallel_config", "model_config"

        def div(key: str, attr: str, size: int, extra: str = "") -> None:
            total = getattr(hf_config, attr)
            if total % size:
                errors.append((f"{pc}.{key}", f"model {attr} ({total}) must be divisible by {key} ({size}){extra}"))

        div("attn_tp_size", "num_attention_heads", p.attn_tp_size)
        kv = hf_config.num_key_value_heads
        if kv % p.attn_tp_size and p.attn_tp_size % kv:
            errors.append(
                (
                    f"{pc}.attn_tp_size",
                    f"model num_key_value_heads ({kv}) must be divisible by attn_tp_size ({p.attn_tp_size}), "
                    f"or attn_tp_size must be a multiple of it (KV heads are then replicated)",
                )
            )
        div("moe_tp_size", "moe_intermediate_size", p.moe_tp_size)
        if not p.enable_eplb:  # with expert load balancing the physical slots split (num_redundant_experts)
            div("moe_ep_size", "num_experts", p.moe_ep_size)
        no_pad = " (padding the vocabulary is not implemented)"
        div("embed_tp_size", "vocab_size", p.embed_tp_size, no_pad)
        div("lmhead_tp_size", "vocab_size", p.lmhead_tp_size, no_pad)
        n_layers = m.num_hidden_layers or hf_config.num_hidden_layers
        if m.num_hidden_layers is not None and m.with_ckpt and m.num_hidden_layers > hf_config.num_hidden_layers:
            errors.append(
                (
                    f"{mc}.num_hidden_layers",
                    f"({m.num_hidden_layers}) must not exceed the checkpoint's num_hidden_layers "
                    f"({hf_config.num_hidden_layers}) when with_ckpt is true",
                )
            )
        if dense_layers(hf_config, n_layers):
            div(
                "moe_tp_size",
                "intermediate_size",
                p.moe_tp_size,
                " (the dense MLP layers are sharded over the moe_tp group)",
            )
        if p.enable_eplb:
            slots = hf_config.num_experts + p.num_redundant_experts
            if slots % p.moe_ep_size:
                errors.append(
                    (
                        f"{pc}.num_redundant_experts",
                        f"num_experts + num_redundant_experts = {hf_config.num_experts} + {p.num_redundant_experts} "
                        f"= {slots} physical experts must be divisible by moe_ep_size ({p.moe_ep_size})",
                    )
                )
            if m.eplb:
                errors.append(
                    (f"{pc}.enable_eplb", "cannot be combined with model_config.force_eplb (it replaces routing)")
                )
            if m.exe_mode in GRAPH_MODES:
                errors.append(
                    (
                        f"{pc}.enable_eplb",
                        f"is implemented for exe_mode eager only (model_config.exe_mode: {m.exe_mode}): its "
                        "routed-token counts and rebalances are not captured in graphs",
                    )
                )
        if m.eplb:
            batch = self.scheduler_config.batch_size
            if m.exe_mode in GRAPH_MODES:  # graph decode pads the batch to its bucket, up to the largest
                from optimized.forward_metadata import batch_bucket  # (imports torch: this module does not)

                batch = max(m.graph_batch_sizes) if m.graph_batch_sizes else batch_bucket(batch)
            why = check_force_eplb(hf_config.num_experts, hf_config.num_experts_per_tok, p.moe_tp_size, batch)
            if why:
                errors.append(
                    (
                        f"{mc}.{'force_eplb' if m.force_eplb is not None else 'perfect_eplb'}",
                        f"{why} (B: scheduler_config.batch_size"
                        f"{', padded to its graph bucket' if m.exe_mode in GRAPH_MODES else ''})",
                    )
                )
        if errors:
            raise ConfigError(errors)
        return self


def check_force_eplb(num_experts: int, top_k: int, moe_tp_size: int, decode_batch: int | None = None) -> str | None:
    """Why model_config.force_eplb cannot give valid expert ids for these sizes (None: it can); the rules of
    optimized/layers/force_eplb.py."""
    if top_k > num_experts:
        return (
            f"needs num_experts_per_tok ({top_k}) <= num_experts ({num_experts}): the balanced ids of one token "
            f"are distinct experts"
        )
    if moe_tp_size > 1 and decode_batch is not None and decode_batch * top_k > num_experts:
        return (
            f"with moe_tp_size > 1 a decode step of B tokens routes them to experts 0 .. B*top_k - 1 (the recipe's "
            f"rule), so B * num_experts_per_tok must be <= num_experts: B = {decode_batch}, top_k = {top_k}, "
            f"num_experts = {num_experts} (B <= {num_experts // top_k})"
        )
    return None


def is_sparse_layer(hf_config, layer_idx: int) -> bool:
    """HF Qwen3-MoE's rule: a MoE layer unless listed in mlp_only_layers or off the decoder_sparse_step."""
    only = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return layer_idx not in only and getattr(hf_config, "num_experts", 0) > 0 and (layer_idx + 1) % step == 0


def dense_layers(hf_config, num_layers: int | None = None) -> list[int]:
    """Indices of decoder layers with a dense MLP."""
    n = num_layers if num_layers is not None else hf_config.num_hidden_layers
    return [i for i in range(n) if not is_sparse_layer(hf_config, i)]


def head_dim_of(hf_config) -> int:
    """The attention head size: `head_dim`, or hidden_size // num_attention_heads where the config has none
    (transformers' rule)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
