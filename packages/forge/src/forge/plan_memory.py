"""``forge plan``'s activation memory: what autograd keeps per micro-batch on a rank
(:func:`estimate_activations`, the formula in its docstring; the tests compare it with the
tensors autograd saves on real runs) and, with pipeline parallelism, each pipeline rank's peak
under its schedule (:func:`estimate_pipeline_activations`). The layers' own terms come from
their ``costs`` modules (MoE slots, CP's gathered keys and values, a VLM's vision side)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from forge_core import ForgeConfigError
from forge_cp.costs import cp_attention_extra_bytes, cp_kept_once_bytes, document_mask_bytes
from forge_moe_ep.costs import expert_skew, ffn_slot_activation_bytes, ffn_slot_op_bytes
from forge_pp import bubble_fraction, pipeline_actions, replay_peak
from forge_pp.split import balanced_blocks, stage_indices

from .config import ForgeConfig
from .kinds import model_kind
from .layout import Layout, resolve_layout


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps per micro-batch on a rank: ``none`` without AC; under AC mode ``m``
    (full, selective, op) ``m_saved`` after the forward plus ``m_block`` at the backward's peak
    (one block's, or with selective one attention's, recomputed intermediates)."""

    none: int
    full_saved: int
    full_block: int
    selective_saved: int
    selective_block: int
    op_saved: int
    op_block: int

    @property
    def full(self) -> int:
        return self.full_saved + self.full_block

    def saved(self, ac_mode: str) -> int:
        """What the forward leaves for backward under ``ac_mode``."""
        return self.none if ac_mode == "none" else int(getattr(self, f"{ac_mode}_saved"))

    def peak(self, ac_mode: str) -> int:
        """The most held at once under ``ac_mode`` (saved + one recomputed block)."""
        extra = 0 if ac_mode == "none" else int(getattr(self, f"{ac_mode}_block"))
        return self.saved(ac_mode) + extra


def itemsize_of(cfg: ForgeConfig) -> int:
    return getattr(torch, cfg.training.param_dtype).itemsize


#: The AC modes whose activations are modelled besides ``none``.
AC_KINDS = ("full", "selective", "op")


@dataclass(frozen=True)
class _ActivationParts:
    """:func:`estimate_activations`' bytes per micro-batch, by where they are made: ``first``
    before the decoder blocks (token ids; a VLM's encoder, adapter and image embeddings; what a
    first pipeline stage adds), one entry per decoder block, ``last`` after the blocks (final
    norm, targets, the loss: what a last stage adds). Each is a dict by AC mode (``none`` and
    :data:`AC_KINDS`); ``recompute``: what backward recomputes at once, per block (0 without
    AC) and, under ``first_recompute``, for the first part (a checkpointed ViT block)."""

    first: dict[str, int]
    blocks: dict[str, tuple[int, ...]]
    recompute: dict[str, tuple[int, ...]]
    first_recompute: dict[str, int]
    last: int

    def estimate(self) -> ActivationEstimate:
        """The sums: one micro-batch of the whole model."""
        out: dict[str, int] = {"none": self.first["none"] + sum(self.blocks["none"]) + self.last}
        for mode in AC_KINDS:
            out[f"{mode}_saved"] = self.first[mode] + sum(self.blocks[mode]) + self.last
            top = (*self.recompute[mode], self.first_recompute[mode])
            out[f"{mode}_block"] = max(top)
        return ActivationEstimate(**out)


def estimate_activations(
    cfg: ForgeConfig, world_size: int, *, device: str = "cuda", moe_skew: float = 1.0
) -> ActivationEstimate:
    """What autograd saves for backward per micro-batch on one rank, in bytes.

    ``b = global_batch_size / dp_degree / grad_accum`` sequences of ``s = seq_len``; ``e`` bytes
    per ``param_dtype`` element; tp degree ``t``; ``r = s/t`` with sequence parallelism (SP),
    else ``s``. Per dense block without AC:

    - each RMSNorm (2): on ``device="cuda"`` (torch's fused kernel) its input and float32
      ``rstd`` (``b r e + 4 b r``), on ``"cpu"`` (the composite, computed in float32) the float32
      input and ``x*rstd`` and ``rstd`` (``8 b r d + 4 b r``); and its output as the projections
      keep it (``b s d e``; under SP the all-gathered copy);
    - attention: q and the SDPA output ``2 b s d/t e``, k and v ``2 b s kv_dim/t e``, the
      logsumexp ``4 b s h/t`` (a fused SDPA: no ``s x s`` matrix); below fp32 also the RoPE tables
      cast per call ``4 s head_dim e``;
    - SwiGLU FFN: w1 out, silu out, w3 out and their product, ``4 b s ffn/t e``;
    - an MoE slot instead (replicated on tp, ``T = b s`` tokens, ``R`` routed rows: ``T k``
      dropless with balanced routing, or ``E b capacity``): scores ``4 T E``, per routed row the
      permuted input, grouped SwiGLU, expert output (kept by the combine) and gather index
      ``R (2 d e + 4 moe_ffn e + 8)``, per (token, choice) ids, float32 weight and scatter index
      ``20 T k``, offsets ``4 E``, the shared expert ``4 T shared_hidden e``, below fp32 the
      router's float32 input and weight ``4 T d + 4 E d``.

    Outside the blocks: token ids ``8 b (s+1)`` and targets ``8 b s``, the final norm, the loss's
    float32 log-probabilities ``4 b s V`` (``V/t`` with loss parallel). A VLM adds the adapter,
    the image embeddings and, when trainable, the ViT encoder (per block LayerNorm inputs/outputs
    and mean/rstd, q/k/v/out, logsumexp, GELU MLP; the patch stem). AC full keeps each block's
    input (``b r d e``; the first block's unsplit, ``b s d e``: its checkpoint wraps the SP split)
    and recomputes one block in backward. AC selective checkpoints each attention: a block
    keeps all but the attention terms and the projections' copy of the norm output, and instead
    the attention's input (``b r d e``); backward recomputes one attention. AC op keeps per
    block its input and the outputs of the ops torch's policy saves (forge_fsdp_wrap.ac): q, k,
    v, the SDPA output and logsumexp, ``wo``'s and ``w2``'s local products ``2 b s d e``
    (partial sums under TP), w1 and w3 ``2 b s ffn/t e``, under SP the two reduce-scatters
    ``2 b r d e``; an MoE slot its router scores, shared-expert and grouped projections and
    float32 combine (:func:`forge_moe_ep.costs.moe_slot_op_bytes`). The tests and
    tools/bench_plan_accuracy.py measure it exact on CPU (float32 and bfloat16, every AC
    mode, with TP and SP); the CUDA norm term follows the fused kernel's backward signature.

    ``moe_skew`` (>= 1): under expert parallelism with dropless dispatch, the busiest rank's
    experts get ``moe_skew`` times the balanced routed rows (the permuted input and the expert
    SwiGLU scale; :func:`forge_moe_ep.costs.moe_slot_activation_bytes`); 1: balanced.

    Context parallelism (``cp > 1``): a rank holds ``s = seq_len / cp`` tokens of each sequence
    and every term above uses that ``s``, except k and v: attention keeps the all-gathered
    ``2 b seq_len kv_dim/t e`` instead, and the output of its two SDPA calls (one per chunk) is
    kept twice, by them and concatenated by ``wo`` (``+ b s d/t e``). Once per rank (AC none): in fp32 the RoPE rows of its
    positions ``2 s head_dim 4``, and on ``device="cpu"`` the two mask rows the kernel shares by
    every layer, ``e ((2 cp + 3) c - 2)`` with ``c = seq_len / 2 cp`` (CUDA's kernels need none).
    """
    layout = resolve_layout(cfg, world_size)
    return _activation_parts(cfg, layout, layout.micro_batch, device, moe_skew).estimate()


def _activation_parts(
    cfg: ForgeConfig, layout: Layout, b: int, device: str, moe_skew: float = 1.0
) -> _ActivationParts:
    """The terms of :func:`estimate_activations` for micro-batches of ``b`` sequences."""
    m, t = cfg.decoder, layout.tp
    kv_heads, ffn = m.n_kv_heads, m.ffn_dim
    assert kv_heads and ffn  # filled in by ModelConfig.__post_init__
    sp, lp, cp = layout.sequence_parallel, layout.loss_parallel, layout.parallelism.cp
    e, d, whole = itemsize_of(cfg), m.dim, cfg.training.seq_len
    s = whole // cp  # this rank's tokens of each sequence
    r = s // t if sp else s
    low = e != 4  # below fp32: casts that fp32 does not make
    norm_in = 8 * b * r * d if device == "cpu" else b * r * d * e
    norm_out, shard = b * s * d * e, b * r * d * e  # SP: the gathered copy; a sequence shard
    norm = norm_in + 4 * b * r + norm_out
    kv_dim = kv_heads * m.head_dim
    q_out, kv = b * s * (d // t) * e, 2 * b * s * (kv_dim // t) * e
    lse = 4 * b * s * (m.n_heads // t)
    attn = 2 * q_out + kv + lse + (4 * s * m.head_dim * e if low else 0)
    attn += cp_attention_extra_bytes(
        b=b,
        seq_len=whole,
        cp=cp,
        dim=d,
        kv_dim=kv_dim,
        tp=t,
        itemsize=e,
        variant=cfg.cp.variant,
        head_dim=m.head_dim,
    )
    swiglu = 2 * b * s * (ffn // t) * e  # w1's and w3's outputs
    skew = expert_skew(m, layout.ep, moe_skew)
    slots = ffn_slot_activation_bytes(m, 2 * swiglu, b, s, e, expert_skew=skew)
    none = tuple(2 * norm + attn + slot for slot in slots)
    n = len(none)
    # AC full: each block keeps its input (the first block's unsplit: its checkpoint wraps the
    # SP split) and backward recomputes one block at a time.
    inputs = tuple(shard + (norm_out - shard if i == 0 else 0) for i in range(n))
    # selective: the attention is checkpointed: it keeps its input (under SP the shard: the
    # all-gather runs inside), and is recomputed with its gathered input in backward.
    selective = tuple(x - attn - norm_out + shard for x in none)
    # op: each block keeps its input and the outputs of its matmuls, SDPA and reduce-scatters:
    # q, k, v, SDPA's output and logsumexp, wo's and w2's local (partial under TP) products and
    # under SP their reduce-scatters (an MoE slot, replicated on tp, has none).
    scatter = shard if sp and t > 1 else 0
    op_attn = 2 * q_out + kv + lse + norm_out + scatter
    op_slots = ffn_slot_op_bytes(m, swiglu + norm_out + scatter, b, s, e, expert_skew=skew)
    op = tuple(inputs[i] + op_attn + op_slots[i] for i in range(n))
    blocks = {"none": none, "full": inputs, "selective": selective, "op": op}
    recompute = {
        "full": none,
        "selective": tuple(attn + norm_out - shard for _ in range(n)),
        "op": tuple(max(0, none[i] - (op[i] - inputs[i])) for i in range(n)),  # NOTE: estimate
    }
    if "decoder" not in model_kind(cfg).checkpointed_components():
        blocks = dict.fromkeys(blocks, none)
        recompute = dict.fromkeys(recompute, tuple(0 for _ in none))
    vocab = m.vocab_size // t if lp else m.vocab_size
    ids = 8 * b * (s + (cp == 1))  # token ids (a cp rank's are a copy, without the last)
    cp_once = cp_kept_once_bytes(
        seq_len=whole, cp=cp, head_dim=m.head_dim, itemsize=e, device=device, variant=cfg.cp.variant
    )
    last = 8 * b * s + 4 + norm + 4 * b * s * vocab  # targets, loss scalar, final norm, log-probs
    vis = model_kind(cfg).input_activation_bytes(b=b, s=s, dim=d, tp=t, itemsize=e)
    # NOTE: cp_once is saved by the attention kernels: under AC full only while a block is
    # recomputed, under selective and op never (the attention inputs are recomputed).
    first = {mode: ids + vis[mode] for mode in ("none", *AC_KINDS)}
    first["none"] += cp_once
    if cfg.data.packs_documents:
        # one mask per micro-batch, alive with its documents whatever the AC mode; and each row's
        # own rotary rows (float32 tables indexed by its positions) instead of cp's shared ones
        mask = document_mask_bytes(b=b, seq_len=whole, cp=cp, itemsize=e, variant=cfg.cp.variant)
        first = {mode: kept + mask for mode, kept in first.items()}
        if e == 4:
            first["none"] += 2 * (b - (cp > 1)) * s * m.head_dim * 4
    first_top = {mode: vis[f"{mode}_recompute"] for mode in AC_KINDS}
    return _ActivationParts(first, blocks, recompute, first_top, last)


# ------------------------------------------------------------------------ pipeline parallelism
@dataclass(frozen=True)
class PipelinePlan:
    """What ``parallelism.pp > 1`` adds to a plan.

    ``microbatches`` of ``micro_batch`` sequences per step (each data-parallel rank's batch
    split); ``stage_blocks``: the decoder blocks of each stage (stage 0 also holds the embedding,
    the last stage the final norm and head); ``rank_stages``: the stages of each pipeline rank;
    ``in_flight``: per pipeline rank, the micro-batches of each of its stages whose activations
    are held at that rank's peak (AC none); ``bubble``: the idle fraction in theory
    (:func:`forge_pp.bubble_fraction`); ``order``: where the action order came from (see
    :func:`forge_pp.pipeline_actions`)."""

    schedule: str
    pp: int
    microbatches: int
    micro_batch: int
    stages_per_rank: int
    stage_blocks: tuple[range, ...]
    rank_stages: tuple[tuple[int, ...], ...]
    in_flight: tuple[dict[int, int], ...]
    bubble: float
    order: str

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)


def pipeline_plan(
    cfg: ForgeConfig, layout: Layout, device: str, moe_skew: float = 1.0
) -> tuple[PipelinePlan, list[ActivationEstimate], list[str]]:
    """The pipeline section, each pipeline rank's activations (peak in flight) and the settings
    torch refuses when it builds the schedule."""
    pp_cfg, pp = cfg.pp, layout.parallelism.pp
    v, m = pp_cfg.local_stages(), pp_cfg.num_microbatches(pp)
    b = max(1, layout.batch_per_rank // m)
    n_stages = pp * v
    problems: list[str] = []
    ranges = balanced_blocks(cfg.model.n_layers, n_stages, pp_cfg.split_points)
    try:
        ranks, order = pipeline_actions(pp_cfg.schedule, pp, m, v)
    except ValueError as err:
        problems.append(
            f"pp.schedule={pp_cfg.schedule!r} with parallelism.pp={pp}, {m} micro-batches, "
            f"{v} stages per rank: torch refuses it: {err}"
        )
        ranks, order = pipeline_actions("GPipe", pp, m, 1)
    parts = _activation_parts(cfg, layout, b, device, moe_skew)
    e, s, d = itemsize_of(cfg), cfg.training.seq_len, cfg.model.dim
    # NOTE: a stage keeps its output until that micro-batch's backward (hidden states; the
    # last stage its logits), and nothing longer: forge_pp runs the schedule with
    # return_outputs=False (the merged logits are never kept).
    hidden, logits = b * s * d * e, b * s * cfg.model.vocab_size * e
    last = n_stages - 1
    out_mb = {st: logits if st == last else hidden for st in range(n_stages)}

    def stage_bytes(stage: int, mode: str) -> int:
        out = sum(parts.blocks[mode][i] for i in ranges[stage])
        out += parts.first[mode] if stage == 0 else 0
        return out + (parts.last if stage == last else 0)

    def stage_recompute(stage: int, mode: str) -> int:
        """AC: a stage's backward recomputes one of its blocks at a time."""
        tops = [parts.recompute[mode][i] for i in ranges[stage]]
        return max(tops + [parts.first_recompute[mode]] * (stage == 0))

    per_mode = {
        mode: {st: stage_bytes(st, mode) for st in range(n_stages)} for mode in parts.blocks
    }
    placement = pp_cfg.info.placement
    rank_stages = tuple(tuple(stage_indices(r, pp, v, placement)) for r in range(pp))
    estimates, in_flight = [], []
    for actions in ranks:
        none, held = replay_peak(actions, per_mode["none"], out_mb)
        values = {"none": none}
        for mode in AC_KINDS:
            saved = replay_peak(actions, per_mode[mode], out_mb)[0]
            again = {st: stage_recompute(st, mode) for st in range(n_stages)}
            values[f"{mode}_saved"] = saved
            values[f"{mode}_block"] = replay_peak(actions, per_mode[mode], out_mb, again)[0] - saved
        estimates.append(ActivationEstimate(**values))
        in_flight.append(held)
    pipe = PipelinePlan(
        schedule=pp_cfg.schedule,
        pp=pp,
        microbatches=m,
        micro_batch=b,
        stages_per_rank=v,
        stage_blocks=tuple(ranges),
        rank_stages=rank_stages,
        in_flight=tuple(in_flight),
        bubble=bubble_fraction(pp_cfg.schedule, pp, m, v),
        order=order,
    )
    return pipe, estimates, problems


def estimate_pipeline_activations(
    cfg: ForgeConfig, world_size: int, *, device: str = "cuda"
) -> list[ActivationEstimate]:
    """Each pipeline rank's activation peak under ``cfg``'s schedule (``parallelism.pp > 1``).

    What a (stage, micro-batch) holds, for micro-batches of ``b = batch_per_rank / microbatches``
    sequences: the :func:`estimate_activations` terms of the stage's blocks (stage 0 also the
    token ids and a VLM's encoder, adapter and image embeddings; the last stage the final norm,
    targets and loss) and its output (``b s d e``, the last stage's logits ``b s V e``: torch's
    stage keeps it for the backward). Nothing outlives its micro-batch's backward: forge_pp runs
    the schedule without merging the last stage's outputs (``return_outputs=False``).

    When: the rank's actions in order (:func:`forge_pp.pipeline_actions`) are replayed; a forward adds
    its (stage, micro-batch), the full backward frees it, or for the zero-bubble schedules
    (backward split into input and weight gradients) the weight gradient, which still needs the
    saved inputs (an upper bound: the input step frees a little). ``none`` and ``full_saved`` (AC
    full: each block keeps its input) are the peaks of that sum; ``full_block`` what AC full adds
    at its own peak, where a backward recomputes one block of its stage on top.

    Micro-batches in flight at most on pipeline rank ``r`` of ``p`` (``m`` micro-batches, ``v``
    stages per rank, ``q = m / max(1, m // p)`` per round): GPipe ``m`` (all forwards, then all
    backwards); 1F1B ``min(m, p - r)`` (that many warm-up forwards, then a backward before each
    forward); LoopedBFS ``v m``; Interleaved1F1B ``w + 1`` with ``w = min((v-1) q + 2 (p-1-r),
    v m)`` (``w`` when that is ``v m``); InterleavedZeroBubble ``(v-1) q + p``; ZBVZeroBubble
    ``min(m, 2p-1-r)`` of stage ``r`` and ``r + 1`` of stage ``2p-1-r``; DualPipeV
    ``min(m, 2p-r)`` and ``r + 1``. Where a rank's stages differ in size (interleaved: the
    balanced split's stages hold different block counts, the first and last stage more) the
    byte peak can fall at another moment than the count's: the replay finds it.
    """
    layout = resolve_layout(cfg, world_size)
    if layout.parallelism.pp <= 1:
        raise ForgeConfigError("estimate_pipeline_activations needs parallelism.pp > 1")
    _, estimates, problems = pipeline_plan(cfg, layout, device)
    if problems:
        raise ForgeConfigError(problems[0])
    return estimates
