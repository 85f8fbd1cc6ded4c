"""What a slot holds, judged against the checkpoint: an expert, tied, zero, partial or unknown.

"Slot s holds expert e" is true when every routed-expert tensor of the slot equals checkpoint
expert ``e`` as sglang's loader places it (``expected_tensors``): gate and up projections fused
into ``w13_weight`` (gate first, then up: ``FusedMoE._load_w13``, ``UPSTREAM_LINES``), the down
projection as ``w2_weight``, and with FP8 blocks their ``weight_scale_inv`` the same way beside
them (``w13_weight_scale_inv``, ``w2_weight_scale_inv``). Nothing is read from the bytes but
the bytes: a slot equal to several experts holds experts that are tied (the same bytes); a slot
whose every value is zero (+0.0 or -0.0) is zero-filled; any other slot is described part by
part by the fingerprints of the checkpoint's experts (``partial: parts 0-1 of expert 6, parts
2-3 of expert 5``, as ``layout_ledger.core.content`` words it) or is unknown content.

``judge_layer`` judges one layer's local slots; ``judge_routed`` every layer of a daemon's
shared routed weights (``routed_weights``), which is what every engine on that daemon maps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sglang_integration.testing.checkpoint import read_tensors
from sglang_integration.testing.model_errors import CheckpointError
from sglang_integration.upstream_lines import UpstreamLine

_LAYER_FILE = "srt/layers/moe/fused_moe_triton/layer.py"
# How sglang's FusedMoE loader places a checkpoint expert into a slot (tests/test_upstream_lines.py
# checks the lines).
UPSTREAM_LINES = (
    UpstreamLine(
        _LAYER_FILE,
        816,
        "# w1, gate_proj: Load into first logical weight of w13.",
        "the gate projection fills the first half of w13",
    ),
    UpstreamLine(
        _LAYER_FILE,
        817,
        "# w3, up_proj: Load into second logical weight of w13.",
        "the up projection fills the second half",
    ),
    UpstreamLine(
        _LAYER_FILE,
        1818,
        '("w1", ckpt_gate_proj_name),',
        "make_expert_params_mapping: gate is shard w1, down w2, up w3",
    ),
)

# Per routed tensor name: the checkpoint projections it holds, in order along its first axis,
# and the suffix of their checkpoint tensors.
PLACEMENT: dict[str, tuple[tuple[str, ...], str]] = {
    "w13_weight": (("gate_proj", "up_proj"), "weight"),
    "w2_weight": (("down_proj",), "weight"),
    "w13_weight_scale_inv": (("gate_proj", "up_proj"), "weight_scale_inv"),
    "w2_weight_scale_inv": (("down_proj",), "weight_scale_inv"),
}


@dataclass(frozen=True)
class SlotContent:
    """What one slot holds: whole checkpoint experts (several when tied), or ``text`` only."""

    experts: tuple[int, ...]
    text: str

    def holds(self, expert: int) -> bool:
        return expert in self.experts


class CheckpointExperts:
    """A checkpoint's routed experts, each as sglang's loader places it in one slot."""

    def __init__(self, checkpoint: str | Path) -> None:
        self.checkpoint = Path(checkpoint)
        self._expected: dict[tuple[int, int, tuple[str, ...]], list[Any]] = {}
        self._contents: dict[tuple[int, tuple[str, ...], tuple[str, ...]], Any] = {}

    def expected_tensors(
        self, layer: int, expert: int, names: Sequence[str], dtypes: Sequence[Any] = ()
    ) -> list[Any]:
        """Expert ``expert`` of ``layer`` as one slot of the routed tensors ``names``; with
        ``dtypes`` (one per name), each in the slot's dtype where the checkpoint's widens into
        it losslessly (a model loaded in float32 from a BF16 checkpoint: sglang's loader casts
        the same way), else as stored."""
        import torch

        if dtypes:
            stored = self.expected_tensors(layer, expert, names)
            return [_widened(t, dtype) for t, dtype in zip(stored, dtypes, strict=True)]
        key = (layer, expert, tuple(names))
        found = self._expected.get(key)
        if found is not None:
            return found
        unknown = [name for name in names if name not in PLACEMENT]
        if unknown:
            raise CheckpointError(
                f"routed tensors {unknown} have no known placement; the judge knows "
                f"{sorted(PLACEMENT)}"
            )
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        wanted = [
            f"{prefix}{projection}.{PLACEMENT[name][1]}"
            for name in names
            for projection in PLACEMENT[name][0]
        ]
        tensors = read_tensors(self.checkpoint, wanted)
        found = []
        for name in names:
            projections, suffix = PLACEMENT[name]
            parts = [tensors[f"{prefix}{projection}.{suffix}"] for projection in projections]
            found.append(torch.cat(parts, dim=0))
        self._expected[key] = found
        return found

    def judge_layer(
        self, layer: int, tensors: Sequence[Any], names: Sequence[str], num_experts: int
    ) -> list[SlotContent]:
        """What each local slot of one layer holds (``tensors``: the layer's routed tensors,
        first dimension the local slots, named ``names``)."""
        import torch

        dtypes = [t.dtype for t in tensors]
        experts = [
            [_raw(t) for t in self.expected_tensors(layer, e, names, dtypes)]
            for e in range(num_experts)
        ]
        first = self.expected_tensors(layer, 0, names, dtypes)
        for t, expected in zip(tensors, first, strict=True):
            if tuple(t.shape[1:]) != tuple(expected.shape) or t.dtype != expected.dtype:
                raise CheckpointError(
                    f"layer {layer}: a slot's tensor is {tuple(t.shape[1:])} {t.dtype}, the "
                    f"checkpoint's expert is {tuple(expected.shape)} {expected.dtype}: is this "
                    "the checkpoint the daemon loaded?"
                )
        judged = []
        for slot in range(tensors[0].shape[0]):
            held = [_raw(t[slot]) for t in tensors]
            equal = tuple(
                e
                for e, expected in enumerate(experts)
                if all(torch.equal(a, b) for a, b in zip(held, expected, strict=True))
            )
            if equal:
                names_text = "/".join(str(e) for e in equal)
                text = f"expert {equal[0]}" if len(equal) == 1 else f"experts {names_text} (tied)"
                judged.append(SlotContent(equal, text))
            elif all(bool((t[slot].float() == 0).all()) for t in tensors):
                judged.append(SlotContent((), _zero_filled()))
            else:
                slot_tensors = [t[slot] for t in tensors]
                text = self._described(layer, slot_tensors, names, num_experts, dtypes)
                judged.append(SlotContent((), text))
        return judged

    def _described(
        self,
        layer: int,
        held: Sequence[Any],
        names: Sequence[str],
        num_experts: int,
        dtypes: Sequence[Any],
    ) -> str:
        """A slot that is no whole expert, part by part (the fingerprints' words)."""
        from layout_ledger.core.content import ExpertContents
        from sglang_integration.content.fingerprints import fingerprint_hex, fingerprint_slots

        key = (layer, tuple(names), tuple(str(dtype) for dtype in dtypes))
        contents = self._contents.get(key)
        if contents is None:
            contents = ExpertContents()
            for expert in range(num_experts):
                expected = self.expected_tensors(layer, expert, names, dtypes)
                slot = [t.unsqueeze(0) for t in expected]
                fingerprint = fingerprint_hex(fingerprint_slots(slot, 1))[0]
                contents.learn(layer, expert, fingerprint, f"checkpoint expert {expert}")
            self._contents[key] = contents
        fingerprint = fingerprint_hex(fingerprint_slots([t.unsqueeze(0) for t in held], 1))[0]
        return str(contents.identify(layer, fingerprint).text)

    def judge_routed(
        self,
        routed: Mapping[int, Sequence[Any]],
        names: Mapping[int, Sequence[str]],
        num_experts: int,
    ) -> dict[int, list[SlotContent]]:
        """Every layer of ``routed`` (``RoutedWeights.routed_experts_weights_of_layer``)."""
        return {
            layer: self.judge_layer(layer, routed[layer], names[layer], num_experts)
            for layer in sorted(routed)
        }


def _widened(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in ``dtype`` when that is a wider float (16-bit into float32), else as is."""
    import torch

    if dtype == torch.float32 and tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.to(dtype)
    return tensor


def _raw(tensor: Any) -> Any:
    """A tensor's bytes (compared as bytes: the same bytes are the same expert, whatever the
    dtype's notion of equal values; and a byte compare is fast for every dtype)."""
    import torch

    return tensor.contiguous().view(-1).view(torch.uint8)


def _zero_filled() -> str:
    from layout_ledger.core.content import ZERO_FILLED

    return str(ZERO_FILLED)


def slots_holding(
    judged: Mapping[int, Sequence[SlotContent]], first_slot: int
) -> dict[tuple[int, int], set[int]]:
    """Per (layer, expert), the global slots whose bytes hold that checkpoint expert."""
    found: dict[tuple[int, int], set[int]] = {}
    for layer, contents in judged.items():
        for local, content in enumerate(contents):
            for expert in content.experts:
                found.setdefault((layer, expert), set()).add(first_slot + local)
    return found


def count_matching(
    judged: Mapping[int, Sequence[SlotContent]],
    physical_to_logical_map: Sequence[Sequence[int]],
    first_slot: int,
) -> int:
    """How many judged slots hold the expert the map names there."""
    return sum(
        int(content.holds(int(physical_to_logical_map[layer][first_slot + local])))
        for layer, contents in judged.items()
        for local, content in enumerate(contents)
    )


def num_routed_experts(config: Mapping[str, Any]) -> int:
    """The routed experts of a checkpoint's ``config.json`` (Qwen3-MoE's or DeepSeek-V3's field)."""
    for field in ("num_experts", "n_routed_experts"):
        value = config.get(field)
        if isinstance(value, int) and value > 0:
            return value
    raise CheckpointError("config.json names no routed experts (num_experts, n_routed_experts)")


class RoutedTensors(Protocol):
    """One rank's routed-expert tensors by MoE layer, named, and where its slots start."""

    @property
    def routed_experts_weights_of_layer(self) -> dict[int, list[Any]]: ...

    @property
    def names(self) -> dict[int, list[str]]: ...

    @property
    def first_slot(self) -> int: ...

    @property
    def num_local_slots(self) -> int: ...


class ModelExperts:
    """One rank's real routed experts judged against the checkpoint: a daemon's, mapped from its
    shared file (``of_daemon``), or any tensors in that shape (``routed_experts_weights_of_layer``,
    ``names``, ``first_slot``, ``num_local_slots``: an engine's own, ``engine_model``); what
    ``shared_experts.SharedExperts`` is for the synthetic stand-in (``count_matching_slots``,
    ``slot_count``)."""

    def __init__(self, weights: RoutedTensors, checkpoint: str | Path) -> None:
        from sglang_integration.testing.checkpoint import read_config

        self.weights = weights
        self.judge = CheckpointExperts(checkpoint)
        self.num_experts = num_routed_experts(read_config(checkpoint))

    @classmethod
    def of_daemon(cls, socket_path: str, checkpoint: str | Path) -> ModelExperts:
        """The routed experts of the daemon serving ``socket_path``, mapped read-write."""
        from sglang_integration.testing.routed_weights import attach_routed_weights

        return cls(attach_routed_weights(socket_path), checkpoint)

    @property
    def first_slot(self) -> int:
        return self.weights.first_slot

    @property
    def slot_count(self) -> int:
        """The judged slots: this rank's local slots of every MoE layer."""
        return len(self.weights.routed_experts_weights_of_layer) * self.weights.num_local_slots

    def judged(self) -> dict[int, list[SlotContent]]:
        return self.judge.judge_routed(
            self.weights.routed_experts_weights_of_layer, self.weights.names, self.num_experts
        )

    def count_matching_slots(self, physical_to_logical_map: Sequence[Sequence[int]]) -> int:
        """How many of this rank's slots hold the expert the map names there."""
        return count_matching(self.judged(), physical_to_logical_map, self.first_slot)

    def held_rows(self) -> dict[int, list[int]]:
        """Per MoE layer, the expert each local slot holds whole (-1: none, or tied experts)."""
        return {
            layer: [content.experts[0] if len(content.experts) == 1 else -1 for content in row]
            for layer, row in self.judged().items()
        }
