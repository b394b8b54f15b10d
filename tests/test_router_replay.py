"""Routing replay (models/router_replay.py): the fast engine records each token's experts, the trainer's passes
route with them, and the old-log-prob pass counts how often its own top-k differs; on small random Qwen3-MoE and
OLMoE models (CPU, float32), checked against the trainer's own routers and a hand-routed forward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from test_moe import _moe_run, _olmoe, _qwen3_moe
from test_rollout_fast_engine import TEXTS

from archer.batch import Batch
from archer.errors import ArcherError
from archer.models.forward import compute_log_probs
from archer.models.micro_batches import MicroBatching
from archer.models.packed_attention import use_packed_attention
from archer.models.router_replay import (
    ROUTED_EXPERTS,
    ReplaySettings,
    RouteCounts,
    layout_routes,
    mismatch_metrics,
    pad_routes,
    replaying,
    router_of,
    sequence_routes,
    sparse_gates,
)
from archer.rollout.base import SamplingParams
from archer.rollout.fast import FastEngine

BUILDS = pytest.mark.parametrize("build", [_qwen3_moe, _olmoe], ids=["qwen3_moe", "olmoe"])
RECORD, R3 = ReplaySettings(record=True), ReplaySettings(record=True, replay=True)


def _rollout(model, tokenizer, *, n: int = 2, new_tokens: int = 7, stop: tuple[str, ...] = ()) -> Batch:
    """Sampled responses of the fast engine (recording) laid out as the rollout worker lays them out."""
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    engine = FastEngine(model, tokenizer, max_num_seqs=4, page_size=16, record_routes=True)
    out = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=new_tokens, seed=3, stop=stop))
    rows = [prompts[i] for i in out.prompt_index.tolist()]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    ids, mask = torch.cat([ids, out.responses], dim=1), torch.cat([mask, out.response_mask], dim=1)
    routes = sequence_routes(out.routed_experts, [len(p) for p in rows], width, out.responses.shape[1])
    return Batch(
        rows={"finish_reason": out.finish_reasons},
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": out.responses,
            ROUTED_EXPERTS: routes,
        },
    )


def _own_routes(model, batch: Batch) -> torch.Tensor:
    """[B, W, MoE layers, k]: the experts the model's own routers pick for each token of the padded rows."""
    picked, gates = [], sparse_gates(model)
    handles = [g.register_forward_hook(lambda m, a, out: picked.append(out[2])) for g in gates]
    with torch.no_grad():
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
    for handle in handles:
        handle.remove()
    return torch.stack(picked, dim=1).view(*batch["input_ids"].shape, len(gates), -1)


def _perturbed(model):
    """A copy of ``model`` whose routers' weights moved (the trainer's routing then differs from the engine's)."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for gate in sparse_gates(moved):
            gate.weight.add_(0.1 * torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(7)))
    return moved


@BUILDS
def test_the_engine_records_the_trainers_own_experts(parts, build):
    tokenizer = parts[1]
    model = build(len(tokenizer))
    _check_records(model, _rollout(model, tokenizer))


def test_a_stop_string_cuts_the_records_with_the_tokens(parts):
    """Rows cut after a stop string inside a window keep the records of the tokens they keep, no more."""
    tokenizer = parts[1]
    model = _qwen3_moe(len(tokenizer))
    batch = _rollout(model, tokenizer, new_tokens=12, stop=("F",))
    assert "stop" in list(batch["finish_reason"]) and "length" in list(batch["finish_reason"])
    _check_records(model, batch)


def _check_records(model, batch: Batch) -> None:
    """The engine's records of ``batch``: on every token but each row's last, and the trainer's own top-k there;
    the old-log-prob pass counts them and no mismatch."""
    routes, mask = batch[ROUTED_EXPERTS], batch["attention_mask"].bool()
    assert routes.dtype == torch.int16 and routes.shape[2:] == (
        len(sparse_gates(model)),
        router_of(sparse_gates(model)[0]).top_k,
    )
    # recorded: every token but each row's last (sampled, never fed); nothing on padding
    recorded = (routes >= 0).all(dim=-1).all(dim=-1)
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)
    expected = mask.clone()
    expected[torch.arange(len(mask)), last] = False
    assert torch.equal(recorded, expected) and bool(((routes >= 0) == recorded[..., None, None]).all())
    own = _own_routes(model, batch)
    assert torch.equal(routes[recorded].long().sort(-1).values, own[recorded].sort(-1).values)
    counts = torch.zeros(len(batch), RouteCounts.COLUMNS)
    compute_log_probs(
        model,
        batch,
        temperature=1.0,
        micro=MicroBatching(None, None, packed=False),
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
        routing=RECORD,
        route_counts=counts,
    )
    layers = routes.shape[2]
    assert counts[:, 0].tolist() == (recorded.sum(dim=1) * layers).float().tolist()
    assert counts[:, 2].tolist() == (counts[:, 0] * routes.shape[3]).tolist()
    assert mismatch_metrics(counts) == {
        "actor/router_mismatch_tokens": 0.0,
        "actor/router_mismatch_choices": 0.0,
    }


@BUILDS
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_routes_with_the_records_when_the_trainer_would_not(parts, build, packed):
    tokenizer = parts[1]
    engine_model = build(len(tokenizer))
    batch = _rollout(engine_model, tokenizer)
    trainer = _perturbed(engine_model)
    if packed:
        use_packed_attention(trainer)
    routes = batch[ROUTED_EXPERTS].long()
    recorded = (routes >= 0).all(dim=-1)  # [B, W, layers]
    own = _own_routes(trainer, batch)
    k = routes.shape[-1]
    hit = (routes.unsqueeze(-1) == own.unsqueeze(-2)).any(dim=-1)  # [B, W, layers, k]
    want_tokens = float((~hit).any(dim=-1)[recorded].double().mean())
    want_choices = float((~hit).double().sum(dim=-1)[recorded].mean() / k)
    assert 0 < want_tokens < 1  # the moved routers pick other experts for some tokens
    micro = MicroBatching(None, None, packed=packed)
    counts = torch.zeros(len(batch), RouteCounts.COLUMNS)
    compute_log_probs(
        trainer,
        batch,
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
        routing=RECORD,
        route_counts=counts,
    )
    got = mismatch_metrics(counts)
    assert got["actor/router_mismatch_tokens"] == pytest.approx(want_tokens, abs=1e-12)
    assert got["actor/router_mismatch_choices"] == pytest.approx(want_choices, abs=1e-12)
    # under replay each router takes the recorded experts; each row's last token routes by its own top-k
    layout_of = micro.layout
    flat_routes, token_rows = layout_routes(layout_of, batch)
    layout = layout_of(batch)
    chosen = []
    with replaying(trainer, flat_routes):
        handles = [
            g.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for g in sparse_gates(trainer)
        ]
        with torch.no_grad():
            trainer(**layout.model_inputs())
        for handle in handles:
            handle.remove()
    assert not any(g._forward_hooks for g in sparse_gates(trainer))  # the context took its hooks out
    source = (
        layout_of(
            Batch(
                {
                    **batch.tensors,
                    "input_ids": torch.arange(1, batch["input_ids"].numel() + 1).view_as(batch["input_ids"]),
                }
            )
        ).input_ids.reshape(-1)
        - 1
    )
    present = source >= 0
    assert torch.equal(token_rows[present], source[present] // batch["input_ids"].shape[1])
    own_flat = own.reshape(-1, *own.shape[2:])
    for layer, ids in enumerate(chosen):
        for token in range(len(ids)):
            if not present[token]:
                continue
            record = routes.reshape(-1, *routes.shape[2:])[source[token], layer]
            want = record if bool((record >= 0).all()) else own_flat[source[token], layer]
            assert ids[token].tolist() == want.tolist()


def _hand_block(block, ids_of_token):
    """A sparse block's forward routed by hand: each token to the experts ``ids_of_token`` gives (None: its own
    top-k), weighted by the softmax of its router logits there (renormalised with norm_topk_prob)."""
    router, experts = router_of(block.gate), block.experts

    def forward(hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        out = torch.zeros_like(x)
        probs = torch.softmax(F.linear(x, router.weight).float(), dim=-1)
        for n in range(x.shape[0]):
            ids = ids_of_token(n)
            ids = probs[n].topk(router.top_k).indices if ids is None else ids
            weights = probs[n][ids]
            if router.norm_topk_prob:
                weights = weights / weights.sum()
            for j, e in enumerate(ids.tolist()):
                gate, up = (experts.gate_up_proj[e] @ x[n]).chunk(2)
                out[n] += weights[j].to(x.dtype) * (experts.down_proj[e] @ (F.silu(gate) * up))
        return out.view(shape)

    return forward


@BUILDS
def test_replayed_log_probs_equal_a_hand_routed_forward(parts, build):
    tokenizer = parts[1]
    engine_model = build(len(tokenizer))
    batch = _rollout(engine_model, tokenizer, new_tokens=5)
    trainer = _perturbed(engine_model)
    micro = MicroBatching(None, None, packed=False)
    logp, _ = compute_log_probs(
        trainer,
        batch,
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
        routing=R3,
    )
    plain, _ = compute_log_probs(
        trainer,
        batch,
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
    )
    flat_routes, _ = layout_routes(micro.layout, batch)
    hand = copy.deepcopy(trainer)
    blocks = [m for m in hand.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    for layer, block in enumerate(blocks):

        def ids_of_token(n, layer=layer):
            record = flat_routes[n, layer]
            return record.long() if bool((record >= 0).all()) else None

        block.forward = _hand_block(block, ids_of_token)
    want, _ = compute_log_probs(
        hand,
        batch.select(["input_ids", "attention_mask", "position_ids", "responses"]),
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
    )
    response_mask = batch["attention_mask"][:, -batch["responses"].shape[1] :].bool()
    torch.testing.assert_close(logp[response_mask], want[response_mask], atol=1e-5, rtol=0)
    assert float((logp - plain).abs().max()) > 1e-3  # replay changed what the moved routers would compute


@BUILDS
def test_gradients_reach_the_router_under_replay(parts, build):
    tokenizer = parts[1]
    engine_model = build(len(tokenizer))
    batch = _rollout(engine_model, tokenizer, new_tokens=5)
    trainer = _perturbed(engine_model).train()
    micro = MicroBatching(None, None, packed=False)
    flat_routes, _ = layout_routes(micro.layout, batch)
    layout = micro.layout(batch)
    from archer.models.logprobs import layout_logprobs

    with replaying(trainer, flat_routes):
        logp, _ = layout_logprobs(trainer, layout, compute_entropy=False)
        logp.sum().backward()
    for gate in sparse_gates(trainer):
        assert gate.weight.grad is not None and float(gate.weight.grad.abs().sum()) > 0


def test_sequence_routes_lay_records_out_with_the_prompts_padding():
    a = torch.arange(2 * 1 * 2, dtype=torch.int16).view(2, 1, 2)  # prompt of 2, no response token fed
    b = torch.arange(4 * 1 * 2, dtype=torch.int16).view(4, 1, 2) + 10  # prompt of 1, 3 response tokens fed
    out = sequence_routes([a, b], [2, 1], prompt_width=3, response_width=4)
    assert out.shape == (2, 7, 1, 2)
    assert out[0, :, 0, 0].tolist() == [-1, 0, 2, -1, -1, -1, -1]
    assert out[1, :, 0, 0].tolist() == [-1, -1, 10, 12, 14, 16, -1]
    padded = pad_routes(out, 1, 2)
    assert padded.shape == (2, 10, 1, 2) and padded[1, :, 0, 1].tolist() == [
        -1,
        -1,
        -1,
        11,
        13,
        15,
        17,
        -1,
        -1,
        -1,
    ]


def test_concatenated_rollouts_keep_their_records_aligned(parts):
    from archer.workers.rollout import concat_sequences

    tokenizer = parts[1]
    model = _qwen3_moe(len(tokenizer))
    one, two = _rollout(model, tokenizer, n=1, new_tokens=3), _rollout(model, tokenizer, n=1, new_tokens=6)
    for b, short in ((one, "a"), (two, "b")):
        b["prompts"] = b["input_ids"][:, : b["input_ids"].shape[1] - b["responses"].shape[1]]
        b["response_mask"] = b["attention_mask"][:, -b["responses"].shape[1] :]
        b.rows["tag"] = [short] * len(b)
    both = concat_sequences([one, two.index(slice(0, 2))], tokenizer.pad_token_id)
    assert both[ROUTED_EXPERTS].shape[:2] == both["input_ids"].shape
    recorded = (both[ROUTED_EXPERTS] >= 0).all(dim=-1).all(dim=-1)
    assert bool((recorded <= both["attention_mask"].bool()).all())
    assert torch.equal(
        both[ROUTED_EXPERTS][: len(one)][both["attention_mask"][: len(one)].bool()],
        one[ROUTED_EXPERTS][one["attention_mask"].bool()],
    )


def test_r3_grpo_run_logs_the_mismatch(micro_model, task_files, tmp_path, monkeypatch):
    """Two GRPO steps with router_replay.mode=R3 on the CPU: the engine's and the trainer's routers agree (same
    weights, same kernels), so the logged mismatch is 0 and the replayed old log-probs equal the engine's; every
    update micro-batch replays the records."""
    from archer.models import forward, router_replay
    from archer.trainer.ppo import PPOTrainer
    from archer.workers import actor

    replayed: list[tuple[str, int]] = []

    def spy(where):
        def wrapped(model, layout_of, rows, device, *, replay, count):
            context, counts = router_replay.micro_batch_replay(
                model, layout_of, rows, device, replay=replay, count=count
            )
            if replay and ROUTED_EXPERTS in rows.tensors:
                replayed.append((where, int((rows[ROUTED_EXPERTS] >= 0).sum())))
            return context, counts

        return wrapped

    monkeypatch.setattr(actor, "micro_batch_replay", spy("update"))
    monkeypatch.setattr(forward, "micro_batch_replay", spy("old_log_prob"))
    run, cfg = _moe_run(
        _qwen3_moe, micro_model, task_files, tmp_path, "actor_rollout_ref.actor.router_replay.mode=R3"
    )
    PPOTrainer(cfg).fit()
    assert {where for where, _ in replayed} == {"update", "old_log_prob"} and all(n > 0 for _, n in replayed)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(
        m["actor/router_mismatch_tokens"] == 0.0 and m["actor/router_mismatch_choices"] == 0.0
        for m in metrics
    )
    assert all(m["actor/grad_norm"] > 0 and m["rollout_corr/log_ppl_abs_diff"] < 1e-4 for m in metrics)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R2",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            ],
            "go unused",
        ),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R2",
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "bypass_mode",
        ),
        (["actor_rollout_ref.actor.router_replay.mode=R4"], "unknown"),
        (
            ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.name=hf"],
            "fast engine",
        ),
        (
            [
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                "trainer.v1.trainer_mode=colocate_async",
            ],
            "sync mode",
        ),
        (
            [
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "+actor_rollout_ref.rollout.tools.tool_instances.python.class_path=python",
            ],
            "tool rollouts",
        ),
        (["+actor_rollout_ref.actor.router_replay.record_file=/tmp/r.pt"], "record_file"),
    ],
    ids=["R2-with-engine-records", "R2-bypass", "unknown", "hf-engine", "async", "tools", "record-file"],
)
def test_config_refusals(changes, match):
    from archer.config.loader import load_config
    from archer.trainer.config_check import check_config

    with pytest.raises(ArcherError, match=match):
        check_config(
            load_config("ppo_trainer", ["actor_rollout_ref.model.path=m", "data.train_files=x", *changes])
        )


def test_a_dense_policy_is_refused(micro_model, task_files, tmp_path):
    from archer.trainer.ppo import PPOTrainer

    _, cfg = _moe_run(
        _olmoe, micro_model, task_files, tmp_path, "actor_rollout_ref.actor.router_replay.mode=R3"
    )
    cfg.actor_rollout_ref.model.path = str(micro_model)  # the dense micro model
    with pytest.raises(ArcherError, match="Mixture-of-Experts"):
        PPOTrainer(cfg).fit()


def test_the_hf_engine_is_refused(micro_model, task_files, tmp_path):
    """rollout.name=auto picks the hf engine on the CPU, which records nothing."""
    from archer.trainer.ppo import PPOTrainer

    _, cfg = _moe_run(
        _olmoe, micro_model, task_files, tmp_path, "actor_rollout_ref.actor.router_replay.mode=R3"
    )
    cfg.actor_rollout_ref.rollout.name = "auto"
    with pytest.raises(ArcherError, match="needs the fast engine"):
        PPOTrainer(cfg).fit()


@BUILDS
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_r2_records_the_old_log_prob_pass_own_experts(parts, build, packed):
    tokenizer = parts[1]
    batch = _rollout(build(len(tokenizer)), tokenizer)
    trainer = _perturbed(build(len(tokenizer)))
    if packed:
        use_packed_attention(trainer)
    rows = batch.select(["input_ids", "attention_mask", "position_ids", "responses"])
    out = torch.full(batch[ROUTED_EXPERTS].shape, -2, dtype=torch.int16)
    micro = MicroBatching(2, None, packed=packed)  # three micro-batches of two rows
    plain, _ = compute_log_probs(
        trainer,
        rows,
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
    )
    logp, _ = compute_log_probs(
        trainer,
        rows,
        temperature=1.0,
        micro=micro,
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
        routing=ReplaySettings(own=True),
        routes_out=out,
    )
    assert torch.equal(logp, plain)  # recording changes nothing
    mask = batch["attention_mask"].bool()
    assert bool((out[~mask] == -1).all())  # padding: nothing recorded
    own = _own_routes(trainer, batch)
    assert torch.equal(out[mask].long(), own[mask])
    # replayed, the records give the pass's own log-probs back
    replayed, _ = compute_log_probs(
        trainer,
        Batch({**rows.tensors, ROUTED_EXPERTS: out}),
        temperature=1.0,
        micro=MicroBatching(None, None, packed=False),
        chunk_size=None,
        device=torch.device("cpu"),
        compute_entropy=False,
        routing=ReplaySettings(replay=True),
    )
    torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=0)


def test_r2_grpo_run_replays_the_old_log_prob_routing(micro_model, task_files, tmp_path, monkeypatch):
    """Two GRPO steps with router_replay.mode=R2 on the CPU with the hf engine (nothing recorded while
    generating): the update's micro-batches replay the old-log-prob pass's routing; no mismatch metric."""
    from archer.models import router_replay
    from archer.trainer.ppo import PPOTrainer
    from archer.workers import actor

    replayed: list[int] = []

    def spy(model, layout_of, rows, device, *, replay, count):
        if ROUTED_EXPERTS in rows.tensors:
            replayed.append(int((rows[ROUTED_EXPERTS] >= 0).sum()))
        return router_replay.micro_batch_replay(model, layout_of, rows, device, replay=replay, count=count)

    monkeypatch.setattr(actor, "micro_batch_replay", spy)
    run, cfg = _moe_run(
        _olmoe, micro_model, task_files, tmp_path, "actor_rollout_ref.actor.router_replay.mode=R2"
    )
    cfg.actor_rollout_ref.rollout.name = "hf"
    PPOTrainer(cfg).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["actor/grad_norm"] > 0 for m in metrics)
    assert not any(key.startswith("actor/router_mismatch") for m in metrics for key in m)
    assert replayed and all(n > 0 for n in replayed)
