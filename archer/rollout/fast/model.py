"""FastModel: the fast engine's own forward of the Qwen2 family (Qwen2 / Qwen2.5 with q/k/v bias, Qwen3 with
per-head q/k RMSNorm, LLaMA-style models: the same decoder shape) and of its Mixture-of-Experts kin (Qwen3-MoE:
Qwen3's attention, sparse blocks on the layers its ``decoder_sparse_step`` / ``mlp_only_layers`` pick; OLMoE:
q/k RMSNorm over the whole projection, ``clip_qkv``, every layer sparse), on its own weights. Sliding-window
layers run too: Mistral's window on every layer, Qwen2 / Qwen3's ``use_sliding_window`` layers (``layer_types``),
and Gemma 3 (``gemma3_text``: local and global layers alternating, each kind with its own RoPE table, Gemma's
(1 + weight) RMSNorms around attention and MLP, GELU-tanh, the embedding scaled by sqrt(hidden), queries scaled by
``query_pre_attn_scalar``, the final logits soft-capped where the config says so). A sparse block
routes and runs its experts through models/moe.py, the kernels the trainer's passes use (grouped matmuls, no
host waits, so the decode CUDA graphs hold it as they hold a dense MLP). With ``record_routes`` (routing replay,
models/router_replay.py) each forward keeps its tokens' expert ids, int16 [tokens, sparse layers, top_k], in
``routes``.

The weights live in tensors allocated once, with q/k/v and gate/up fused into one matrix each; ``load``
copies a stream of the actor's named weights (plain or LoRA-merged, models/lora.py) into them in place, so
their addresses (and the CUDA graphs that read them) stay valid across updates. RoPE tables come from the actor's own rotary module, so every static rope type
(default, linear, llama3, yarn ...) gives the training forward's angles. An architecture outside this family
is refused with an error that names the Hugging Face engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from archer.errors import ArcherError
from archer.models.logprobs import backbone_of
from archer.models.lora import policy_weights
from archer.models.moe import grouped_experts, is_fused_experts, route
from archer.rollout.base import copy_weights
from archer.rollout.fast import ops

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "gemma3_text", "qwen3_moe", "olmoe")
_FALLBACK = "use actor_rollout_ref.rollout.name=hf (the Hugging Face engine runs any causal LM)"


@dataclass(frozen=True)
class ModelSpec:
    """The decoder's shape and the variant's switches."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tied: bool
    full_qk_norm: bool = False  # OLMoE: q/k RMSNorm over the whole projection, not per head
    clip_qkv: float | None = None
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()
    windows: tuple[int, ...] = ()  # per layer: the keys a query sees (its own and window - 1 before); 0: all
    layer_types: tuple[str, ...] = ()  # per layer (transformers' layer_types), where the kinds' RoPE tables differ
    gemma: bool = False  # Gemma's (1 + weight) norms, post-attention / post-MLP norms, GELU-tanh, scaled embedding
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def _unsupported(what: str) -> ArcherError:
    return ArcherError(f"the fast rollout engine does not support {what}", _FALLBACK)


def _unwrapped(module: nn.Module | None) -> nn.Module:
    """The module under peft's LoRA wrappers (a ParamWrapper around an MoE's router or experts), or an empty one."""
    while module is not None and hasattr(module, "get_base_layer"):
        module = module.get_base_layer()
    return nn.Module() if module is None else module


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two weights share one storage (a tied LM head). A sharded (FSDP2) weight is compared by its rank's
    shard: a DTensor's own data_ptr is 0, as every tensor's is on the meta device (the memory plan's tests)."""
    a, b = (w.to_local() if hasattr(w, "to_local") else w for w in (a, b))
    return not a.is_meta and a.data_ptr() == b.data_ptr()


def model_spec(model: nn.Module) -> ModelSpec:
    """The spec of a Hugging Face causal LM, or an ArcherError naming what the fast engine cannot run."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(f"{type(model).__name__} (model_type {model_type!r}); it runs the "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)} architectures")
    gemma = model_type == "gemma3_text"
    activation = getattr(config, "hidden_activation" if gemma else "hidden_act", "silu")
    if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise _unsupported(f"hidden_act={activation!r} (only silu; Gemma 3: gelu_pytorch_tanh)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise _unsupported("attn_logit_softcapping (soft-capped attention scores)")
    if getattr(config, "use_bidirectional_attention", False):
        raise _unsupported("use_bidirectional_attention=True")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for params in rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]:
        rope_type = str(params.get("rope_type", params.get("type", "default")))  # Gemma 3: one per layer kind
        if "dynamic" in rope_type or "longrope" in rope_type:
            raise _unsupported(f"rope_type={rope_type!r} (its angles change with the sequence length)")
    if getattr(config, "mlp_bias", False):
        raise _unsupported("mlp_bias=True")
    backbone = backbone_of(model)
    if not hasattr(backbone, "rotary_emb") or not hasattr(backbone, "layers"):
        raise _unsupported(f"{type(model).__name__}: no rotary_emb / layers on its backbone")
    attn = backbone.layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise _unsupported(f"{heads} attention heads over {kv_heads} key/value heads")
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embed.weight or _same_storage(head.weight, embed.weight)
    if getattr(head, "bias", None) is not None:
        raise _unsupported("an LM head with a bias")
    full_qk_norm = model_type == "olmoe"
    sparse = tuple(is_fused_experts(_unwrapped(getattr(getattr(layer, "mlp", None), "experts", None)))
                   for layer in backbone.layers)
    moe = {}
    if any(sparse):
        block = next(layer.mlp for layer, on in zip(backbone.layers, sparse, strict=True) if on)
        experts, router = _unwrapped(block.experts), _unwrapped(block.gate)
        moe = {"experts": experts.gate_up_proj.shape[0], "top_k": int(router.top_k),
               "expert_intermediate": experts.down_proj.shape[2],
               "norm_topk_prob": bool(router.norm_topk_prob), "sparse_layers": sparse}
    if gemma:
        moe.update(gemma=True, attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
                   logit_softcap=getattr(config, "final_logit_softcapping", None),
                   layer_types=tuple(config.layer_types))
    return ModelSpec(
        model_type=model_type, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, intermediate=config.intermediate_size, vocab=embed.weight.shape[0],
        eps=float(config.rms_norm_eps), qkv_bias=attn.q_proj.bias is not None, o_bias=attn.o_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm") and not full_qk_norm, tied=tied, full_qk_norm=full_qk_norm,
        clip_qkv=getattr(config, "clip_qkv", None), windows=layer_windows(config), **moe,
    )


def layer_windows(config) -> tuple[int, ...]:
    """Each layer's sliding window (transformers' mask: a query at p sees the keys at p - window < k <= p), 0 for
    a layer that sees every earlier key; () where no layer has a window. ``layer_types`` names the kind of each
    layer (Qwen2 / Qwen3 / Gemma 3); without it (Mistral) a set ``sliding_window`` is every layer's."""
    window = getattr(config, "sliding_window", None) or 0
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        windows = (int(window),) * config.num_hidden_layers
    else:
        other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if other:
            raise _unsupported(f"attention layers of kind {', '.join(other)} (only full_attention and "
                               "sliding_attention)")
        windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of FastModel's weight copy of ``spec`` in ``dtype`` (embedding, LM head unless tied, norms, layers)."""
    hidden, inter = spec.hidden, spec.intermediate
    layer = (2 * hidden + spec.qkv_width * hidden + hidden * spec.heads * spec.head_dim
             + (spec.qkv_width if spec.qkv_bias else 0) + (hidden if spec.o_bias else 0)
             + (2 * spec.head_dim if spec.qk_norm else 0)
             + ((spec.heads + spec.kv_heads) * spec.head_dim if spec.full_qk_norm else 0)
             + (2 * hidden if spec.gemma else 0))
    sparse = sum(spec.sparse_layers)
    dense_mlp = 3 * inter * hidden * (spec.layers - sparse)
    sparse_mlp = sparse * spec.experts * (3 * spec.expert_intermediate * hidden + hidden)  # experts + router
    embeddings = spec.vocab * hidden * (1 if spec.tied else 2)
    return (embeddings + hidden + spec.layers * layer + dense_mlp + sparse_mlp) * dtype.itemsize


def check_device_support(spec: ModelSpec, device: torch.device) -> None:
    """An ArcherError naming ``rollout.name=hf`` where the engine's kernels on ``device`` cannot run ``spec``: on a
    GPU with the Triton kernels, a head size that is not a power of two >= 16."""
    head_dim = spec.head_dim
    if device.type == "cuda" and ops.kernels is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise _unsupported(f"head_dim={head_dim} on a GPU (its kernels need a power of two >= 16)")


class _Layer:
    """One decoder layer's weights (fused q/k/v and gate/up)."""

    def __init__(self, spec: ModelSpec, sparse: bool, **kw) -> None:
        hidden, inter = spec.hidden, spec.intermediate
        self.ln1 = torch.empty(hidden, **kw)
        self.qkv_w = torch.empty(spec.qkv_width, hidden, **kw)
        self.qkv_b = torch.empty(spec.qkv_width, **kw) if spec.qkv_bias else None
        self.q_norm = torch.empty(spec.head_dim, **kw) if spec.qk_norm else None
        self.k_norm = torch.empty(spec.head_dim, **kw) if spec.qk_norm else None
        self.o_w = torch.empty(hidden, spec.heads * spec.head_dim, **kw)
        self.o_b = torch.empty(hidden, **kw) if spec.o_bias else None
        q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.q_full_norm = torch.empty(q_rows, **kw) if spec.full_qk_norm else None
        self.k_full_norm = torch.empty(kv_rows, **kw) if spec.full_qk_norm else None
        self.ln2 = torch.empty(hidden, **kw)
        self.post_attn = torch.empty(hidden, **kw) if spec.gemma else None
        self.post_mlp = torch.empty(hidden, **kw) if spec.gemma else None
        self.sparse = sparse
        if sparse:
            experts, expert_inter = spec.experts, spec.expert_intermediate
            self.router_w = torch.empty(experts, hidden, **kw)
            self.gate_up_w = torch.empty(experts, 2 * expert_inter, hidden, **kw)
            self.down_w = torch.empty(experts, hidden, expert_inter, **kw)
        else:
            self.gate_up_w = torch.empty(2 * inter, hidden, **kw)
            self.down_w = torch.empty(hidden, inter, **kw)

    def targets(self, prefix: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The tensor (or fused slice) each of the layer's weights goes into, by its state-dict name."""
        q_rows, kv_rows = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        out = {"input_layernorm.weight": self.ln1, "post_attention_layernorm.weight": self.ln2,
               "self_attn.o_proj.weight": self.o_w}
        for proj, part in zip(("q", "k", "v"), self.qkv_w.split([q_rows, kv_rows, kv_rows]), strict=True):
            out[f"self_attn.{proj}_proj.weight"] = part
        if self.qkv_b is not None:
            for proj, part in zip(("q", "k", "v"), self.qkv_b.split([q_rows, kv_rows, kv_rows]), strict=True):
                out[f"self_attn.{proj}_proj.bias"] = part
        if self.q_norm is not None:
            out["self_attn.q_norm.weight"], out["self_attn.k_norm.weight"] = self.q_norm, self.k_norm
        if self.o_b is not None:
            out["self_attn.o_proj.bias"] = self.o_b
        if self.q_full_norm is not None:
            out["self_attn.q_norm.weight"], out["self_attn.k_norm.weight"] = self.q_full_norm, self.k_full_norm
        if self.post_attn is not None:  # Gemma: ln2 is the norm before the MLP
            out["pre_feedforward_layernorm.weight"], out["post_attention_layernorm.weight"] = self.ln2, self.post_attn
            out["post_feedforward_layernorm.weight"] = self.post_mlp
        if self.sparse:
            out["mlp.gate.weight"] = self.router_w
            out["mlp.experts.gate_up_proj"], out["mlp.experts.down_proj"] = self.gate_up_w, self.down_w
        else:
            out["mlp.gate_proj.weight"], out["mlp.up_proj.weight"] = self.gate_up_w.chunk(2)
            out["mlp.down_proj.weight"] = self.down_w
        return {f"{prefix}.{name}": tensor for name, tensor in out.items()}


class FastModel:
    """The forward over a paged KV cache: ``prefill`` (many tokens per row, no logits) and ``decode_logits``
    (one token per row). ``max_len`` bounds the positions (the RoPE table's length)."""

    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype, max_len: int,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Shaped after ``model`` (its config, modules and rotary tables) and filled from ``weights`` (default: the
        model's own, ``policy_weights(model)``; a sharded model passes its stream of full tensors)."""
        self.spec = model_spec(model)
        check_device_support(self.spec, device)
        self.device, self.dtype, self.max_len = device, dtype, max_len
        self.released = True
        self.rope = self._rope_tables(model)
        self.scale = self.spec.attention_scale or self.spec.head_dim ** -0.5
        self.windows = self.spec.windows or (0,) * self.spec.layers
        # Gemma: the embedding times sqrt(hidden), rounded to the activation dtype (as transformers scales it)
        self.embed_scale = (torch.tensor(self.spec.hidden ** 0.5).to(device=device, dtype=dtype)
                            if self.spec.gemma else None)
        self.names = self._weight_names(model)
        self.record_routes = False  # routing replay: keep each forward's expert ids in ``routes``
        self.routes: torch.Tensor | None = None  # int16 [tokens, sparse layers, top_k] of the last forward
        self.load(policy_weights(model) if weights is None else weights)

    def _allocate(self) -> None:
        kw = {"device": self.device, "dtype": self.dtype}
        spec = self.spec
        self.embed = torch.empty(spec.vocab, spec.hidden, **kw)
        self.lm_head = self.embed if spec.tied else torch.empty(spec.vocab, spec.hidden, **kw)
        self.norm = torch.empty(spec.hidden, **kw)
        self.layers = [_Layer(spec, bool(spec.sparse_layers and spec.sparse_layers[i]), **kw)
                       for i in range(spec.layers)]
        self.released = False

    def release(self) -> None:
        """Free the weight copy (``load`` allocates it again; CUDA graphs that read it must be dropped first)."""
        self.embed = self.lm_head = self.norm = None
        self.layers = []
        self.released = True

    def _rope_tables(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's float32 cos / sin [max_len, head_dim / 2] from the model's own rotary module (one table for
        every layer, or one per kind of layer where the module takes the kind: Gemma 3's local and global)."""
        rotary = backbone_of(model).rotary_emb
        probe = next(rotary.buffers(), None)
        where = probe.device if probe is not None else torch.device("cpu")
        positions = torch.arange(self.max_len, device=where).unsqueeze(0)
        half = self.spec.head_dim // 2
        tables = {}
        for kind in dict.fromkeys(self.spec.layer_types or (None,)):
            with torch.no_grad():
                cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=where), positions,
                                  *(() if kind is None else (kind,)))
            tables[kind] = (cos[0, :, :half].float().to(self.device).contiguous(),
                            sin[0, :, :half].float().to(self.device).contiguous())
        return [tables[kind] for kind in self.spec.layer_types or (None,) * self.spec.layers]

    @staticmethod
    def _weight_names(model: nn.Module) -> tuple[str, str, str]:
        """The state-dict prefixes of the model's input embedding, LM head and backbone."""
        names = {id(module): name for name, module in model.named_modules()}
        return (names[id(model.get_input_embeddings())], names[id(model.get_output_embeddings())],
                names[id(backbone_of(model))])

    def targets(self) -> dict[str, torch.Tensor]:
        """The engine tensor (or fused slice) each of the policy's weights goes into, by its state-dict name."""
        embed, lm_head, backbone = self.names
        out = {f"{embed}.weight": self.embed, f"{backbone}.norm.weight": self.norm}
        if not self.spec.tied:
            out[f"{lm_head}.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            out.update(layer.targets(f"{backbone}.layers.{i}", self.spec))
        return out

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's weights, a stream of (state-dict name, tensor) pairs (models/lora.py's
        ``policy_weights``: plain or LoRA-merged), into this model's tensors, in place (allocating them after
        ``release``)."""
        if self.released:
            self._allocate()
        copy_weights(self.targets(), weights, engine="fast",
                     fix="sync the engine from the actor it was built on; " + _FALLBACK)
        if self.spec.gemma:  # Gemma's RMSNorms scale by (1 + weight): the engine's norms by their weight
            for layer in self.layers:
                for norm in (layer.ln1, layer.ln2, layer.post_attn, layer.post_mlp, layer.q_norm, layer.k_norm):
                    norm.add_(1.0)
            self.norm.add_(1.0)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: list[tuple],
                attend) -> torch.Tensor:
        """The decoder stack on token rows x [N, hidden]; ``attend(q, layer)`` runs one layer's attention."""
        spec, residual, picked = self.spec, None, []
        for i, layer in enumerate(self.layers):
            h, residual = ops.add_rmsnorm(x, residual, layer.ln1, spec.eps)
            qkv = self._qkv(h, layer)
            q = ops.rope_store(qkv, positions, slots, *self.rope[i], layer.q_norm, layer.k_norm, spec.eps,
                               *kv[i], spec.heads)
            x = F.linear(attend(q, i), layer.o_w, layer.o_b)
            if layer.post_attn is not None:
                x = ops.rmsnorm(x, layer.post_attn, spec.eps)
            h, residual = ops.add_rmsnorm(x, residual, layer.ln2, spec.eps)
            if layer.sparse:
                weights, ids = route(F.linear(h, layer.router_w), spec.top_k, spec.norm_topk_prob)
                picked.append(ids)
                x = grouped_experts(h, ids, weights, layer.gate_up_w, layer.down_w)
            elif layer.post_mlp is not None:
                x = ops.rmsnorm(F.linear(ops.gelu_tanh_mul(F.linear(h, layer.gate_up_w)), layer.down_w),
                                layer.post_mlp, spec.eps)
            else:
                x = F.linear(ops.silu_mul(F.linear(h, layer.gate_up_w)), layer.down_w)
        if self.record_routes and picked:
            self.routes = torch.stack(picked, dim=1).to(torch.int16)
        return ops.add_rmsnorm(x, residual, self.norm, spec.eps)[0]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``tokens`` (Gemma's times sqrt(hidden))."""
        x = F.embedding(tokens, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def _qkv(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The fused q/k/v rows of normed inputs ``h``; OLMoE's q/k norms over the whole projection and its
        ``clip_qkv`` applied here (Qwen3's per-head norms are ``rope_store``'s)."""
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
        spec = self.spec
        if layer.q_full_norm is not None:
            kv_rows = spec.kv_heads * spec.head_dim
            q, k, v = qkv.split([spec.heads * spec.head_dim, kv_rows, kv_rows], dim=-1)
            qkv = torch.cat([ops.rmsnorm(q, layer.q_full_norm, spec.eps), ops.rmsnorm(k, layer.k_full_norm, spec.eps),
                             v], dim=-1)
        if spec.clip_qkv is not None:
            qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
        return qkv

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, kv: list[tuple], splits: int) -> torch.Tensor:
        """Logits [B, vocab] (activation dtype) after one input token per row at ``positions``; each row's
        key/value go to token ``slots`` and its attention reads the pages in its ``tables`` row."""
        ctx = positions + 1

        def attend(q: torch.Tensor, i: int) -> torch.Tensor:
            return ops.decode_attention(q, *kv[i], tables, ctx, self.scale, splits, window=self.windows[i])

        hidden = self._layers(self._embed(tokens), positions, slots, kv, attend)
        logits = F.linear(hidden, self.lm_head)
        cap = self.spec.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                kv_len: torch.Tensor, kv: list[tuple], *, max_kv: int, fresh: bool) -> None:
        """Write the keys/values of right-padded token rows [R, T] at ``positions`` (slots [R * T]); row r
        attends to its first ``kv_len[r]`` (<= ``max_kv``) cached positions, causally. ``fresh``: every
        row starts at position 0."""
        rows, length = tokens.shape
        spec = self.spec

        def attend(q: torch.Tensor, i: int) -> torch.Tensor:
            q = q.view(rows, length, spec.heads, spec.head_dim).transpose(1, 2)
            out = ops.paged_attention(q, *kv[i], tables, positions, kv_len, self.scale, max_kv=max_kv, fresh=fresh,
                                      window=self.windows[i])
            return out.reshape(rows * length, -1)

        self._layers(self._embed(tokens.flatten()), positions.flatten(), slots, kv, attend)
