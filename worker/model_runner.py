"""Turns a scheduler step into tensors, runs the model on the device and samples.

The only part of the engine that touches torch tensors (with the tiers' copy code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from worker.layers.attention import AttentionMetadata, PrefillSpan
from worker.layers.logits_processors import TokenLogprob, process_logits, token_logprobs
from worker.layers.sampler import sample
from worker.model.llama import LlamaForCausalLM
from worker.scheduler import SchedulerOutput
from worker.sequence import Sequence
from worker.structured import advance, mask_logits


def kv_cache_shape(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> tuple[int, ...]:
    cfg = model.config
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    return math.prod(kv_cache_shape(model, 1, block_size)) * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class StepResult:
    sampled: dict[Sequence, int]  # sequences that got a new token this step
    num_prefill_tokens: int
    logprobs: dict[Sequence, TokenLogprob] = field(default_factory=dict)  # for those that asked


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_blocks, block_size), dtype=dtype, device=device)
        self._generators: dict[Sequence, torch.Generator] = {}

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq, None)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.seed is None or seq.sampling.temperature <= 0:
            return None
        if seq not in self._generators:
            self._generators[seq] = torch.Generator(device=self.device).manual_seed(seq.sampling.seed)
        return self._generators[seq]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        for seq in step.decodes:
            pos = seq.num_computed_tokens
            ids.append(seq.token_at(pos))
            positions.append(pos)
            slot_blocks.append(seq.block_table[pos // bs])
            slot_offsets.append(pos % bs)
        meta = AttentionMetadata(
            slot_blocks=torch.empty(0), slot_offsets=torch.empty(0), num_decode=len(step.decodes)
        )
        if step.decodes:
            meta.decode_block_tables, meta.decode_mask = self._decode_tables(step.decodes)
        sample_rows = list(range(len(step.decodes)))
        sample_seqs = list(step.decodes)
        for chunk in step.prefills:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.length
            query_start = len(ids)
            ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            slot_blocks.extend(seq.block_table[p // bs] for p in range(start, end))
            slot_offsets.extend(p % bs for p in range(start, end))
            table = torch.tensor(seq.block_table[: math.ceil(end / bs)], dtype=torch.long, device=self.device)
            meta.prefills.append(
                PrefillSpan(
                    query_start=query_start, query_len=chunk.length, context_len=end, block_table=table
                )
            )
            if chunk.completes_prefill and not seq.output_token_ids:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        meta.slot_blocks = torch.tensor(slot_blocks, dtype=torch.long, device=self.device)
        meta.slot_offsets = torch.tensor(slot_offsets, dtype=torch.long, device=self.device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            self.kv_cache,
        )
        sampled: dict[Sequence, int] = {}
        logprobs: dict[Sequence, TokenLogprob] = {}
        if sample_rows:
            logits = self.model.logits(hidden[torch.tensor(sample_rows, device=self.device)])
            params = [s.sampling for s in sample_seqs]
            logits = process_logits(logits, params, [s.output_token_ids for s in sample_seqs])
            if any(s.matcher is not None for s in sample_seqs):
                mask_logits(logits, [s.matcher for s in sample_seqs])
            tokens = sample(logits, params, [self._generator(s) for s in sample_seqs])
            for seq, token in zip(sample_seqs, tokens, strict=True):
                seq.grammar_complete = advance(seq.matcher, token)
            sampled = dict(zip(sample_seqs, tokens, strict=True))
            for seq, entry in zip(sample_seqs, token_logprobs(logits, tokens, params), strict=True):
                if entry is not None:
                    logprobs[seq] = entry
        num_prefill_tokens = sum(c.length for c in step.prefills)
        return StepResult(sampled=sampled, num_prefill_tokens=num_prefill_tokens, logprobs=logprobs)

    def _decode_tables(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables [B, max_blocks] and the mask of valid key positions [B, 1, 1, L]."""
        bs = self.block_size
        max_blocks = max(s.num_computed_tokens // bs + 1 for s in seqs)
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        lengths = torch.empty(len(seqs), dtype=torch.long)
        for row, seq in enumerate(seqs):
            used = seq.num_computed_tokens // bs + 1
            tables[row, :used] = torch.tensor(seq.block_table[:used])
            lengths[row] = seq.num_computed_tokens + 1
        mask = torch.arange(max_blocks * bs)[None, :] < lengths[:, None]
        return tables.to(self.device), mask[:, None, None, :].to(self.device)
