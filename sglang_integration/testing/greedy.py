"""Greedy decoding through sglang's own forward path, in an engine rank on a CPU.

``GreedyDecoder`` holds what sglang's ``ModelRunner`` holds for a forward pass and nothing more:
sglang's ``ReqToTokenPool`` and KV pool (``MHATokenToKVPool``; ``MLATokenToKVPool`` for
DeepSeek-V3's latent cache) on the CPU, and sglang's ``TorchNativeAttnBackend`` over them. Each
step is one ``ForwardBatch`` (an EXTEND for the prompts, then one DECODE per new token) run by
sglang's real ``ModelRunner.forward`` on a runner that holds those (``_Runner``), so what sglang
does around a forward pass happens here too: the expert distribution recorder's
``with_forward_pass`` (the top-k choices of the pass are counted, what EPLB rebalances from),
``EPLBManager.on_forward_pass_end``, and, with the plugin, its hook on ``ModelRunner.forward``
(a standby takes its lease there). The runner's ``_forward_raw`` is the eager path of sglang's:
the forward context, the batch, the attention backend's metadata, ``model.forward``. The next
token is the argmax of the logits (greedy; every rank computes the same logits).

Requests never share KV slots: request ``i`` of a pass owns row ``i + 1`` of the req-to-token
pool and KV slots ``1 + i * max_context`` on (slot 0 is sglang's padding row), and each pass
starts again from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_integration.upstream_lines import UpstreamLine

logger = logging.getLogger(__name__)

_RUNNER = "srt/model_executor/model_runner.py"
# What of sglang's ModelRunner.forward the runner stands for (tests/test_upstream_lines.py).
UPSTREAM_LINES = (
    UpstreamLine(_RUNNER, 1813, "def forward(", "the method every step calls, unbound"),
    UpstreamLine(
        _RUNNER,
        1855,
        "get_global_expert_distribution_recorder().with_forward_pass(",
        "the recorder counts the pass's top-k choices",
    ),
    UpstreamLine(
        _RUNNER, 1860, "output = self._forward_raw(", "the runner's own raw forward (eager)"
    ),
    UpstreamLine(_RUNNER, 1898, "self.eplb_manager.on_forward_pass_end()", "EPLB's pass counter"),
    UpstreamLine(
        _RUNNER,
        1979,
        "ForwardContext(attn_backend=self.attn_backend),",
        "the forward context _forward_raw sets (here too)",
    ),
)


@dataclass
class Decoded:
    """One pass: the new tokens per prompt, and with ``keep_logits`` each step's logits."""

    tokens: list[list[int]]
    logits: list[list[list[float]]] | None = None
    step_seconds: list[float] = field(default_factory=list)
    routed: str | None = None  # what ``generate``'s ``routed`` read (one value for the pass)


class _Runner:
    """The attributes sglang's ``ModelRunner.forward`` reads of its runner, for a CPU engine
    without CUDA graphs, a canary, elastic EP or a debugger; ``_forward_raw`` is the eager
    path (the module docstring)."""

    def __init__(self, model: Any, attn_backend: Any, eplb_manager: Any) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.eplb_manager = eplb_manager
        self.forward_pass_id = 0
        self.is_draft_worker = False
        self.msprobe_debugger = None
        self.canary_manager = None
        self.enable_elastic_ep = False
        self.decode_cuda_graph_runner = None

    def _forward_raw(
        self,
        forward_batch: Any,
        pp_proxy_tensors: Any,
        reinit_attn_backend: bool = False,
        split_forward_count: int = 1,
    ) -> Any:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.srt.model_executor.model_runner import ModelRunnerOutput
        from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch

        context = ForwardContext(attn_backend=self.attn_backend)
        with (
            forward_context(context, forward_batch=forward_batch),
            set_forward_batch(forward_batch),
        ):
            self.attn_backend.init_forward_metadata(forward_batch)
            logits = self.model.forward(
                forward_batch.input_ids, forward_batch.positions, forward_batch
            )
        return ModelRunnerOutput(logits_output=logits, can_run_graph=False)


class GreedyDecoder:
    """sglang's KV pools and torch-native attention backend for ``max_requests`` requests of
    at most ``max_context`` tokens, and greedy passes through ``ModelRunner.forward``."""

    def __init__(
        self,
        model: Any,
        model_config: Any,
        tp_size: int,
        eplb_manager: Any,
        *,
        max_requests: int,
        max_context: int,
    ) -> None:
        import torch
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.max_requests = max_requests
        self.max_context = max_context
        self.vocab_size = int(model_config.vocab_size)
        self.req_to_token_pool = ReqToTokenPool(
            size=max_requests, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        self.token_to_kv_pool = _kv_pool(model_config, tp_size, max_requests * max_context + 1)
        for request in range(max_requests):
            first = 1 + request * max_context
            self.req_to_token_pool.req_to_token[request + 1, :max_context] = torch.arange(
                first, first + max_context, dtype=torch.int32
            )
        holder = _PoolHolder(self.req_to_token_pool, self.token_to_kv_pool)
        self.attn_backend = TorchNativeAttnBackend(holder)
        self.runner = _Runner(model, self.attn_backend, eplb_manager)

    def forward(self, forward_batch: Any) -> Any:
        """One pass through sglang's ``ModelRunner.forward`` (hooked by the plugin when it is
        on); the logits output."""
        from sglang.srt.model_executor.model_runner import ModelRunner

        output = ModelRunner.forward(self.runner, forward_batch)
        return output.logits_output

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        new_tokens: int,
        keep_logits: bool = False,
        routed: Callable[[], str] | None = None,
    ) -> Decoded:
        """Greedy-decode ``new_tokens`` tokens after each prompt, all prompts in one batch.

        ``routed`` (the digest of the map the rank routes with) is read after every step: the
        pass is one layout's only if it never changes (a standby adopts its daemons' layout in
        its first step's lease, before that step computes). ``Decoded.routed`` is that digest.
        """
        import torch

        self._check(prompts, new_tokens)
        batch = len(prompts)
        started = time.perf_counter()
        output = self.forward(self._extend_batch(prompts))
        seconds = [time.perf_counter() - started]
        layout = None if routed is None else routed()
        logits = output.next_token_logits.float()
        steps_logits = [logits.tolist()] if keep_logits else None
        chosen = logits.argmax(-1)
        tokens = [chosen]
        seq_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        for _ in range(new_tokens - 1):
            started = time.perf_counter()
            output = self.forward(self._decode_batch(chosen, seq_lens))
            seconds.append(time.perf_counter() - started)
            if routed is not None and routed() != layout:
                raise RuntimeError(
                    f"the rank's layout changed during a greedy pass (step {len(seconds)}): "
                    "its tokens are of no one layout"
                )
            seq_lens = seq_lens + 1
            logits = output.next_token_logits.float()
            if steps_logits is not None:
                steps_logits.append(logits.tolist())
            chosen = logits.argmax(-1)
            tokens.append(chosen)
        by_prompt = torch.stack(tokens, dim=1).tolist()
        per_prompt_logits = None
        if steps_logits is not None:
            per_prompt_logits = [[step[i] for step in steps_logits] for i in range(batch)]
        return Decoded(by_prompt, per_prompt_logits, seconds, layout)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> float:
        """One EXTEND pass over ``prompts`` and nothing more (its routing is recorded like any
        pass's); the seconds it took."""
        self._check(prompts, 0)
        started = time.perf_counter()
        self.forward(self._extend_batch(prompts))
        return time.perf_counter() - started

    def _check(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> None:
        if not 1 <= len(prompts) <= self.max_requests:
            raise ValueError(f"{len(prompts)} prompts; this decoder takes 1 to {self.max_requests}")
        for prompt in prompts:
            if not prompt or len(prompt) + new_tokens > self.max_context:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens and {new_tokens} new ones do not fit in "
                    f"{self.max_context} tokens"
                )
            if any(not 0 <= token < self.vocab_size for token in prompt):
                raise ValueError(f"a prompt holds a token outside [0, {self.vocab_size})")

    def _extend_batch(self, prompts: Sequence[Sequence[int]]) -> Any:
        import torch
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )

        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        rows = torch.arange(1, batch + 1, dtype=torch.int64)
        seq_lens = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
        locations = torch.cat(
            [
                self.req_to_token_pool.req_to_token[row, :n].long()
                for row, n in zip(rows, lengths, strict=True)
            ]
        )
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=batch,
            input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=locations,
            seq_lens_sum=sum(lengths),
            seq_lens_cpu=seq_lens.clone(),
            positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]),
            extend_num_tokens=sum(lengths),
            extend_seq_lens=seq_lens.clone(),
            extend_prefix_lens=torch.zeros(batch, dtype=torch.int64),
            extend_start_loc=starts,
            extend_prefix_lens_cpu=[0] * batch,
            extend_seq_lens_cpu=list(lengths),
            extend_logprob_start_lens_cpu=list(lengths),
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )

    def _decode_batch(self, input_ids: Any, seq_lens: Any) -> Any:
        """The next token of every request: position ``seq_lens[i]``, written to its slot."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
            ForwardMode,
        )

        batch = int(seq_lens.shape[0])
        rows = torch.arange(1, batch + 1, dtype=torch.int64)
        locations = self.req_to_token_pool.req_to_token[rows, seq_lens].long()
        new_lens = seq_lens + 1
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=batch,
            input_ids=input_ids.to(torch.int64),
            req_pool_indices=rows,
            seq_lens=new_lens,
            out_cache_loc=locations,
            seq_lens_sum=int(new_lens.sum()),
            seq_lens_cpu=new_lens.clone(),
            positions=seq_lens.clone(),
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )


@dataclass
class _PoolHolder:
    """What ``TorchNativeAttnBackend.__init__`` reads of its model runner."""

    req_to_token_pool: Any
    token_to_kv_pool: Any
    device: str = "cpu"


def _kv_pool(model_config: Any, tp_size: int, size: int) -> Any:
    """sglang's KV pool for the model: the latent (MLA) cache for DeepSeek-V3, else K and V per
    head (the rank's share of the KV heads)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if getattr(model_config, "attention_arch", None) is not None and _is_mla(model_config):
        return MLATokenToKVPool(
            size=size,
            page_size=1,
            dtype=model_config.dtype,
            kv_lora_rank=model_config.kv_lora_rank,
            qk_rope_head_dim=model_config.qk_rope_head_dim,
            layer_num=model_config.num_hidden_layers,
            device="cpu",
            enable_memory_saver=False,
        )
    return MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=model_config.dtype,
        head_num=model_config.get_num_kv_heads(tp_size),
        head_dim=model_config.head_dim,
        layer_num=model_config.num_hidden_layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _is_mla(model_config: Any) -> bool:
    from sglang.srt.configs.model_config import AttentionArch

    return bool(model_config.attention_arch == AttentionArch.MLA)
