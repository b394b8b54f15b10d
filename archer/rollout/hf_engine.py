"""HFGenerateEngine: batched generation with a Hugging Face causal LM and its KV cache, written as our own
decoding loop so every generated token carries its exact log-prob and full-vocabulary entropy.

Sampling follows a seed per row, as the fast engine's does (archer/rollout/fast/sampling.py: Gumbel-max with
noise hashed from the row's key, the token's position and the vocabulary index): a row's tokens depend on its
prompt and seed only, never on the rows beside it, on their padding, on ``max_batch_size`` or on how a batch is
split over data-parallel ranks (``SamplingParams.first_prompt``); float32 logits make that exact.

Its sessions (``session()``, for the agentic loop) keep each sequence's tokens and its noise key; a decode call
prefills every sequence again from its tokens (there is no KV reuse across calls: archer's fast engine has it).

By default it generates with the policy's own module (``sync_weights`` has nothing to copy); ``standalone``
gives it its own single-device module, filled from the stream of named weights ``sync_weights`` takes (a
policy sharded with FSDP cannot generate on one rank's shard).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from archer.errors import ArcherError
from archer.models.compiled_layers import eager_layers
from archer.rollout.base import (
    EngineSession,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    Segment,
    copy_weights,
)
from archer.rollout.endings import StopMatcher, eos_ids
from archer.rollout.fast.sampling import filter_thresholds, noise_key, sample


@dataclass
class _Chunk:
    """The decoded rows of one batch chunk, on CPU, padded to this chunk's longest response."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    entropies: torch.Tensor
    finish_reasons: list[str]


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


class HFGenerateEngine(RolloutEngine):
    """Generation with a local Hugging Face model: left-padded batches of at most ``max_batch_size`` rows."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: torch.device | str | None = None,
        max_batch_size: int = 256,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ArcherError(
                "the tokenizer has no pad token, which batched generation needs",
                "load it with archer.models.loading.load_tokenizer (pad falls back to eos)",
            )
        if max_batch_size < 1:
            raise ArcherError(f"max_batch_size={max_batch_size} is not positive", "use 1 or more")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.eos_token_ids = torch.tensor(eos_ids(model, tokenizer), dtype=torch.long, device=self.device)
        self._keeps_last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.owns_weights = False  # True: its own module, filled by sync_weights (``standalone``)

    @classmethod
    def standalone(cls, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, device: torch.device | str,
                   dtype: torch.dtype, max_batch_size: int = 256) -> HFGenerateEngine:
        """An engine with its own single-device module, built from ``policy``'s config (its generation config
        too; no weights read) in ``dtype`` and filled by ``sync_weights``: for a policy whose module cannot
        generate on one device (sharded with FSDP over several ranks). Generate only after the first sync."""
        model = AutoModelForCausalLM.from_config(policy.config, dtype=dtype)
        model.generation_config = copy.deepcopy(policy.generation_config)
        model.to(device).eval()  # parameters keep requires_grad as the policy's: the same CPU kernels, the same numbers
        engine = cls(model, tokenizer, device=device, max_batch_size=max_batch_size)
        engine.owns_weights = True
        return engine

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """With the policy's own module (the default): nothing to copy and the stream is left unread (with LoRA
        the module computes ``W x + scaling * B A x``, the merged model's function). With its own module
        (``standalone``): every parameter is copied from the stream in place, each by name and shape."""
        if not self.owns_weights:
            return
        # tied weights once, as policy_weights gives them
        copy_weights(dict(self.model.named_parameters()), weights, engine="hf",
                     fix="sync the engine from the policy it was built from")

    def release_memory(self, weights: bool = False) -> None:
        """Nothing is held between calls: each generate call makes and drops its own KV cache (and the weights
        are the actor's own)."""

    def reclaim_memory(self) -> None:
        """Nothing to allocate (see release_memory)."""

    def session(self) -> HFSession:
        return HFSession(self)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ArcherError(f"prompt {i} is empty", "every prompt needs at least one token")
        rows = [list(p) for p in prompts for _ in range(params.n)]
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        keys = [noise_key(seed, params.first_prompt * params.n + row) for row in range(len(rows))]
        budgets = [params.max_new_tokens] * len(rows)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), eager_layers():  # a compiled policy's layers would recompile per cache length
                chunks = [
                    self._decode(rows[i : i + self.max_batch_size], params, keys[i : i + self.max_batch_size],
                                 budgets[i : i + self.max_batch_size])
                    for i in range(0, len(rows), self.max_batch_size)
                ]
        finally:
            self.model.train(was_training)
        return self._merge(chunks, torch.arange(len(prompts)).repeat_interleave(params.n))

    def _merge(self, chunks: list[_Chunk], prompt_index: torch.Tensor) -> RolloutOutput:
        width = max((c.responses.shape[1] for c in chunks), default=0)

        def cat(name: str, value: float) -> torch.Tensor:
            if not chunks:
                return torch.zeros(0, 0)
            return torch.cat([_pad_right(getattr(c, name), width, value) for c in chunks])

        return RolloutOutput(
            responses=cat("responses", self.pad_token_id).long(),
            response_mask=cat("response_mask", 0).long(),
            log_probs=cat("log_probs", 0.0).float(),
            entropies=cat("entropies", 0.0).float(),
            prompt_index=prompt_index,
            finish_reasons=[r for c in chunks for r in c.finish_reasons],
        )

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, length - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """float32 logits [B, V] of the last position."""
        extra = {"logits_to_keep": 1} if self._keeps_last_logits_only else {}
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        return out.logits[:, -1].float()

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next token of each row (drawn with the row's noise ``keys`` at the ``positions`` of the tokens being
        drawn), with its log-prob and the entropy of softmax(logits / T): the fast engine's sampler."""
        rows = logits.shape[0]
        greedy = torch.full((rows,), params.greedy, device=logits.device)
        temperature = torch.full((rows,), 1.0 if params.greedy else params.temperature, device=logits.device)
        vocab = logits.shape[-1]
        if params.greedy or not (0 < params.top_k < vocab or params.top_p < 1):
            threshold = torch.full((rows,), float("-inf"), device=logits.device)
        else:
            threshold = filter_thresholds(logits, temperature, torch.full((rows,), params.top_k, device=logits.device),
                                          torch.full((rows,), params.top_p, device=logits.device))
        return sample(logits, temperature, greedy, keys, positions, threshold)

    def _decode(self, prompts: list[list[int]], params: SamplingParams, keys: list[int],
                budgets: list[int]) -> _Chunk:
        """Decode every prompt (left-padded into one batch) until eos, a stop string or its own token budget,
        each row sampling with its noise key."""
        ids, mask = self._left_pad(prompts)
        row_keys = torch.tensor(keys, dtype=torch.long, device=self.device)
        drawn = torch.tensor([len(p) for p in prompts], device=self.device)  # the position of the token drawn
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)
        next_position = positions[:, -1:] + 1
        rows = len(prompts)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        reasons = ["length"] * rows
        histories: list[list[int]] = [[] for _ in range(rows)]
        stop_matcher = StopMatcher(self.tokenizer, params.stop)
        steps: list[tuple[torch.Tensor, ...]] = []
        budget = torch.tensor(budgets, device=self.device)
        for step in range(max(budgets)):
            token, logp, entropy = self._pick(logits, params, row_keys, drawn + step)
            live = ~done
            token = torch.where(live, token, self.pad_token_id)
            steps.append((token, live, torch.where(live, logp, 0.0), torch.where(live, entropy, 0.0)))
            self._finish_rows(token, live, histories, reasons, stop_matcher, done)
            done |= budget <= step + 1  # rows at their budget end with reason "length"
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self._forward(token.unsqueeze(-1), mask, next_position, cache)
            next_position = next_position + 1
        tokens, live, logps, entropies = (
            torch.stack(column, dim=1).cpu() for column in zip(*steps, strict=True)
        )
        return _Chunk(tokens, live.long(), logps, entropies, reasons)

    def _finish_rows(
        self,
        token: torch.Tensor,
        live: torch.Tensor,
        histories: list[list[int]],
        reasons: list[str],
        stop_matcher: StopMatcher,
        done: torch.Tensor,
    ) -> None:
        """Mark rows that just wrote an eos token or completed a stop string (updates ``done`` in place)."""
        is_eos = live & torch.isin(token, self.eos_token_ids)
        live_rows = live.nonzero().flatten().tolist()
        if stop_matcher.stop:
            for row, tok in zip(live_rows, token[live].tolist(), strict=True):
                histories[row].append(tok)
        eos_rows = set(is_eos.nonzero().flatten().tolist())
        for row in eos_rows:
            reasons[row] = "eos"
        stopped = stop_matcher.matches(histories, [r for r in live_rows if r not in eos_rows])
        for row in stopped:
            reasons[row] = "stop"
        finished = sorted(eos_rows.union(stopped))
        if finished:
            done[torch.tensor(finished, device=done.device)] = True


@dataclass
class _Sequence:
    tokens: list[int]
    key: int  # its noise key (the fast engine's, from the same seed)


class HFSession(EngineSession):
    """Turn-by-turn sequences on an HFGenerateEngine; each decode call re-prefills its sequences."""

    def __init__(self, engine: HFGenerateEngine) -> None:
        self.engine = engine
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0

    def _new(self, tokens: list[int], seed: int) -> int:
        seq, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq] = _Sequence(list(tokens), noise_key(seed))
        return seq

    def _get(self, seq: int) -> _Sequence:
        if seq not in self._sequences:
            raise KeyError(f"session has no sequence {seq} (released, or never added)")
        return self._sequences[seq]

    def add(self, prompt: list[int], seed: int) -> int:
        if not prompt:
            raise ArcherError("a session prompt is empty", "every prompt needs at least one token")
        return self._new(prompt, seed)

    def extend(self, seq: int, tokens: list[int]) -> None:
        self._get(seq).tokens.extend(int(t) for t in tokens)

    def fork(self, seq: int, seed: int) -> int:
        return self._new(self._get(seq).tokens, seed)

    def release(self, seq: int) -> None:
        self._sequences.pop(seq, None)

    def tokens(self, seq: int) -> list[int]:
        return list(self._get(seq).tokens)

    def decode(self, seqs: list[int], params: SamplingParams, max_new_tokens: list[int]) -> list[Segment]:
        if len(seqs) != len(max_new_tokens):
            raise ValueError(f"{len(seqs)} sequences but {len(max_new_tokens)} token budgets")
        states = [self._get(s) for s in seqs]
        segments: list[Segment | None] = [None] * len(seqs)
        live = [i for i, budget in enumerate(max_new_tokens) if budget > 0]
        for i in set(range(len(seqs))) - set(live):
            segments[i] = Segment([], torch.zeros(0), torch.zeros(0), "length")
        size = self.engine.max_batch_size
        was_training = self.engine.model.training
        self.engine.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(live), size):
                    part = live[start:start + size]
                    chunk = self.engine._decode([states[i].tokens for i in part], params,
                                                [states[i].key for i in part], [max_new_tokens[i] for i in part])
                    for row, i in enumerate(part):
                        length = int(chunk.response_mask[row].sum())
                        tokens = chunk.responses[row, :length].tolist()
                        states[i].tokens.extend(tokens)
                        segments[i] = Segment(tokens, chunk.log_probs[row, :length].float(),
                                              chunk.entropies[row, :length].float(), chunk.finish_reasons[row])
        finally:
            self.engine.model.train(was_training)
        return [s for s in segments if s is not None]
