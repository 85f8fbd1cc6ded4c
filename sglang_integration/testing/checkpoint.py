"""Real checkpoints, made here: a tiny Qwen3-MoE or DeepSeek-V3 from seeded random weights.

    python -m sglang_integration.testing.checkpoint write DIR --model {qwen3_moe,deepseek_v3} \\
        [--seed N] [--dtype {bf16,fp8_block}] [--num-layers L] [--num-experts E]

writes, into a new or empty ``DIR``, what a Hugging Face checkpoint of that architecture holds
and what sglang's own loader reads: ``config.json``, ``model.safetensors.index.json`` and two
safetensors shards with the model's real tensor names (``model.layers.L.mlp.experts.E.gate_proj
.weight`` ...). ``fp8_block`` (DeepSeek-V3 only) stores every linear layer's weight as
``float8_e4m3fn`` with its ``weight_scale_inv`` (128 x 128 blocks) and the config's
``quantization_config``, as DeepSeek-V3's released checkpoint does. The sizes are the smallest
sglang builds with 2 tensor-parallel ranks (FP8 blocks need 128-wide partitions); every routed
expert's tensors are distinct unless ``tied`` (Python API) makes two of a layer equal. The
command refuses a non-empty ``DIR`` (exit 2), so it never overwrites a checkpoint.

``read_tensors`` reads tensors back by name through the index (what the judge of slots,
``checkpoint_experts``, compares with).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_integration.testing.model_errors import CheckpointError

MODELS = ("qwen3_moe", "deepseek_v3")
DTYPES = ("bf16", "fp8_block")
INDEX_FILE = "model.safetensors.index.json"
NUM_SHARDS = 2
BLOCK = 128  # the FP8 block of DeepSeek-V3's checkpoint: 128 x 128 weights share one scale

DEFAULT_NUM_LAYERS = 3
DEFAULT_NUM_EXPERTS = 8


@dataclass(frozen=True)
class CheckpointSpec:
    """What to write: the architecture, the weights' dtype, the seed and the small geometry."""

    model: str
    dtype: str = "bf16"
    seed: int = 0
    num_layers: int = DEFAULT_NUM_LAYERS
    num_experts: int = DEFAULT_NUM_EXPERTS
    # (layer, expert, same_as): expert's tensors are a copy of same_as's (tied experts).
    tied: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise CheckpointError(f"unknown model {self.model!r}; pass one of {', '.join(MODELS)}")
        if self.dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {self.dtype!r}; pass one of {', '.join(DTYPES)}")
        if self.dtype == "fp8_block" and self.model != "deepseek_v3":
            raise CheckpointError(
                "--dtype fp8_block is written for --model deepseek_v3 only (DeepSeek-V3 is the "
                "architecture released with FP8 block weights); use bf16 for qwen3_moe"
            )
        least = 2 if self.model == "deepseek_v3" else 1  # DeepSeek-V3's first layer is dense
        if self.num_layers < least or self.num_experts < 2:
            raise CheckpointError(
                f"{self.model} needs at least {least} layers and 2 experts, got "
                f"{self.num_layers} layers and {self.num_experts} experts"
            )
        for layer, expert, same_as in self.tied:
            if not (
                self.first_moe_layer <= layer < self.num_layers
                and 0 <= expert < self.num_experts
                and 0 <= same_as < self.num_experts
                and expert != same_as
            ):
                raise CheckpointError(f"tied ({layer}, {expert}, {same_as}) is outside the model")

    @property
    def first_moe_layer(self) -> int:
        return 1 if self.model == "deepseek_v3" else 0

    @property
    def moe_layers(self) -> range:
        return range(self.first_moe_layer, self.num_layers)


# The sizes of each architecture (hidden, heads, MoE intermediate...): the smallest that sglang
# builds on 2 tensor-parallel ranks; DeepSeek-V3's are multiples of the 128-wide FP8 block per rank.
QWEN3_SIZES = {
    "hidden": 64,
    "heads": 2,
    "kv_heads": 1,
    "head_dim": 16,
    "moe_inter": 32,
    "vocab": 64,
}
DEEPSEEK_SIZES = {
    "hidden": 128,
    "heads": 4,
    "q_lora": 128,
    "kv_lora": 128,
    "nope": 64,
    "rope": 64,
    "v_head": 64,
    "inter": 256,
    "moe_inter": 256,
    "vocab": 64,
}


def model_config(spec: CheckpointSpec) -> dict[str, Any]:
    """The ``config.json`` of ``spec`` (Hugging Face's field names for the architecture)."""
    if spec.model == "qwen3_moe":
        s = QWEN3_SIZES
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": s["hidden"],
            "intermediate_size": 2 * s["hidden"],
            "moe_intermediate_size": s["moe_inter"],
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv_heads"],
            "head_dim": s["head_dim"],
            "num_experts": spec.num_experts,
            "num_experts_per_tok": 2,
            "vocab_size": s["vocab"],
            "max_position_embeddings": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        }
    s = DEEPSEEK_SIZES
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "moe_intermediate_size": s["moe_inter"],
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["heads"],
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": spec.first_moe_layer,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": s["q_lora"],
        "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["v_head"],
        "vocab_size": s["vocab"],
        # sglang's rotary factory builds DeepSeek-V3's rope only with yarn scaling.
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if spec.dtype == "fp8_block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }
    return config


class _Weights:
    """The tensors of one checkpoint, drawn in a fixed order from one seeded generator."""

    def __init__(self, spec: CheckpointSpec) -> None:
        import torch

        self.spec = spec
        self.torch = torch
        self.generator = torch.Generator().manual_seed(spec.seed)
        self.tensors: dict[str, Any] = {}

    def vector(self, name: str, size: int) -> None:
        torch = self.torch
        self.tensors[name] = torch.randn(size, generator=self.generator).to(torch.bfloat16)

    def linear(self, name: str, out_features: int, in_features: int) -> None:
        """``name.weight`` (and with FP8 blocks its ``name.weight_scale_inv``)."""
        torch = self.torch
        weight = torch.randn(out_features, in_features, generator=self.generator)
        if self.spec.dtype == "fp8_block":
            self.tensors[f"{name}.weight"] = weight.to(torch.float8_e4m3fn)
            blocks = (math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK))
            scale = torch.rand(blocks, generator=self.generator) + 0.5
            self.tensors[f"{name}.weight_scale_inv"] = scale
        else:
            self.tensors[f"{name}.weight"] = weight.to(torch.bfloat16)

    def plain(self, name: str, *shape: int) -> None:
        """A tensor no quantization touches (embeddings, the router)."""
        torch = self.torch
        self.tensors[name] = torch.randn(*shape, generator=self.generator).to(torch.bfloat16)

    def tie(self, layer: int, expert: int, same_as: int) -> None:
        prefix = f"model.layers.{layer}.mlp.experts."
        for name in [n for n in self.tensors if n.startswith(f"{prefix}{same_as}.")]:
            copy = f"{prefix}{expert}." + name.removeprefix(f"{prefix}{same_as}.")
            self.tensors[copy] = self.tensors[name].clone()


def checkpoint_tensors(spec: CheckpointSpec) -> dict[str, Any]:
    """Every tensor of the checkpoint by its name, from ``spec.seed``."""
    weights = _Weights(spec)
    moe_inter = (QWEN3_SIZES if spec.model == "qwen3_moe" else DEEPSEEK_SIZES)["moe_inter"]
    hidden = (QWEN3_SIZES if spec.model == "qwen3_moe" else DEEPSEEK_SIZES)["hidden"]
    vocab = QWEN3_SIZES["vocab"] if spec.model == "qwen3_moe" else DEEPSEEK_SIZES["vocab"]
    weights.plain("model.embed_tokens.weight", vocab, hidden)
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        weights.vector(prefix + "input_layernorm.weight", hidden)
        weights.vector(prefix + "post_attention_layernorm.weight", hidden)
        _attention(weights, spec, prefix + "self_attn.")
        if layer < spec.first_moe_layer:
            inter = DEEPSEEK_SIZES["inter"]
            weights.linear(prefix + "mlp.gate_proj", inter, hidden)
            weights.linear(prefix + "mlp.up_proj", inter, hidden)
            weights.linear(prefix + "mlp.down_proj", hidden, inter)
            continue
        weights.plain(prefix + "mlp.gate.weight", spec.num_experts, hidden)
        if spec.model == "deepseek_v3":
            torch = weights.torch
            bias = torch.randn(spec.num_experts, generator=weights.generator)
            weights.tensors[prefix + "mlp.gate.e_score_correction_bias"] = bias
            for part in ("gate_proj", "up_proj"):
                weights.linear(prefix + f"mlp.shared_experts.{part}", moe_inter, hidden)
            weights.linear(prefix + "mlp.shared_experts.down_proj", hidden, moe_inter)
        for expert in range(spec.num_experts):
            expert_prefix = prefix + f"mlp.experts.{expert}."
            weights.linear(expert_prefix + "gate_proj", moe_inter, hidden)
            weights.linear(expert_prefix + "up_proj", moe_inter, hidden)
            weights.linear(expert_prefix + "down_proj", hidden, moe_inter)
    weights.vector("model.norm.weight", hidden)
    weights.plain("lm_head.weight", vocab, hidden)
    for layer, expert, same_as in spec.tied:
        weights.tie(layer, expert, same_as)
    return weights.tensors


def _attention(weights: _Weights, spec: CheckpointSpec, prefix: str) -> None:
    if spec.model == "qwen3_moe":
        s = QWEN3_SIZES
        weights.linear(prefix + "q_proj", s["heads"] * s["head_dim"], s["hidden"])
        weights.linear(prefix + "k_proj", s["kv_heads"] * s["head_dim"], s["hidden"])
        weights.linear(prefix + "v_proj", s["kv_heads"] * s["head_dim"], s["hidden"])
        weights.linear(prefix + "o_proj", s["hidden"], s["heads"] * s["head_dim"])
        weights.vector(prefix + "q_norm.weight", s["head_dim"])
        weights.vector(prefix + "k_norm.weight", s["head_dim"])
        return
    s = DEEPSEEK_SIZES
    weights.linear(prefix + "q_a_proj", s["q_lora"], s["hidden"])
    weights.vector(prefix + "q_a_layernorm.weight", s["q_lora"])
    weights.linear(prefix + "q_b_proj", s["heads"] * (s["nope"] + s["rope"]), s["q_lora"])
    weights.linear(prefix + "kv_a_proj_with_mqa", s["kv_lora"] + s["rope"], s["hidden"])
    weights.vector(prefix + "kv_a_layernorm.weight", s["kv_lora"])
    weights.linear(prefix + "kv_b_proj", s["heads"] * (s["nope"] + s["v_head"]), s["kv_lora"])
    weights.linear(prefix + "o_proj", s["hidden"], s["heads"] * s["v_head"])


def shard_of(name: str) -> int:
    """The shard a tensor is written to: a layer's tensors by the layer's parity, others 0."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]) % NUM_SHARDS
    return 0


def shard_file(index: int) -> str:
    return f"model-{index + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"


def write_checkpoint(directory: str | Path, spec: CheckpointSpec) -> Path:
    """Write ``spec``'s checkpoint into ``directory`` (created; refused when not empty)."""
    from safetensors.torch import save_file

    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} is not an empty directory; pass a new or empty directory (a checkpoint "
            "is never overwritten)"
        )
    target.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(spec)
    shards: list[dict[str, Any]] = [{} for _ in range(NUM_SHARDS)]
    weight_map = {}
    for name, tensor in tensors.items():
        shards[shard_of(name)][name] = tensor.contiguous()
        weight_map[name] = shard_file(shard_of(name))
    total = 0
    for index, shard in enumerate(shards):
        save_file(shard, str(target / shard_file(index)), metadata={"format": "pt"})
        total += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
    index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (target / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
    # config.json last: its presence means the checkpoint is complete.
    (target / "config.json").write_text(json.dumps(model_config(spec), indent=2) + "\n")
    return target


def read_tensors(directory: str | Path, names: Sequence[str]) -> dict[str, Any]:
    """The named tensors of a checkpoint, through its index (``CheckpointError`` when absent)."""
    from safetensors import safe_open

    root = Path(directory)
    try:
        index = json.loads((root / INDEX_FILE).read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{root / INDEX_FILE} cannot be read as a safetensors index ({exc}); write the "
            "checkpoint with python -m sglang_integration.testing.checkpoint write"
        ) from None
    by_file: dict[str, list[str]] = {}
    for name in names:
        file = weight_map.get(name) if isinstance(weight_map, dict) else None
        if not isinstance(file, str) or "/" in file or file.startswith("."):
            raise CheckpointError(f"the checkpoint in {root} has no tensor {name!r} in its index")
        by_file.setdefault(file, []).append(name)
    found: dict[str, Any] = {}
    for file, wanted in by_file.items():
        with safe_open(str(root / file), framework="pt") as handle:
            for name in wanted:
                found[name] = handle.get_tensor(name)
    return found


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}/config.json cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory}/config.json is not a JSON object")
    return config


def forward_runs_on_cpu(directory: str | os.PathLike[str]) -> bool:
    """Whether sglang's forward pass of this checkpoint runs on a CPU: plain BF16 or float32
    weights do (torch matmuls); FP8 blocks (a ``quantization_config``) do not, their block
    matmuls are triton kernels."""
    return "quantization_config" not in read_config(directory)


def describe(spec: CheckpointSpec) -> str:
    moe = len(spec.moe_layers)
    return (
        f"{spec.model} {spec.dtype}, {spec.num_layers} layers ({moe} MoE), "
        f"{spec.num_experts} routed experts, seed {spec.seed}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_integration.testing.checkpoint",
        description="Write a tiny real checkpoint (config, safetensors index and shards) from "
        "seeded random weights.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    write = verbs.add_parser("write", help="write a checkpoint into a new or empty directory")
    write.add_argument("directory", metavar="DIR")
    write.add_argument("--model", required=True, choices=MODELS)
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--dtype", choices=DTYPES, default="bf16")
    write.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS)
    write.add_argument("--num-experts", type=int, default=DEFAULT_NUM_EXPERTS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = CheckpointSpec(
            model=args.model,
            dtype=args.dtype,
            seed=args.seed,
            num_layers=args.num_layers,
            num_experts=args.num_experts,
        )
        target = write_checkpoint(args.directory, spec)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}: {describe(spec)}")
    return 0


def names_of_expert(layer: int, expert: int) -> Iterator[str]:
    """The checkpoint names of one routed expert's projections (without suffix)."""
    for part in ("gate_proj", "up_proj", "down_proj"):
        yield f"model.layers.{layer}.mlp.experts.{expert}.{part}"


if __name__ == "__main__":
    sys.exit(main())
