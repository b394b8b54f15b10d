"""The influence trace: response selection, scoring against explicit formulas, and the hook capture against
exact per-token gradients (one backward per token) through the actor's real policy update.

The capture tests hook the final block's MLP, whose per-position gradients are exactly the gradients of each
token's own loss term (nothing after it mixes positions), so hook scores and exact scores must agree to float
tolerance; with projection they agree under the same Rademacher matrices.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig
from workers_support import compile_layers_as_on_a_gpu, ppo_config

from archer.algorithms.aggregation import agg_totals
from archer.algorithms.policy_loss import compute_policy_loss
from archer.batch import Batch
from archer.errors import ArcherError
from archer.models.loading import load_tokenizer
from archer.models.logprobs import response_logprobs
from archer.trace.format import TraceReader
from archer.trace.influence import InfluenceTrace, Selection, select_responses
from archer.trace.influence_capture import (
    CaptureSettings,
    InfluenceCapture,
    MicroBatchPositions,
    ProjectionSpec,
    float32_products_supported,
    module_projections,
    projection_matrices,
    rademacher,
    select_modules,
    sign_products,
)
from archer.trace.influence_score import Scopes, ScoreOptions, module_scores, solve_damped
from archer.workers.actor import ActorWorker

MLP = "[mlp.gate_proj,mlp.up_proj,mlp.down_proj]"
UIDS = ["a", "a", "a", "b", "b", "b", "c", "c"]
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5]  # group c is constant: skipped
LENGTHS = [5, 3, 4, 2, 5, 4, 3, 5]


# -- selection ----------------------------------------------------------------------------------------------
def test_selection_skips_constant_groups_and_marks_the_group_maximum_accepted() -> None:
    mask = np.arange(6)[None, :] < np.array([3, 2, 1, 4, 6, 5])[:, None]
    sel = select_responses(["x", "x", "y", "y", "z", "z"], np.array([0.2, 0.7, 1.0, 1.0, 0.0, 1.0]), mask,
                           max_groups=0, max_responses=0, max_tokens_per_response=-1)
    assert sel.rows.tolist() == [0, 1, 4, 5]
    assert sel.group_id.tolist() == [0, 0, 1, 1]
    assert sel.accepted.tolist() == [False, True, False, True]
    assert (sel.skipped_groups, sel.num_groups) == (1, 3)
    assert sel.token_response.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3]
    assert sel.token_position.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]


def test_selection_caps_groups_responses_and_tokens() -> None:
    uids = ["p", "p", "q", "q", "r", "r"]
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    mask = np.ones((6, 4), dtype=bool)
    assert select_responses(uids, rewards, mask, max_groups=2, max_responses=0,
                            max_tokens_per_response=-1).rows.tolist() == [0, 1, 2, 3]
    assert select_responses(uids, rewards, mask, max_groups=0, max_responses=5,
                            max_tokens_per_response=-1).rows.tolist() == [0, 1, 2, 3]
    capped = select_responses(uids + ["s", "s"], np.append(rewards, [0.5, 0.5]), np.ones((8, 4), dtype=bool),
                              max_groups=1, max_responses=0, max_tokens_per_response=2)
    assert capped.rows.tolist() == [0, 1] and (capped.skipped_groups, capped.num_groups) == (1, 4)
    assert capped.token_response.tolist() == [0, 0, 1, 1]
    assert capped.token_position.tolist() == [0, 1, 0, 1]


# -- scoring ------------------------------------------------------------------------------------------------
def test_identity_scores_by_hand() -> None:
    """k_in = k_out = 1: g_t = u_t v_t. Response a (accepted) has tokens g = 2, 4; b (rejected) has g = 3.
    Sum aggregation: G = [6, 3], d = 6 - 3 = 3, s_t = 3 g_t."""
    u = torch.tensor([[1.0], [2.0], [3.0]])
    v = torch.tensor([[2.0], [2.0], [1.0]])
    token_response = torch.tensor([0, 0, 1])
    options = ScoreOptions(mode="identity", response_grad_agg="sum")
    scopes = Scopes.build(torch.tensor([True, False]), torch.tensor([0, 0]), "sum")
    scores = module_scores(token_response, u[None], v[None], scopes, options)
    assert scores[0].tolist() == pytest.approx([6.0, 12.0, 9.0])
    # Mean aggregation: G = [3, 3] so d = 0 and every score vanishes.
    mean = ScoreOptions(mode="identity", response_grad_agg="mean")
    assert module_scores(token_response, u[None], v[None], scopes, mean)[0].tolist() == pytest.approx([0.0, 0.0, 0.0])


def test_inverse_scores_by_hand() -> None:
    """D = 1, G = [6, 3]: G^T G = 45, lambda = 0.1 * 45 / 1 = 4.5, w = 3 / 49.5, s_t = w g_t."""
    u = torch.tensor([[1.0], [2.0], [3.0]])
    v = torch.tensor([[2.0], [2.0], [1.0]])
    options = ScoreOptions(mode="inverse", response_grad_agg="sum")
    scopes = Scopes.build(torch.tensor([True, False]), torch.tensor([0, 0]), "sum")
    scores = module_scores(torch.tensor([0, 0, 1]), u[None], v[None], scopes, options)
    w = 3 / 49.5
    assert scores[0].tolist() == pytest.approx([2 * w, 4 * w, 3 * w])
    fixed = ScoreOptions(mode="inverse", response_grad_agg="sum", reg_lambda=5.0)
    scores = module_scores(torch.tensor([0, 0, 1]), u[None], v[None], scopes, fixed)
    assert scores[0].tolist() == pytest.approx([2 * 3 / 50, 4 * 3 / 50, 3 * 3 / 50])


def explicit_scores(token_response: torch.Tensor, g: torch.Tensor, accepted: torch.Tensor, scope_of: torch.Tensor,
                    options: ScoreOptions) -> torch.Tensor:
    """The formulas of docs/traces.md written out with explicit token gradients g [T, D] and a dense solve."""
    g = g.double()
    num = accepted.shape[0]
    grads = torch.stack([g[token_response == r].sum(0) for r in range(num)])
    if options.response_grad_agg == "mean":
        grads = grads / torch.bincount(token_response, minlength=num)[:, None].double()
    scores = torch.zeros(g.shape[0], dtype=torch.float64)
    for scope in scope_of.unique():
        rows = (scope_of == scope).nonzero().squeeze(1)
        acc = accepted[rows]
        if acc.all() or not acc.any():
            continue
        if options.contrastive_agg == "sum":
            c = acc.double() * 2 - 1
        else:
            c = acc.double() / acc.sum() - (~acc).double() / (~acc).sum()
        big = grads[rows]
        dim = big.shape[1]
        lam = options.reg_lambda if options.reg_lambda >= 0 else 0.1 * float(torch.trace(big.t() @ big)) / dim
        hessian = big.t() @ big + lam * torch.eye(dim, dtype=torch.float64)
        for i, r in enumerate(rows.tolist()):
            d = c @ big - (c[i] * big[i] if options.exclude_self_response else 0)
            w = torch.linalg.solve(hessian, d) if options.mode == "inverse" else d
            tokens = token_response == r
            scores[tokens] = g[tokens] @ w
    return scores


@pytest.mark.parametrize("options", [
    ScoreOptions(mode="inverse"),
    ScoreOptions(mode="identity"),
    ScoreOptions(mode="inverse", scope="all_selected", contrastive_agg="mean", response_grad_agg="sum"),
    ScoreOptions(mode="inverse", exclude_self_response=True),
    ScoreOptions(mode="identity", exclude_self_response=True, contrastive_agg="mean"),
    ScoreOptions(mode="inverse", reg_lambda=0.3),
])
@pytest.mark.parametrize("k", [(2, 3), (4, 5)])  # D = 6 < 7 responses (direct solve), D = 20 (Woodbury)
def test_scores_match_explicit_formulas(options: ScoreOptions, k: tuple[int, int]) -> None:
    """Three modules scored in one batched call: each module's scores are its own explicit ones."""
    gen = torch.Generator().manual_seed(7)
    k_in, k_out = k
    lengths = [3, 1, 4, 2, 5, 2, 3]
    token_response = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    u = torch.randn(3, len(token_response), k_out, generator=gen)
    v = torch.randn(3, len(token_response), k_in, generator=gen)
    u[2] = 0  # a module without gradient scores zero and leaves the others alone
    accepted = torch.tensor([True, False, False, True, True, False, False])
    scope_of = torch.tensor([0, 0, 0, 1, 1, 1, 1]) if options.scope == "per_prompt" else torch.zeros(7, dtype=torch.long)
    got = module_scores(token_response, u, v, Scopes.build(accepted, scope_of, options.contrastive_agg), options,
                        budget=1)  # one module at a time
    assert got.shape == (3, len(token_response))
    for m in range(2):
        g = (u[m, :, :, None] * v[m, :, None, :]).reshape(len(token_response), -1)
        want = explicit_scores(token_response, g, accepted, scope_of, options)
        torch.testing.assert_close(got[m].double(), want, rtol=1e-4, atol=1e-5)
        assert want.abs().max() > 1e-3
    assert got[2].abs().max() == 0


def test_damped_solve_paths_agree_and_padding_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(3)
    for n, dim in ((3, 8), (8, 3)):
        g = torch.randn(n, dim, generator=gen)
        rhs = torch.randn(2, dim, generator=gen)
        want = torch.linalg.solve(g.double().t() @ g.double() + 0.7 * torch.eye(dim, dtype=torch.float64),
                                  rhs.double().t()).t()
        torch.testing.assert_close(solve_damped(g[None], rhs[None], 0.7)[0], want)
        padded = torch.cat([g, torch.zeros(4, dim)])[None]
        torch.testing.assert_close(solve_damped(padded, rhs[None], 0.7)[0], want)
    assert solve_damped(torch.zeros(1, 2, 3), torch.ones(1, 1, 3), -1.0).abs().sum() == 0  # no gradient: zeros


def test_scopes_layout_and_weights() -> None:
    accepted = torch.tensor([True, False, False, True, True, True, False])
    scopes = Scopes.build(accepted, torch.tensor([5, 5, 2, 5, 2, 9, 9]), "mean")
    assert scopes.grid.row.tolist() == [1, 1, 0, 1, 0, 2, 2] and scopes.grid.slot.tolist() == [0, 1, 0, 2, 1, 0, 1]
    assert (scopes.grid.num_rows, scopes.grid.width) == (3, 3) and scopes.grid.counts.tolist() == [2, 3, 2]
    assert scopes.weights.tolist() == [[-1.0, 1.0, 0.0], [0.5, -1.0, 0.5], [1.0, -1.0, 0.0]]
    all_accepted = Scopes.build(torch.tensor([True, True]), torch.tensor([0, 0]), "sum")
    assert all_accepted.weights.tolist() == [[0.0, 0.0]]  # no rejected response: no direction


def test_bad_score_options_name_the_key() -> None:
    with pytest.raises(ArcherError, match="hessian_mode"):
        ScoreOptions(mode="diagonal")
    with pytest.raises(ArcherError, match="accepted_rejected_scope"):
        ScoreOptions(scope="global")


# -- projection and module selection --------------------------------------------------------------------------
def test_projection_sizes_and_caps() -> None:
    assert ProjectionSpec(factor=0).sizes(896, 4864) is None
    assert ProjectionSpec(factor=512, max_dim=-1).sizes(896, 4864) == (2, 10)
    assert ProjectionSpec(factor=64, max_dim=2500).sizes(1536, 8960) == (20, 120)  # 24 x 140 > 2500: x sqrt(2500/3360)
    assert ProjectionSpec(factor=64, max_vector_sum=100, max_dim=-1).sizes(1536, 8960) == (14, 85)  # 24 + 140 > 100: x 100/164
    p = rademacher(4, 6, seed=5)
    assert torch.equal(p, rademacher(4, 6, seed=5)) and not torch.equal(p, rademacher(4, 6, seed=6))
    assert set((p * 2).abs().flatten().tolist()) == {1.0}  # +-1/sqrt(4)


def test_module_selection(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    last_mlp = select_modules(model, ["mlp.down_proj", "mlp.up_proj"], [-1], -1)
    assert list(last_mlp) == ["model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    assert len(select_modules(model, ["self_attn.q_proj", "mlp.down_proj"], None, -1)) == 4
    assert list(select_modules(model, ["self_attn.q_proj", "mlp.down_proj"], None, 1)) == ["model.layers.1.mlp.down_proj"]
    with pytest.raises(ArcherError, match="matches no linear module"):
        select_modules(model, ["mlp.nonexistent"], None, -1)


# -- the hooks on their own ----------------------------------------------------------------------------------
def chain() -> torch.nn.ModuleDict:
    """a: 6 -> 9, b: 9 -> 6, c: 6 -> 9; with projection factor 3, a and c have (k_in, k_out) = (2, 3), b (3, 2)."""
    torch.manual_seed(5)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(6, 9), "b": torch.nn.Linear(9, 6), "c": torch.nn.Linear(6, 9)})


def run_chain(layers: torch.nn.ModuleDict, x: torch.Tensor, backward: bool = True) -> dict[str, torch.Tensor]:
    """Forward (and backward) of c(tanh(b(a(x)))); returns each layer's input and output (outputs keep grads)."""
    seen = {}
    h = x
    for name in ("a", "b", "c"):
        seen[f"{name}.in"] = h
        out = layers[name](h)
        out.retain_grad()
        seen[f"{name}.out"] = out
        h = torch.tanh(out) if name != "c" else out
    if backward:
        (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return seen


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "autocast"])
def test_hooks_store_projected_factors_of_the_traced_positions(mode: str) -> None:
    """Two micro-batches of [3 rows, 4 positions], five traced positions with their token ids out of order:
    each module's u_t = P_out dy_t and v_t = P_in x_t land at token t, modules of equal (k_in, k_out) stacked.
    Under autocast (bfloat16 outputs and gradients, float32 inputs) the inputs are still projected in float32."""
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    layers = chain().to(dtype)
    spec = ProjectionSpec(factor=3)
    capture = InfluenceCapture(dict(layers.items()), module_projections(dict(layers.items()), spec), num_tokens=5,
                               store_device=torch.device("cpu"))
    traced = [([(0, 1), (2, 3), (1, 0)], [3, 0, 4]), ([(1, 2), (0, 0)], [1, 2])]  # per micro-batch: (row, position), ids
    want = {}
    with capture.capturing():
        for micro, (positions, ids) in enumerate(traced):
            x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(micro)).to(dtype).requires_grad_()
            where = MicroBatchPositions(torch.tensor([r * 4 + p for r, p in positions]), torch.tensor(ids), (3, 4))
            with capture.micro_batch(where), torch.autocast("cpu", dtype=torch.bfloat16,
                                                            enabled=mode == "autocast"):
                seen = run_chain(layers, x)
            for name in ("a", "b", "c"):
                p_in, p_out = projection_matrices(name, layers[name], spec)
                for (r, p), t in zip(positions, ids):
                    want[name, t] = (p_out @ seen[f"{name}.out"].grad[r, p].float(),
                                     p_in @ seen[f"{name}.in"][r, p].detach().float())
    groups = capture.collect()
    assert [g.modules for g in groups] == [["a", "c"], ["b"]]
    assert (groups[0].u.shape, groups[0].v.shape) == ((2, 5, 3), (2, 5, 2))
    exact, rounded = {"rtol": 1e-5, "atol": 1e-6}, {"rtol": 2e-2, "atol": 1e-3}  # float32 sums; bfloat16 results
    for group in groups:
        for m, name in enumerate(group.modules):
            fp32_input = mode == "float32" or (mode == "autocast" and name == "a")  # b and c get a bfloat16 input
            for t in range(5):
                torch.testing.assert_close(group.u[m, t], want[name, t][0], **(exact if mode == "float32" else rounded))
                torch.testing.assert_close(group.v[m, t], want[name, t][1], **(exact if fp32_input else rounded))


def test_a_micro_batch_without_backward_is_reported() -> None:
    layers = chain()
    capture = InfluenceCapture(dict(layers.items()), module_projections(dict(layers.items()), ProjectionSpec(factor=3)),
                               num_tokens=3, store_device=torch.device("cpu"))
    with capture.capturing():
        with capture.micro_batch(MicroBatchPositions(torch.tensor([0, 5]), torch.tensor([0, 1]), (2, 4))):
            run_chain(layers, torch.randn(2, 4, 6))
        with capture.micro_batch(MicroBatchPositions(torch.tensor([2]), torch.tensor([2]), (2, 4))):
            run_chain(layers, torch.randn(2, 4, 6), backward=False)
    with pytest.raises(RuntimeError, match="captured 2 factors for 3 traced tokens"):
        capture.collect()


def test_sign_products_read_each_dtype_and_sum_in_float32() -> None:
    gen = torch.Generator().manual_seed(2)
    signs = torch.randint(0, 2, (300, 4), generator=gen).float() * 2 - 1
    values = torch.randn(50, 300, generator=gen).to(torch.bfloat16)
    want = values.double() @ signs.double()
    table = {torch.float32: signs, torch.bfloat16: signs.to(torch.bfloat16)}
    got = sign_products(values, table, float32_out=False)  # the CPU's path: products rounded to bfloat16
    assert got.dtype == torch.float32 and not float32_products_supported(torch.device("cpu"))
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=0.2)
    torch.testing.assert_close(sign_products(values.float(), table, float32_out=False).double(), want)
    if torch.cuda.is_available() and float32_products_supported(torch.device("cuda")):
        on_gpu = sign_products(values.cuda(), {k: v.cuda() for k, v in table.items()}, float32_out=True)
        assert on_gpu.dtype == torch.float32
        torch.testing.assert_close(on_gpu.cpu(), want.float())  # float32 sums of exact products


# -- capture through the real update ------------------------------------------------------------------------
def traced_batch(actor: ActorWorker) -> Batch:
    """8 rows in 3 prompt groups (c has a constant reward), left-padded prompts of 4, responses of up to 5."""
    gen = torch.Generator().manual_seed(11)
    rows, prompt_len, response_len = len(UIDS), 4, 5
    prompt_lengths = [2, 4, 3, 4, 2, 3, 4, 1]
    prompts = torch.randint(3, 300, (rows, prompt_len), generator=gen)
    prompt_mask = (torch.arange(prompt_len)[None, :] >= prompt_len - torch.tensor(prompt_lengths)[:, None]).long()
    prompts = prompts * prompt_mask
    response_mask = (torch.arange(response_len)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    responses = torch.randint(3, 300, (rows, response_len), generator=gen) * response_mask
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    scores = torch.zeros(rows, response_len)
    scores[torch.arange(rows), torch.tensor(LENGTHS) - 1] = torch.tensor(REWARDS)
    batch = Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                   "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                   "response_mask": response_mask, "token_level_scores": scores,
                   "advantages": torch.randn(rows, 1, generator=gen).expand(rows, response_len) * response_mask},
                  rows={"uid": list(UIDS), "data_source": ["t"] * rows})
    return batch.union(actor.compute_log_prob(batch))


def capture_config(model_dir: Path, run_dir: Path, *extra: str) -> DictConfig:
    return ppo_config(model_dir, "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                      "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                      "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=true",
                      "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0",
                      "trainer.influence_trace.enable=true", "trainer.influence_trace.layers=[-1]",
                      f"trainer.influence_trace.module_name_filter={MLP}", f"trainer.default_local_dir={run_dir}",
                      *extra)


def token_loss_gradients(model: torch.nn.Module, batch: Batch, modules: list[str], objective: str,
                         temperature: float) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Exact per-token gradients of the hooked weights: one backward per token of that token's loss term."""
    weights = [dict(model.named_modules())[name].weight for name in modules]
    response_length = batch["responses"].shape[1]
    logp, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                response_length, temperature=temperature, compute_entropy=False)
    mask = batch["response_mask"].float()
    totals = agg_totals(mask)
    agg_kwargs = {"num_tokens": float(totals["num_tokens"]), "num_seqs": float(totals["num_seqs"]),
                  "max_len": int(totals["max_len"])}
    grads = {}
    for b, t in mask.nonzero().tolist():
        if objective == "training_loss":
            one_hot = torch.zeros_like(mask)
            one_hot[b, t] = 1.0
            term, _ = compute_policy_loss("vanilla", old_log_prob=batch["old_log_probs"], log_prob=logp,
                                          advantages=batch["advantages"], response_mask=one_hot,
                                          loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
                                          clip_ratio_c=3.0, agg_kwargs=agg_kwargs)
        else:
            term = logp[b, t]
        grads[(b, t)] = list(torch.autograd.grad(term, weights, retain_graph=True))
    return grads


def reference_scores(trace: InfluenceTrace, sel: Selection, model: torch.nn.Module,
                     grads: dict[tuple[int, int], list[torch.Tensor]]) -> np.ndarray:
    """Explicit scores from exact per-token gradients projected with the capture's own matrices."""
    total = torch.zeros(len(sel.token_response), dtype=torch.float64)
    per_prompt = trace.options.scope == "per_prompt"
    scope_of = torch.as_tensor(sel.group_id) if per_prompt else torch.zeros(len(sel.rows), dtype=torch.long)
    modules = dict(model.named_modules())
    for m, name in enumerate(trace.modules):
        p_in, p_out = projection_matrices(name, modules[name], trace.capture_settings.projection)
        rows = []
        for s, t in zip(sel.token_response.tolist(), sel.token_position.tolist()):
            grad = grads[(int(sel.rows[s]), t)][m]
            if p_in is not None:
                grad = p_out @ grad @ p_in.t()
            rows.append(grad.flatten())
        total += explicit_scores(torch.as_tensor(sel.token_response), torch.stack(rows),
                                 torch.as_tensor(sel.accepted), scope_of, trace.options)
    return total.numpy()


def run_capture(model_dir: Path, run_dir: Path, *extra: str):
    """One traced update through the actor worker's interface, as the trainer runs it."""
    cfg = capture_config(model_dir, run_dir, *extra)
    actor = ActorWorker(cfg.actor_rollout_ref, device=torch.device("cpu"), total_steps=1)
    batch = traced_batch(actor)
    initial = copy.deepcopy(actor.model)
    modules = actor.setup_influence(CaptureSettings.from_config(cfg.trainer.influence_trace))
    trace = InfluenceTrace(cfg, run_dir, load_tokenizer(model_dir), modules, torch.device("cpu"))
    selection = trace.select(1, batch)
    captured = actor.update_actor(batch, selection.tokens).influence
    return cfg, actor, batch, initial, trace, selection, captured


@pytest.mark.parametrize("extra", [
    ("trainer.influence_trace.projection_dim_factor=0", "trainer.influence_trace.hessian_mode=identity"),
    ("trainer.influence_trace.projection_dim_factor=0", "trainer.influence_trace.hessian_mode=inverse"),
    ("trainer.influence_trace.projection_dim_factor=8", "trainer.influence_trace.hessian_mode=inverse"),
    ("trainer.influence_trace.projection_dim_factor=8", "trainer.influence_trace.accepted_rejected_scope=all_selected",
     "trainer.influence_trace.exclude_self_response=true"),
])
def test_hook_scores_match_exact_per_token_gradients(tiny_model_dir: Path, tmp_path: Path, extra) -> None:
    cfg, actor, batch, initial, trace, sel, captured = run_capture(tiny_model_dir, tmp_path, *extra)
    assert sel.rows.tolist() == [0, 1, 2, 3, 4, 5]  # group c (constant reward) skipped
    got = trace.score(sel, captured)
    grads = token_loss_gradients(initial, batch, list(trace.modules), "training_loss", 1.0)
    want = reference_scores(trace, sel, initial, grads)
    assert len(got) == sum(LENGTHS[:6])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    assert np.abs(want).max() > 0
    projected = cfg.trainer.influence_trace.projection_dim_factor > 0
    # Groups of modules with equal (k_in, k_out): gate and up (32 -> 64) share one, down (64 -> 32) has its own.
    assert sorted(g.modules for g in captured) == [["model.layers.1.mlp.down_proj"],
                                                   ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]]
    down = next(g for g in captured if g.modules == ["model.layers.1.mlp.down_proj"])
    assert (down.v.shape, down.u.shape) == (((1, len(got), 8), (1, len(got), 4)) if projected
                                            else ((1, len(got), 64), (1, len(got), 32)))
    assert down.u.device.type == down.v.device.type == "cpu"


def test_log_prob_output_function_uses_its_own_backward(tiny_model_dir: Path, tmp_path: Path) -> None:
    factor = "trainer.influence_trace.projection_dim_factor=8"
    _, actor, batch, initial, trace, sel, captured = run_capture(
        tiny_model_dir, tmp_path / "a", "trainer.influence_trace.output_function=log_prob", factor)
    assert trace.capture_settings.extra_pass
    got = trace.score(sel, captured)
    want = reference_scores(trace, sel, initial,
                            token_loss_gradients(initial, batch, list(trace.modules), "log_prob", 1.0))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    # the extra pass sends its gradients to the hooks only: the update is the one a run without it makes
    plain = run_capture(tiny_model_dir, tmp_path / "b", factor)[1]
    for (name, value), other in zip(actor.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(value, other), name


def test_checkpointing_and_skip_step_capture_the_same_scores(tiny_model_dir: Path, tmp_path: Path) -> None:
    factor = "trainer.influence_trace.projection_dim_factor=8"
    plain = run_capture(tiny_model_dir, tmp_path / "a", factor)
    ckpt = run_capture(tiny_model_dir, tmp_path / "b", factor, "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    np.testing.assert_allclose(ckpt[4].score(ckpt[5], ckpt[6]), plain[4].score(plain[5], plain[6]), rtol=1e-4, atol=1e-6)
    skipped = run_capture(tiny_model_dir, tmp_path / "c", factor, "trainer.influence_trace.skip_optimizer_step=true")
    before = skipped[3].state_dict()
    after = skipped[1].model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "skip_optimizer_step leaves the weights"
    assert not all(torch.equal(before[k], v) for k, v in plain[1].model.state_dict().items())


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU kernels need a C++ compiler")
def test_compiled_layers_capture_the_same_scores(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # actor.use_torch_compile's GPU path forced on the CPU: the hooked update runs the layers eagerly, so every
    # hook fires (models/compiled_layers.py); its scores are the eager actor's
    factor = "trainer.influence_trace.projection_dim_factor=8"
    plain = run_capture(tiny_model_dir, tmp_path / "a", factor)
    torch._dynamo.reset()
    compile_layers_as_on_a_gpu(monkeypatch)
    compiled = run_capture(tiny_model_dir, tmp_path / "b", factor)
    assert compiled[1].compiled
    want = plain[4].score(plain[5], plain[6])
    np.testing.assert_allclose(compiled[4].score(compiled[5], compiled[6]), want, rtol=1e-4,
                               atol=1e-6 * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("output_function", ["training_loss", "log_prob"])
def test_packed_token_budget_micro_batches_capture_the_same_scores(tiny_model_dir: Path, tmp_path: Path,
                                                                    output_function: str) -> None:
    # sequences of 7, 7, 7, 6, 7, 7, 7 and 6 tokens: a budget of 20 packs two or three rows into one row, in
    # another order than the padded run's micro-batches of three rows
    common = ("trainer.influence_trace.projection_dim_factor=8", f"trainer.influence_trace.output_function={output_function}")
    padded = run_capture(tiny_model_dir, tmp_path / "a", *common)
    free = run_capture(tiny_model_dir, tmp_path / "b", *common, "actor_rollout_ref.model.use_remove_padding=true",
                       "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20")
    want = padded[4].score(padded[5], padded[6])
    np.testing.assert_allclose(free[4].score(free[5], free[6]), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    assert np.abs(want).max() > 0


def test_finish_writes_the_influence_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    _, _, batch, _, trace, sel, captured = run_capture(tiny_model_dir, tmp_path,
                                                       "trainer.influence_trace.projection_dim_factor=8",
                                                       "trainer.influence_trace.max_tokens_per_response=3")
    expected = trace.score(sel, captured)
    # the tool fields of a tool run ride along (the capture above reads none of them)
    batch["tool_mask"] = torch.zeros_like(batch["response_mask"])
    batch["tool_mask"][1, 3] = 1  # row 1 holds 3 model tokens, then tool output
    batch["branch_parent"] = [-1, -1, 0, -1, 0, 1, -1, -1]
    batch["branch_position"] = [-1, -1, 2, -1, 1, 1, -1, -1]
    batch["num_tool_calls"] = [0, 1, 1, 0, 0, 1, 0, 0]
    batch["finish_reason"] = ["eos"] * 7 + ["length"]
    metrics = trace.finish(1, batch, sel, captured)
    trace.writer.flush()
    assert metrics["influence/selected_responses"] == 6 and metrics["influence/selected_groups"] == 2
    assert metrics["influence/skipped_groups"] == 1 and metrics["influence/traced_tokens"] == 17
    reader = TraceReader(tmp_path / "influence_trace")
    assert reader.kind == "influence" and reader.summary["modules"] == list(trace.modules)
    step = reader.load_step(1)
    assert step["selected_row_id"].tolist() == [0, 1, 2, 3, 4, 5]
    assert step["accepted"].tolist() == [True, False, False, False, True, True]
    assert step["group_id"].tolist() == [0, 0, 0, 1, 1, 1]
    assert step["reward"].tolist() == REWARDS[:6]
    assert step["branch_parent"].tolist() == [-1, -1, 0, -1, 0, 1]  # within the uid, as sample_index counts
    assert step["sample_index"].tolist() == [0, 1, 2, 0, 1, 2]
    assert step["branch_position"].tolist() == [-1, -1, 2, -1, 1, 1]
    assert step["num_tool_calls"].tolist() == [0, 1, 1, 0, 0, 1] and step["finish_reason"].tolist() == ["eos"] * 6
    assert np.argwhere(step["tool_mask"]).tolist() == [[1, 3]]
    influence = step["influence"].astype(np.float32)
    # The first three tokens of each response are scored; the rest, and padding, are NaN.
    for s, length in enumerate(LENGTHS[:6]):
        assert not np.isnan(influence[s, :min(3, length)]).any()
        assert np.isnan(influence[s, min(3, length):]).all()
    np.testing.assert_allclose(influence[~np.isnan(influence)], expected.astype(np.float16), rtol=1e-3)
    entry = reader.entry(1)
    assert entry["num_valid_influence"] == 17 and entry["skipped_groups"] == 1
    assert entry["influence_sum"] == pytest.approx(float(influence[~np.isnan(influence)].sum()), rel=1e-6)
    assert entry["influence_sum"] == pytest.approx(float(expected.sum()), rel=1e-3)


def test_unknown_output_function_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ArcherError, match="output_function"):
        run_capture(tiny_model_dir, tmp_path, "trainer.influence_trace.output_function=reward")
