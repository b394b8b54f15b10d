"""One response mask: ``response_mask`` marks the tokens the policy wrote and is learned from; tokens that are
present in the sequence but not learned from (tool output, once tools exist: attention 1, response mask 0) must
not reach any stage that learns or reports learning. Each consumer gets a batch whose middle tokens are masked
and, at those tokens, values that would change its result if it read them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from archer.algorithms.advantages import compute_advantage
from archer.algorithms.kl import FixedKLController, apply_kl_penalty
from archer.algorithms.value_loss import compute_value_loss
from archer.batch import Batch, response_attention
from archer.rewards.reward_stage import RewardManager
from archer.trace.entropy import response_arrays
from archer.trace.influence import select_responses
from archer.trainer.step_metrics import compute_data_metrics
from archer.workers.rollout import concat_sequences

# 4 responses (2 prompts x 2) of width 5 after prompts of width 2. PRESENT is the response part of the
# attention mask; LEARNED is response_mask: the middle tokens 1-2 of row 0 and 2 of row 2 are "tool output".
PRESENT = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
LEARNED = [[1, 0, 0, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 0]]
TOOL = torch.tensor(PRESENT) - torch.tensor(LEARNED)
GARBAGE = 1e3


def masked_batch(garbage: float = 0.0) -> Batch:
    """The layout above; every per-token float field holds ``garbage`` on the tool tokens."""
    present, learned = torch.tensor(PRESENT), torch.tensor(LEARNED)
    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1], [1, 1]])
    gen = torch.Generator().manual_seed(0)

    def field(scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(4, 5, generator=gen) * scale * present
        return torch.where(TOOL.bool(), garbage, values)

    attention = torch.cat([prompt_mask, present], dim=1)
    responses = torch.arange(10, 30).reshape(4, 5) * present
    scores = torch.zeros(4, 5)
    scores[0, 4], scores[1, 2], scores[2, 3], scores[3, 1] = 1.0, 0.0, 1.0, 0.5  # on each last learned token
    return Batch({"prompts": torch.tensor([[3, 4], [0, 5], [6, 7], [8, 9]]), "responses": responses,
                  "input_ids": torch.cat([torch.tensor([[3, 4], [0, 5], [6, 7], [8, 9]]), responses], dim=1),
                  "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                  "response_mask": learned, "token_level_scores": scores, "token_level_rewards": scores.clone(),
                  "old_log_probs": field(0.5),
                  "ref_log_prob": field(0.5), "values": field(), "returns": field(), "advantages": field(),
                  "entropies": field().abs()},
                 {"uid": ["a", "a", "b", "b"], "data_source": ["t"] * 4})


def test_response_attention_is_the_response_part_of_the_attention_mask() -> None:
    batch = masked_batch()
    assert response_attention(batch).tolist() == PRESENT
    assert torch.all(batch["response_mask"] <= response_attention(batch))


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_advantages_ignore_and_zero_the_masked_tokens(estimator: str) -> None:
    def advantages(garbage: float) -> tuple[torch.Tensor, torch.Tensor]:
        b = masked_batch(garbage)
        return compute_advantage(estimator, token_level_rewards=b["token_level_scores"],
                                 response_mask=b["response_mask"], index=b["uid"], values=b["values"])

    clean, garbage = advantages(0.0), advantages(GARBAGE)
    for a, b in zip(clean, garbage):
        torch.testing.assert_close(a, b)
    assert torch.all(clean[0][TOOL.bool()] == 0)


def test_kl_penalty_in_the_reward_ignores_the_masked_tokens() -> None:
    def penalised(garbage: float) -> tuple[torch.Tensor, dict[str, float]]:
        b = masked_batch(garbage)
        return apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"], b["response_mask"],
                                FixedKLController(0.1), "low_var_kl")

    (clean, m_clean), (dirty, m_dirty) = penalised(0.0), penalised(GARBAGE)
    torch.testing.assert_close(clean, dirty)
    assert m_clean == pytest.approx(m_dirty)
    assert torch.equal(clean[TOOL.bool()], masked_batch()["token_level_scores"][TOOL.bool()])  # no penalty there


def test_value_loss_ignores_the_masked_tokens() -> None:
    def loss(garbage: float) -> tuple[torch.Tensor, torch.Tensor]:
        b = masked_batch(garbage)
        value_loss, clipfrac = compute_value_loss(b["values"] * 0.5, b["values"], b["returns"], b["response_mask"])
        return value_loss, torch.as_tensor(clipfrac.value)

    for a, b in zip(loss(0.0), loss(GARBAGE)):
        torch.testing.assert_close(a, b)


def test_step_metrics_ignore_the_masked_tokens_but_count_them_in_the_length() -> None:
    clean = compute_data_metrics(masked_batch(0.0), max_response_length=5)
    dirty = compute_data_metrics(masked_batch(GARBAGE), max_response_length=5)
    assert clean == pytest.approx(dirty)
    learned = masked_batch()["response_mask"].bool()
    assert clean["actor/entropy"] == pytest.approx(float(masked_batch()["entropies"][learned].mean()))
    # the response is every token present, tool output included: lengths 5, 3, 4, 2
    assert clean["response_length/mean"] == pytest.approx(14 / 4)
    assert clean["response_length/clip_ratio"] == pytest.approx(1 / 4)


def test_traces_mark_only_the_learned_tokens() -> None:
    clean, dirty = response_arrays(masked_batch(0.0)), response_arrays(masked_batch(GARBAGE))
    assert clean["response_mask"].tolist() == (np.array(LEARNED) == 1).tolist()
    np.testing.assert_allclose(clean["advantage"], dirty["advantage"])
    selection = select_responses(["a", "a", "b", "b"], np.array([1.0, 0.0, 1.0, 0.5]),
                                 np.array(LEARNED, dtype=bool), max_groups=0, max_responses=0,
                                 max_tokens_per_response=-1)
    traced = set(zip(selection.rows[selection.token_response].tolist(), selection.token_position.tolist()))
    assert traced == {(r, t) for r in range(4) for t in range(5) if LEARNED[r][t]}


def test_the_reward_reads_the_whole_response_and_scores_the_last_learned_token() -> None:
    chars = list("abcdefghijklmnopqrst")
    vocab = {"<pad>": 0, **{c: i + 10 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    batch = masked_batch()
    batch["ground_truth"] = ["x"] * 4
    batch.tensors.pop("token_level_scores")
    seen = []

    def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: object) -> float:
        seen.append(solution_str)
        return float(len(solution_str))

    out = RewardManager(tokenizer, compute_score=compute_score)(batch)
    assert seen == ["abcde", "fgh", "klmn", "pq"]  # tool tokens b, c and m are part of the text
    assert out.token_level_scores[0].tolist() == [0, 0, 0, 0, 5.0]
    assert out.token_level_scores[2].tolist() == [0, 0, 0, 4.0, 0]  # row 2's last learned token is 3


def test_concatenated_batches_keep_the_attention_of_tool_tokens() -> None:
    batch = masked_batch()
    narrow = batch.index([3])
    narrow.tensors.update({k: v[:, :2] for k, v in narrow.tensors.items()
                           if v.dim() == 2 and v.shape[1] == 5})
    narrow["attention_mask"] = batch["attention_mask"][3:, :4]
    narrow["input_ids"] = batch["input_ids"][3:, :4]
    narrow["position_ids"] = batch["position_ids"][3:, :4]
    merged = concat_sequences([batch.index([0, 1, 2]), narrow], pad_token_id=0)
    assert response_attention(merged).tolist() == PRESENT  # not rebuilt from response_mask
    assert merged["response_mask"].tolist() == LEARNED
