"""A decoder's shape: layers, widths, vocabulary, experts, attention kind; what it weighs and computes per token.

Torch-free: the planner sizes a model from these numbers before anything loads (plan/config_shape.py reads them
from a config.json)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardfit.plan.audio import AudioShape
from shardfit.plan.media import SoftTokenTower, VisionShape

# Gated DeltaNet's chunk: fla's chunk_gated_delta_rule and transformers' torch_chunk_gated_delta_rule run the delta
# rule over 64-token chunks.
DELTA_CHUNK = 64


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: queries through a `q_rank` bottleneck (0: a plain projection), keys
    and values through one `kv_rank` latent shared by every head, a `rope`-wide rotary part of q and k beside their
    `nope`-wide part, values `v` wide per head."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v: int


@dataclass(frozen=True)
class Block:
    """One kind of decoder block: whether it holds a mixture of experts (`moe`) and whether its token mixer is Gated
    DeltaNet linear attention (`linear`) rather than softmax attention. Truthy exactly when it holds a mixture, so a
    `per_block(moe)` callback that only asks whether the block is a mixture reads it as the bool it stands for."""

    moe: bool
    linear: bool = False
    # A block of one part only (ModelShape `single_part`, Nemotron-H): MAMBA, ATTENTION, MLP or MOE; "" for a
    # block of a token mixer and an MLP or mixture.
    part: str = ""
    # A block whose token mixer is a Mamba mixer (ModelShape `mamba_mixers`), paired with its MLP or mixture.
    mamba: bool = False

    def __bool__(self) -> bool:
        return self.moe


MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"


@dataclass(frozen=True)
class BlockGroup:
    """Blocks that mix tokens alike other than by softmax attention over the whole causal prefix, for the time model
    (plan/flops.py `softmax_groups`): their `attention` (window | chunk | sparse: their own `span`, the window's or
    chunk's tokens or the indexer's top-k, 0 where unknown: the whole prefix; full: the whole prefix; none: no
    softmax attention, a recurrent block's), the forward FLOPs per token of their `recurrence` (a state each token
    updates: Mamba's scan, RG-LRU, a short convolution, linear attention), and a sparse block's indexer (`index`:
    its heads times their width)."""

    blocks: int
    attention: str = "full"
    span: int = 0
    recurrence: float = 0.0
    index: int = 0


@dataclass(frozen=True)
class ModelShape:
    id: str
    layers: int
    hidden: int
    # a dense block's MLP width (for a mixture without `moe_intermediate`, one expert's: Mixtral's naming)
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None
    experts: int = 1
    top_k: int = 1
    # outside the decoder: a multimodal model's vision and audio towers (counted in `vision` and `audio` too)
    extra_params: int = 0
    vision: VisionShape | None = None
    audio: AudioShape | None = None
    soft_tower: SoftTokenTower | None = None  # Gemma 3: a fixed number of soft tokens per image
    # A tower none of the three above describes (LLaVA's CLIP, Mistral 3's Pixtral, InternVL's, ...): its weights are
    # in `extra_params`; the rules refuse to split or cut it as they refuse any tower they do not run.
    other_tower: bool = False
    # A mixture of experts: one routed expert's width (0: `intermediate`), the width of the experts every token
    # runs (shared experts, summed), and how many blocks keep a dense MLP of `intermediate` instead.
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0
    # whether those dense blocks come first (GLM-4.5's and DeepSeek-V3's first_k_dense_replace), not interleaved
    # with the mixture's (Llama 4's interleave_moe_layer_step): which blocks a pipeline stage's share holds
    dense_first: bool = True
    # config.json's model_type (a catalog entry states its published config's; "" where not known): which of peft's
    # transformers-5 rewrites of a mixture's LoRA targets applies (foreign/targets.py `peft_rewrite`), and peft's
    # default targets for a LoraConfig without any (`plan_peft_default`).
    model_type: str = ""
    mla: MLA | None = None
    attn_bias: bool = False  # q/k/v projections with biases
    o_bias: bool = False  # the attention's output projection with a bias (most families' attention_bias sets both)
    # Blocks that attend over less than the whole sequence: the window (Llama 4: the chunk; 1 for blocks with
    # neither, as recurrent ones) and how many blocks (the rest attend to the whole sequence), which the rules
    # refuse alike, and what those blocks are (plan/attention_layout.py KINDS; empty: a window, as the catalog's
    # entries state it), which the refusal names.
    sliding_window: int = 0
    sliding_layers: int = 0
    attention_kinds: tuple[str, ...] = ()
    attention_chunked: bool = False  # the partial blocks attend within chunks (Llama 4), not sliding windows
    # The same blocks kind by kind, where a config.json was read (empty: `sliding_*` describe them all).
    attention_groups: tuple[BlockGroup, ...] = ()
    # Llama 4's text experts (transformers' Llama4TextExperts): every token runs through every routed expert, the
    # ones it was not routed to with a routing score of 0, instead of through its top-k.
    every_expert: bool = False
    # gpt-oss (transformers' GptOssExperts, GptOssTopKRouter, GptOssAttention): experts whose activation is a
    # clamped SwiGLU, (clamp(up) + 1) * g * sigmoid(alpha * g) with g = clamp(gate), and a router that softmaxes only
    # the top-k logits; attention whose softmax also runs over a learned sink logit per head.
    clamped_swiglu: bool = False
    attention_sinks: bool = False
    # The attention probabilities' dropout in training (config.json's attention_dropout, GPT-2-era attn_pdrop; 0.1
    # in their published configs): under eager its own kernels over the scores (plan/timing.py `eager_score_bytes`).
    attn_dropout: float = 0.0
    # Attention logit softcapping (config.json's attn_logit_softcapping: Gemma 2's 50, null or absent for none):
    # eager attention's scores then run through a tanh (plan/eager_scores.py `score_chain`).
    attn_softcap: float = 0.0
    # A language model whose class has no SDPA under the installed transformers (plan/sdpa_classes.py `runs_eager`;
    # a foreign job's plan, under its --transformers): `sdpa` (transformers' default) runs eager.
    eager_only: bool = False
    # A composite's text config's model_type (PaliGemma 2's gemma2), whose class picks the decoder's kernel; empty:
    # `model_type`'s own.
    text_model_type: str = ""
    # A flash-attention class that passes the kernel no window (FLASH_UNWINDOWED_TYPES): windows are whole rows there.
    flash_unwindowed: bool = False
    # Qwen3-Next and Qwen3.5 (transformers' *GatedDeltaNet): `linear_layers` blocks mix tokens with Gated DeltaNet
    # linear attention instead of softmax attention (`linear_dense_layers` of them keep a dense MLP in a mixture);
    # its key and value heads and their widths, its depthwise convolution's kernel, and whether its input
    # projections are fused (Qwen3-Next's in_proj_qkvz and in_proj_ba; Qwen3.5 splits them into qkv, z, b, a).
    linear_layers: int = 0
    linear_dense_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 4
    linear_fused: bool = False
    # OLMo hybrid's Gated DeltaNet: q, k and v projected apart under softmax attention's names (q_proj, k_proj,
    # v_proj, o_proj, which q/k/v/o LoRA targets reach), its output gate g_proj beside a_proj and b_proj.
    linear_split: bool = False
    # The same families' softmax attention: q_proj twice as wide (its second half gates the output), RMSNorms
    # on q and k; their shared experts scaled by a one-output linear gate (also Qwen2-MoE's).
    gated_attention: bool = False
    shared_gate: bool = False
    # The softmax attention's q and k norm weights together, where a family normalizes them (OLMo 2 across all
    # heads, Qwen3 per head; gated attention's are counted with it).
    qk_norm: int = 0
    # A per-layer config whose blocks' attention heads differ: each count, largest first (empty: every block has
    # `heads`). A sequence-parallel split must divide them all (resolve/sequence.py).
    block_heads: tuple[int, ...] = ()
    # NVIDIA Nemotron-H (transformers' NemotronHBlock): each block is ONE part under its own norm, a Mamba-2 mixer
    # (`mamba_layers`), softmax attention (`attention_layers`), a dense MLP (the rest of `dense_layers`) or a
    # mixture (`moe_layers`); no block pairs a mixer with an MLP.
    single_part: bool = False
    mamba_layers: int = 0
    attention_layers: int = 0
    # Its Mamba-2 mixer (NemotronHMamba2Mixer): heads of `mamba_head_dim` channels, a state of `mamba_state` per
    # channel, B and C in `mamba_groups` groups, a depthwise convolution of `mamba_conv` taps (with a bias under
    # `mamba_conv_bias`), in_proj and out_proj biased under `mamba_bias`.
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_conv: int = 4
    mamba_conv_bias: bool = False
    mamba_bias: bool = False
    mamba_chunk: int = 128  # the tokens its chunked scan (SSD) works on at once
    # Mamba hybrids whose blocks pair a token mixer with an MLP or mixture (plan/mamba_hybrid.py: Jamba, Bamba,
    # Falcon-H1, IBM Granite 4.0): `mamba_mixers` blocks mix tokens with the Mamba mixer above instead of softmax
    # attention (Falcon-H1, `mamba_parallel`: beside it, in every block), `mamba_dense_mixers` of them with a dense
    # MLP in a model of mixtures. Its out_proj is biased under `mamba_out_bias` (None: as `mamba_bias`), its
    # output normed by a gated RMSNorm under `mamba_gated_norm`. A Mamba-1 mixer (`mamba_v1`, Jamba's) has no heads:
    # one head of all its channels (`mamba_head_dim`), a state of `mamba_state` per channel, a `mamba_dt_rank`-wide
    # step projection and, under `mamba_inner_norms`, RMSNorms over its step, B and C.
    mamba_mixers: int = 0
    mamba_dense_mixers: int = 0
    mamba_parallel: bool = False
    mamba_out_bias: bool | None = None
    mamba_gated_norm: bool = True
    mamba_v1: bool = False
    mamba_dt_rank: int = 0
    mamba_inner_norms: bool = False
    # Zamba's Mamba-1 mixer holds its x_proj and dt_proj as bare weights, one slice a head, not linear layers: no
    # LoRA reaches them (named `weight_` instead of `linear_`).
    mamba_bare_projections: bool = False
    # MLPs and experts of two matrices (up, an activation such as relu2, down; no gate), biased under `mlp_bias`;
    # routed experts through a `moe_latent`-wide projection of the hidden state (0: none).
    two_matrix: bool = False
    mlp_bias: bool = False
    moe_latent: int = 0
    # Norms and biases a family's class builds beyond two RMSNorms a block and a bias-free head (plan/family_rules.py):
    # the norms a block holds (one in a parallel block: Phi's, Falcon's; 0: weightless norms), whether each (and the
    # final one) is a LayerNorm with a bias, the weights of a dense block's MLP beyond its three planned matrices
    # (its biases, at its real widths, and what planning a two-matrix MLP as three of 2/3 the width rounds away), a
    # bias on the output head (Phi's), the rows of a learned position embedding (GPT-Neo's), and a learned bias per
    # expert on a mixture's routing scores (ERNIE 4.5's).
    norms: int = 2
    norm_bias: bool = False
    mlp_extra: int = 0
    head_bias: bool = False
    positions: int = 0
    score_bias: bool = False
    # DeepSeek-V3's router (and GLM-4.5's, Nemotron-H's: plan/config_shape.py GROUP_ROUTER_TYPES): an fp32 linear
    # over the input upcast to fp32, sigmoid scores, the top-k experts of the best `router_topk_groups` of
    # `router_groups` groups (0: a softmax router).
    router_groups: int = 0
    router_topk_groups: int = 0
    embed_norm: bool = False  # a norm over the embedding's output (BLOOM's), as wide as the final one
    # Per-layer embeddings (Gemma 4's PLE): a second table of `per_layer_vocab` rows, `layers` x `per_layer_input`
    # wide, beside a projection of the hidden state to the same width and a norm; each block gates its slice in (a
    # hidden -> per_layer_input gate, a projection back, a norm).
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # Zamba's and Zamba2's transformer blocks that the "hybrid" blocks share (plan/shared_blocks.py): their
    # weights once, with what each use holds of its own (its linear, Zamba2's adapters), and every linear module
    # the hybrid blocks hold, one copy per use, as LoRA adapts them (PEFT wraps each copy apart); the linear weights
    # the hybrid blocks compute with, summed over the uses (for the time model).
    shared_params: int = 0
    shared_linears: tuple[tuple[str, int, int], ...] = ()
    shared_active: int = 0
    shared_uses: int = 0  # the hybrid blocks: each runs a shared block once

    @property
    def hd(self) -> int:
        """The width of one head's queries and keys (MLA: its no-rotary and rotary parts together)."""
        if self.mla is not None:
            return self.mla.nope + self.mla.rope
        return self.head_dim or self.hidden // self.heads

    @property
    def multimodal(self) -> bool:
        """Whether the model has a vision or audio tower of any kind."""
        return self.vision is not None or self.audio is not None or self.soft_tower is not None or self.other_tower

    @property
    def moe(self) -> bool:
        return self.experts > 1

    @property
    def expert_width(self) -> int:
        return self.moe_intermediate or self.intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def attention_linears(self) -> list[tuple[str, int, int]]:
        """(LoRA target name, in, out) of a block's attention projections; MLA's count as `q` and `k`."""
        h = self.hidden
        if self.mla is not None:
            m = self.mla
            q = [("q", h, m.q_rank), ("q", m.q_rank, self.heads * self.hd)] if m.q_rank else \
                [("q", h, self.heads * self.hd)]
            return q + [("k", h, m.kv_rank + m.rope), ("k", m.kv_rank, self.heads * (m.nope + m.v)),
                        ("o", self.heads * m.v, h)]
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        return [("q", h, q * (2 if self.gated_attention else 1)), ("k", h, kv), ("v", h, kv), ("o", q, h)]

    def linear_attention_linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of a Gated DeltaNet block's projections: queries, keys and values (into the convolution),
        the output gate z, the per-value-head beta and decay inputs b and a, and the output projection. Names start
        with `linear_` (LoRA adapts them under all-linear only: no q_proj...down_proj name matches them)."""
        h, k, v = self.hidden, self.linear_k_heads * self.linear_k_dim, self.linear_v_heads * self.linear_v_dim
        heads = self.linear_v_heads
        if self.linear_fused:
            inputs = [("linear_qkvz", h, 2 * k + 2 * v), ("linear_ba", h, 2 * heads)]
        elif self.linear_split:
            return [("q", h, k), ("k", h, k), ("v", h, v), ("linear_g", h, v), ("linear_b", h, heads),
                    ("linear_a", h, heads), ("o", v, h)]
        else:
            inputs = [("linear_qkv", h, 2 * k + v), ("linear_z", h, v), ("linear_b", h, heads), ("linear_a", h, heads)]
        return inputs + [("linear_out", v, h)]

    @property
    def linear_is_larger(self) -> bool:
        """Whether a Gated DeltaNet block weighs more than a softmax-attention one (what `the largest kind` of block
        takes where a caller names no kind)."""
        return self.linear_layers > 0 and (self.linear_layers >= self.layers or sum(
            i * o for _, i, o in self.linear_attention_linears()) > sum(i * o for _, i, o in self.attention_linears()))

    @property
    def mamba_blocks(self) -> int:
        """Blocks whose token mixer is a Mamba scan, of either layout (Nemotron-H's and Zamba's single-part
        `mamba_layers`, the paired `mamba_mixers` of Jamba, Bamba, Falcon-H1 and Granite 4.0): what the kernel
        choice (Workload `mamba_scan`) and its notes key on."""
        return self.mamba_layers + self.mamba_mixers

    @property
    def mamba_is_larger(self) -> bool:
        """Whether a paired block with a Mamba mixer (`mamba_mixers`) weighs more than one with softmax attention
        (what `the largest kind` of block takes where a caller names no kind)."""
        return self.mamba_mixers > 0 and (self.mamba_mixers >= self.layers or self.mamba_parallel or sum(
            i * o for _, i, o in self.mamba_linears()) > sum(i * o for _, i, o in self.attention_linears()))

    @property
    def mamba_inner(self) -> int:
        """A Mamba-2 mixer's channels: its heads times their width."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_channels(self) -> int:
        """The channels a Mamba-2 mixer's depthwise convolution runs over: x, B and C."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    def mamba_linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of a Mamba-2 mixer's projections: in_proj (z, x, B, C and dt in one) and out_proj; a
        Mamba-1 mixer's in_proj (x and z), x_proj (dt, B and C), dt_proj and out_proj. Named `linear_` as Gated
        DeltaNet's: only all-linear LoRA reaches them."""
        h, inner = self.hidden, self.mamba_inner
        if self.mamba_v1:
            rank, bare = self.mamba_dt_rank, "weight_" if self.mamba_bare_projections else "linear_"
            return [("linear_in_proj", h, 2 * inner), (bare + "x_proj", inner, rank + 2 * self.mamba_state),
                    (bare + "dt_proj", rank, inner), ("linear_out_proj", inner, h)]
        return [("linear_in_proj", h, inner + self.mamba_conv_channels + self.mamba_heads),
                ("linear_out_proj", inner, h)]

    def part_kinds(self) -> list[tuple[int, Block]]:
        """(blocks, kind) of a `single_part` model's four kinds of block (those it has)."""
        mlp = self.layers - self.moe_layers - self.mamba_layers - self.attention_layers
        kinds = [(self.moe_layers, Block(True, part=MOE)), (self.mamba_layers, Block(False, part=MAMBA)),
                 (self.attention_layers, Block(False, part=ATTENTION)), (mlp, Block(False, part=MLP))]
        return [(n, kind) for n, kind in kinds if n > 0]

    def kind_of(self, block: Block | bool | None) -> Block | bool | None:
        """`block` as a `single_part` model's kind: a Block as it is; a plain bool or None (the largest kind, or
        of the mixtures (True) or the other kinds (False)) the heaviest such kind the model has. Any other model's
        `block` is returned as it is."""
        if not self.single_part or isinstance(block, Block):
            return block
        kinds = [k for _, k in self.part_kinds() if block is None or k.moe == bool(block)] or \
            [k for _, k in self.part_kinds()]
        return max(kinds, key=lambda k: sum(i * o for _, i, o in self._part_linears(k)))

    def _part_linears(self, block: Block) -> list[tuple[str, int, int]]:
        """(name, in, out) of every linear layer of a `single_part` block of kind `block`."""
        h = self.hidden
        if block.part == MAMBA:
            return self.mamba_linears()
        if block.part == ATTENTION:
            return self.attention_linears()
        if block.part == MLP:
            return _mlp("", h, self.intermediate, gated=not self.two_matrix)
        e, d = self.expert_width, self.moe_latent or h
        up = [("expert_up", d, e)] if self.two_matrix else [("expert_gate_up", d, 2 * e)]
        experts = (up + [("expert_down", e, d)]) * self.experts
        latent = [("linear_latent_in", h, d), ("linear_latent_out", d, h)] if self.moe_latent else []
        shared = _mlp("", h, self.shared_intermediate, gated=not self.two_matrix) if self.shared_intermediate \
            else []
        return latent + experts + shared + [("router", h, self.experts)]

    def active_linear_params(self, block: Block | bool) -> float:
        """The weights of a block of kind `block`'s linear layers one token computes with: its mixer, its dense
        MLP or its top-k experts (every expert's under `every_expert`) with the shared ones, and the router."""
        block = self.kind_of(block)
        if isinstance(block, Block) and block.part:
            share = self.routed_per_token / self.experts
            return sum(i * o * (share if n.startswith("expert_") else 1) for n, i, o in self._part_linears(block))
        mixer = sum(i * o for _, i, o in self.mixer_linears(block))
        return mixer + 3 * self.hidden * self.active_mlp_width(block) + (self.hidden * self.experts if block else 0)

    def mixer_linears(self, block: Block | bool | None = None) -> list[tuple[str, int, int]]:
        """The token mixer's projections of a block of kind `block` (a plain bool or None: the largest kind)."""
        if block.mamba if isinstance(block, Block) else self.mamba_is_larger:
            return (self.attention_linears() if self.mamba_parallel else []) + self.mamba_linears()
        linear = block.linear if isinstance(block, Block) else self.linear_is_larger
        return self.linear_attention_linears() if linear else self.attention_linears()

    def named_linears(self, moe: bool | None = None) -> list[tuple[str, int, int]]:
        """(name, in, out) of every linear layer of one decoder block: a mixture's block (`moe`, the default where
        the model has one) counts each routed expert's MLP (`expert_gate_up`, `expert_down`), its shared
        experts' (as a dense MLP) and its router; a dense block its MLP of `intermediate`."""
        moe = self.kind_of(moe)
        if isinstance(moe, Block) and moe.part:
            return self._part_linears(moe)
        mixer = self.mixer_linears(moe)
        moe = self.moe_layers > 0 if moe is None else bool(moe)
        h = self.hidden
        if not moe:
            return mixer + _mlp("", h, self.intermediate) + self.per_layer_linears()
        # Routed experts as transformers 5 stores them: one fused gate/up weight and one down weight per expert.
        e = self.expert_width
        experts = [("expert_gate_up", h, 2 * e), ("expert_down", e, h)] * self.experts
        shared = _mlp("", h, self.shared_intermediate) if self.shared_intermediate else []
        if shared and self.shared_gate:
            shared.append(("shared_gate", h, 1))
        return mixer + experts + shared + [("router", h, self.experts)] + self.per_layer_linears()

    def per_layer_linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of a block's per-layer-embedding gate and projection (none without PLE)."""
        p = self.per_layer_input
        return [("linear_per_layer_gate", self.hidden, p), ("linear_per_layer_proj", p, self.hidden)] if p else []

    def per_layer_model_linears(self) -> tuple[tuple[str, int, int], ...]:
        """The per-layer embeddings' linear layer outside the blocks: the hidden state's projection (none without
        PLE)."""
        p = self.per_layer_input
        return (("linear_per_layer_model", self.hidden, self.layers * p),) if p else ()

    def per_layer_model_params(self) -> int:
        """The per-layer embeddings' weights outside the blocks: the table, the hidden state's projection to all
        blocks' slices and its norm (0 without PLE)."""
        p = self.per_layer_input
        return self.layers * p * (self.per_layer_vocab + self.hidden) + p if p else 0

    def stored_weights(self, moe: bool | None = None) -> list[tuple[str, int, int]]:
        """(name, rows, cols) of one decoder block's matrix weights as the model stores them: each linear layer's
        (out, in), and a mixture's routed experts as the two fused stacks transformers 5 keeps (all experts'
        gate/up projections in one, their down projections in the other), flattened to 2-D as QLoRA stores them
        in NF4."""
        moe = self.kind_of(moe)
        named = self.named_linears(moe)
        out = [(n, o, i) for n, i, o in named if not n.startswith("expert_")]
        for n in dict.fromkeys(n for n, _, _ in named if n.startswith("expert_")):  # one stack per expert weight
            i, o = next((i, o) for m, i, o in named if m == n)
            out.append((n, self.experts * o, i))
        return out

    @property
    def experts_always_fused(self) -> bool:
        """Whether transformers' class keeps the routed experts as fused 3-D weights in every version (gpt-oss's
        GptOssExperts and Llama 4's Llama4TextExperts from their first release), not only from transformers 5."""
        return self.moe and (self.every_expert or self.clamped_swiglu)

    def linear_shapes(self, moe: bool | None = None) -> list[tuple[int, int]]:
        """(in, out) of every linear layer in one decoder block (the largest kind: a mixture's, each expert's MLP
        counted)."""
        return [(i, o) for _, i, o in self.named_linears(moe)]

    @property
    def routed_per_token(self) -> int:
        """(token, expert) pairs a mixture's block computes per token: its top-k, or every expert (`every_expert`)."""
        return self.experts if self.every_expert else self.top_k

    def block_kinds(self) -> list[tuple[int, Block]]:
        """(how many blocks, their kind) for each kind of block the decoder holds: mixtures and dense blocks, each
        split into Gated DeltaNet and softmax-attention blocks."""
        if self.single_part:
            return self.part_kinds()
        if self.mamba_mixers:
            return self._mamba_kinds()
        dense_linear = self.linear_dense_layers if self.moe else self.linear_layers
        moe_linear = self.linear_layers - dense_linear
        dense = self.layers - self.moe_layers
        kinds = [(moe_linear, Block(True, True)), (self.moe_layers - moe_linear, Block(True)),
                 (dense_linear, Block(False, True)), (dense - dense_linear, Block(False))]
        return [(n, kind) for n, kind in kinds if n > 0]

    def _mamba_kinds(self) -> list[tuple[int, Block]]:
        """`block_kinds` of a Mamba hybrid whose blocks pair a mixer with an MLP (`mamba_mixers`)."""
        dense_mamba = self.mamba_dense_mixers if self.moe else self.mamba_mixers
        moe_mamba, dense = self.mamba_mixers - dense_mamba, self.layers - self.moe_layers
        kinds = [(moe_mamba, Block(True, mamba=True)), (self.moe_layers - moe_mamba, Block(True)),
                 (dense_mamba, Block(False, mamba=True)), (dense - dense_mamba, Block(False))]
        return [(n, kind) for n, kind in kinds if n > 0]

    def over_blocks(self, per_block: Callable[[Block], float]) -> float:
        """`per_block(kind)` summed over every decoder block (a kind is truthy for a mixture's block)."""
        return sum(n * per_block(moe) for n, moe in self.block_kinds())

    def block_extra_params(self, block: Block | bool | None = None) -> int:
        """A block's weights outside its linear layers: two norms, biases, MLA's latent norms, gated attention's q/k
        norms, gpt-oss's sinks and its experts' and router's biases; a Gated DeltaNet block's (`block`; a plain bool
        or None: the largest kind) depthwise convolution over q, k and v, its per-head decay and dt bias, and its
        gated norm over a value head."""
        block = self.kind_of(block)
        if isinstance(block, Block) and block.part:
            return self._part_extra_params(block)
        extra = self.norms * self.norm_width + (self.hidden if self.per_layer_input else 0)
        moe = block.moe if isinstance(block, Block) else self.moe_layers > 0 if block is None else bool(block)
        if moe and self.clamped_swiglu:  # gpt-oss's experts: a bias on each expert's gate/up and down, and the router's
            extra += self.experts * self.expert_biases + self.experts
        if moe and self.score_bias:
            extra += self.experts
        if not moe:
            extra += self.mlp_extra
        if block.mamba if isinstance(block, Block) else self.mamba_is_larger:
            extra += self.mamba_extra_params()
            if not self.mamba_parallel:
                return extra
        linear = block.linear if isinstance(block, Block) else self.linear_is_larger
        if linear:
            conv = 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim
            return extra + conv * self.linear_conv + 2 * self.linear_v_heads + self.linear_v_dim
        if self.gated_attention:
            extra += 2 * self.hd
        extra += self.qk_norm
        if self.mla is not None:
            extra += self.mla.q_rank + self.mla.kv_rank
        if self.attn_bias:
            extra += self.qkv_biases
        if self.o_bias:
            extra += self.hidden
        if self.attention_sinks:
            extra += self.heads
        return extra

    def _part_extra_params(self, block: Block) -> int:
        """A `single_part` block's weights outside its linear layers: its one norm; a Mamba-2 mixer's convolution
        (and its bias), dt bias, A and D per head, the gated norm over its channels, its projections' biases; an MLP's
        or a mixture's biases (shared experts and latent projections) under `mlp_bias`. Its attention has none."""
        extra = self.hidden
        if block.part == MAMBA:
            extra += self.mamba_extra_params()
        elif block.part in (MLP, MOE) and self.mlp_bias:
            extra += sum(o for n, _, o in self._part_linears(block) if n != "router" and not n.startswith("expert_"))
        return extra

    def mamba_extra_params(self) -> int:
        """A Mamba mixer's weights outside its projections: its depthwise convolution (and its bias), its
        projections' biases; Mamba-2's dt bias, A and D per head and the gated norm over its channels; Mamba-1's
        dt_proj bias and D per channel, A per channel and state, and its step's, B's and C's norms."""
        conv = self.mamba_inner if self.mamba_v1 else self.mamba_conv_channels
        extra = conv * self.mamba_conv + (conv if self.mamba_conv_bias else 0)
        linears = self.mamba_linears()
        if self.mamba_bias:
            extra += linears[0][2]
        if self.mamba_bias if self.mamba_out_bias is None else self.mamba_out_bias:
            extra += self.hidden
        if self.mamba_v1:
            extra += 2 * self.mamba_inner + self.mamba_inner * self.mamba_state
            return extra + (self.mamba_dt_rank + 2 * self.mamba_state if self.mamba_inner_norms else 0)
        return extra + 3 * self.mamba_heads + (self.mamba_inner if self.mamba_gated_norm else 0)

    @property
    def norm_width(self) -> int:
        """The weights of one norm: its scale, and a LayerNorm's bias (0: the family's norms have no weights, as
        `norms` 0 says, nor has its final norm)."""
        return self.hidden * (2 if self.norm_bias else 1) if self.norms else 0

    @property
    def final_norms(self) -> int:
        """The weights of the norms outside the blocks: the final one, and the embedding's where it has one."""
        return self.norm_width * (2 if self.embed_norm else 1)

    @property
    def expert_biases(self) -> int:
        """One routed expert's biases where its projections have them (gpt-oss's gate/up and down; else 0)."""
        return 2 * self.expert_width + self.hidden if self.clamped_swiglu else 0

    @property
    def qkv_biases(self) -> int:
        """The biases `attn_bias` puts on the attention's input projections: q, k and v; MLA's on its down
        projections only (the query's latent, where it has one, and the keys' and values' latent with their rotary
        part), its up projections have none; gated attention's q projection is twice as wide, its bias too."""
        if self.mla is not None:
            return self.mla.q_rank + self.mla.kv_rank + self.mla.rope
        return ((2 if self.gated_attention else 1) * self.heads + 2 * self.kv_heads) * self.hd

    def layer_params(self, moe: bool | None = None) -> int:
        """One decoder block's weights (the largest kind by default)."""
        return sum(i * o for i, o in self.linear_shapes(moe)) + self.block_extra_params(moe)

    def decoder_linear_params(self) -> int:
        """Every decoder block's linear weights together."""
        return int(self.over_blocks(lambda moe: sum(i * o for i, o in self.linear_shapes(moe))))

    def decoder_params(self) -> int:
        return int(self.over_blocks(self.layer_params))

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        return (self.decoder_params() + self.embed_params() + self.positions * self.hidden + self.final_norms
                + self.head_params() + self.extra_params + self.shared_params + self.per_layer_model_params())

    def head_params(self) -> int:
        """The output head's bias, where the family's head has one (its weight is `embed_params`'s)."""
        return self.vocab if self.head_bias else 0

    def active_mlp_width(self, moe: bool | None = None) -> int:
        """The MLP width one token runs through in a block: top-k experts and the shared ones, or the dense MLP (none
        in a `single_part` model's mixer blocks)."""
        if isinstance(moe, Block) and moe.part in (MAMBA, ATTENTION):
            return 0
        moe = self.moe_layers > 0 if moe is None else bool(moe)
        return self.top_k * self.expert_width + self.shared_intermediate if moe else self.intermediate

    def mean_active_mlp_width(self) -> float:
        """`active_mlp_width` averaged over the decoder's blocks (what per-token sums over all blocks use)."""
        return self.over_blocks(self.active_mlp_width) / self.layers

    def active_params(self) -> int:
        """The weights one token computes with: attention, the top-k experts and shared ones, the router, the
        head (the embedding row is a lookup, not counted, as model cards count active parameters)."""
        def block(moe: Block) -> float:
            if moe.part:
                return self.active_linear_params(moe) + self.block_extra_params(moe)
            router = self.hidden * self.experts if moe else 0
            mixer = sum(i * o for _, i, o in self.mixer_linears(moe))
            idle = (self.experts - self.routed_per_token) * self.expert_biases if moe else 0  # experts not run
            per_layer = sum(i * o for _, i, o in self.per_layer_linears())
            return mixer + 3 * self.hidden * self.active_mlp_width(moe) + router + self.block_extra_params(moe) - idle \
                + per_layer

        table = self.layers * self.per_layer_input * self.per_layer_vocab  # a lookup, as the embedding's
        return int(self.over_blocks(block) + self.vocab * self.hidden + self.final_norms + self.head_params()
                   + self.extra_params + self.shared_params + self.per_layer_model_params() - table)


def _mlp(prefix: str, hidden: int, width: int, gated: bool = True) -> list[tuple[str, int, int]]:
    """A gated MLP's three projections as named linears (an ungated one's two: up and down)."""
    gate = [(prefix + "gate", hidden, width)] if gated else []
    return gate + [(prefix + "up", hidden, width), (prefix + "down", width, hidden)]
