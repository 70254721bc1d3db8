"""The Hugging Face zoo: every dense decoder family of the installed transformers that has a
tensor-parallel plan, built tiny, checked at TP=2 against its unsharded copy.

Run from the checkout: ``PYTHONPATH=. uv run python tools/hf_zoo.py`` (prints a table and
writes ``benchmarks/hf_zoo.md``; ``--families llama,qwen3`` runs a few, ``--no-write`` keeps
the page). ``tests/zoo/test_hf_zoo.py`` runs the same check in CI.

Question: which of transformers' decoder families does ``forge_tp_plans.apply_tensor_parallel``
shard correctly with the plan the family ships (``base_model_tp_plan``), or with forge's own
plan for families that ship none (``forge_tp_plans.hf_families.FAMILY_PLANS``)?

Which families (:func:`zoo_families`): every ``model_type`` of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class has a non-empty
``base_model_tp_plan``, or whose causal-LM class is a key of ``FAMILY_PLANS``, minus

- composite configs (``sub_configs``: a vision, audio or text sub-config, e.g. ``llama4``,
  ``phi4_multimodal``): not text decoders; their text decoder is enumerated under its own
  ``*_text`` model type where transformers has one;
- encoder-decoder configs (``is_encoder_decoder``: BART-style ``*ForCausalLM`` decoders of a
  seq2seq model) and encoder-only models used as decoders (BERT-style ``*LMHeadModel``): none
  ships a tp plan, so the plan filter already drops them; the seq2seq check only keeps them out
  should forge add a plan by class name;
- MoE families (:func:`moe_reason`): their experts are forge-moe-ep's business, not TP's.

How each is checked (:func:`run_families`, on 2 ranks): the tiny config (:func:`tiny_config`,
dropout 0, random weights, seed 0, fp32, nothing downloaded) builds the model; a deep copy gets
``apply_tensor_parallel`` over a 1-D tp mesh of 2; both run forward and backward on the same
fixed tokens (B=2, S=12, ``labels=tokens``, ``model.train()``). Outcomes: ``pass`` (logits
within rtol = atol = 1e-5, every parameter gradient, DTensor ones as ``full_tensor()``, within
rtol 1e-4 / atol 1e-6), ``refused: <ForgeConfigError>``, ``crash: <phase>: <exception>`` or
``wrong: <worst errors>`` (numbers differ: never acceptable).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "hf_zoo.md"

#: The fixed batch every family runs: B sequences of S tokens, the labels are the tokens.
BATCH, SEQ = 2, 12
TP = 2
#: Logits: ``|par - ref| <= LOGITS_TOL * (1 + |ref|)``; gradients: ``<= GRAD_ATOL + GRAD_RTOL * |ref|``.
LOGITS_TOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

#: The generic shrinker: each attribute a config has gets this value (aliases of one size are
#: listed together: transformers' ``attribute_map`` maps e.g. ``n_embd`` to ``hidden_size``).
TINY_SIZES: dict[str, int] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "n_positions": 64,
    # multi-head latent attention (MLA: DeepSeek, MiniCPM3, Youtu)
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    # partial rotary embeddings given as a width (GPT-J, CodeGen), not a fraction
    "rotary_dim": 4,
    # linear-attention layers of hybrid models (gated delta net: Qwen3.5, OLMo hybrid)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
#: A sliding window shorter than the sequence, so that the sliding-window mask is exercised.
TINY_SLIDING_WINDOW = 8

#: Per-family settings where the generic rule is not enough; each says why.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Gemma3n: its per-layer-input embeddings, AltUp and LAuReL have sizes of their own, and
    # its last num_kv_shared_layers layers reuse earlier layers' KV (15 of 35 by default: more
    # layers than the tiny model has).
    "gemma3n_text": {
        "vocab_size_per_layer_input": 64,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
        "num_kv_shared_layers": 0,
    },
    # Gemma4: per-layer-input embeddings like Gemma3n.
    "gemma4_text": {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8},
    # Cohere Compass: RoPE is per layer type (a type left out is NoPE), and the default config
    # gives none, which its rotary embedding cannot build (KeyError 'full_attention').
    # Its text RoPE splits the frequencies into multimodal sections ([22, 22, 20] in 5.17,
    # made for head_dim 128): they must add up to head_dim / 2.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            }
        }
    },
    # HRM: the layers are stacks of num_layers_per_stack, run H_cycles x L_cycles times.
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 2, "L_bp_cycles": [1]},
}

#: Config fields that count routed experts (an MoE family has one > 0, or left None for a
#: checkpoint to fill in).
MOE_COUNT_FIELDS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
)
#: Boolean switches some configs have for their MoE blocks (off: the family is dense).
MOE_SWITCHES = ("is_moe", "enable_moe_block")


# ----------------------------------------------------------------------------- enumeration


def moe_reason(config: Any) -> str | None:
    """Why ``config`` describes a mixture-of-experts model (None: dense).

    A switch (``is_moe``, ``enable_moe_block``) decides when the config has one (Doge and
    Gemma4 carry expert counts but are dense unless switched on); otherwise any expert count
    field (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``)
    that is > 0 or None (Dots1 leaves ``n_routed_experts`` to the checkpoint) makes it MoE.
    """
    values = config.to_dict()
    for switch in MOE_SWITCHES:
        if switch in values:
            return f"{switch}={values[switch]}" if values[switch] else None
    for name in MOE_COUNT_FIELDS:
        if name in values:
            value = values[name]
            if value is None or (isinstance(value, int) and value > 0):
                return f"{name}={value}"
    return None


@dataclasses.dataclass(frozen=True)
class Enumeration:
    """What :func:`enumerate_families` found: the zoo, and what it left out and why."""

    zoo: list[tuple[str, str]]
    moe: dict[str, str]
    excluded: dict[str, str]


def enumerate_families() -> Enumeration:
    """Walk transformers' causal-LM mapping; see the module docstring for the rules."""
    from forge_tp_plans.hf_families import FAMILY_PLANS
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    zoo: list[tuple[str, str]] = []
    moe: dict[str, str] = {}
    excluded: dict[str, str] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if not isinstance(class_name, str):  # a tuple of classes: none in 5.x decoders
            excluded[model_type] = f"several causal-LM classes {class_name}"
            continue
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception as e:  # noqa: BLE001 - a config transformers cannot import here
            excluded[model_type] = f"config not importable: {type(e).__name__}"
            continue
        planned = bool(getattr(config_class, "base_model_tp_plan", None))
        if not planned and class_name not in FAMILY_PLANS:
            continue  # no plan: nothing for TP to check (encoders, seq2seq, most others)
        if getattr(config_class, "sub_configs", None):
            excluded[model_type] = (
                f"composite config (sub-configs {sorted(config_class.sub_configs)}): not a text "
                "decoder"
            )
            continue
        try:
            config = config_class()
        except Exception as e:  # noqa: BLE001
            excluded[model_type] = f"default config fails: {type(e).__name__}: {_first_line(e)}"
            continue
        if getattr(config, "is_encoder_decoder", False):
            excluded[model_type] = "encoder-decoder (seq2seq)"
            continue
        reason = moe_reason(config)
        if reason is not None:
            moe[model_type] = reason
            continue
        zoo.append((model_type, class_name))
    return Enumeration(zoo, moe, excluded)


def zoo_families() -> list[tuple[str, str]]:
    """``[(model_type, causal-LM class name)]``: the dense text decoders with a tp plan (their
    own or forge's) in the installed transformers, in the mapping's order."""
    return enumerate_families().zoo


# ----------------------------------------------------------------------------- tiny configs


def _layer_indices(layer_types: Sequence[str] | None, n_layers: int) -> list[int]:
    """Which of the default model's layers the tiny one keeps: the first layer of each distinct
    layer type (sliding / full / linear attention ...), then the next ones, ``n_layers`` or
    more in all (one per type)."""
    if not layer_types:
        return list(range(n_layers))
    first: dict[str, int] = {}
    for i, kind in enumerate(layer_types):
        first.setdefault(kind, i)
    chosen = sorted(first.values())
    rest = [i for i in range(len(layer_types)) if i not in chosen]
    return sorted(chosen + rest[: max(0, n_layers - len(chosen))])


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type``: transformers' default config with every common size
    attribute it has shrunk (:data:`TINY_SIZES`), dropout 0, no KV cache, token ids inside the
    vocabulary, layer-indexed lists cut to the kept layers (one of each layer type), and
    :data:`FAMILY_OVERRIDES` on top."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    values = default.to_dict()
    kwargs: dict[str, Any] = {}

    def has(name: str) -> bool:
        # NOTE: stored fields and their aliases only: a derived property (Falcon's head_dim)
        # cannot be given
        return name in values or name in getattr(default, "attribute_map", {})

    layer_types = values.get("layer_types")
    keep = _layer_indices(layer_types, TINY_SIZES["num_hidden_layers"])
    for name, size in TINY_SIZES.items():
        if has(name):
            # NOTE: read from to_dict(): Gemma4's config refuses reads of per-layer attributes.
            # Per-layer sizes (Gemma3n's intermediate_size) become per-layer tiny sizes.
            kwargs[name] = [size] * len(keep) if isinstance(values.get(name), list) else size
    for layers_key in ("num_hidden_layers", "n_layer", "num_layers"):
        if layers_key in kwargs:
            kwargs[layers_key] = len(keep)
    n_default = values.get("num_hidden_layers")
    if isinstance(n_default, int):
        for name, value in values.items():  # the other lists with one entry per layer
            if isinstance(value, list) and len(value) == n_default and name not in kwargs:
                kwargs[name] = [value[i] for i in keep]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict) and isinstance(values.get("head_dim"), int):
        # Gemma4: some layers' attributes differ (its full-attention layers have 2x wider
        # heads): keep the kept layers' entries, renumbered, sizes scaled like head_dim
        scale = TINY_SIZES["head_dim"] / values["head_dim"]
        kwargs["per_layer_config"] = {
            str(new): {
                k: int(v * scale) if k == "head_dim" else v for k, v in per_layer[key].items()
            }
            for new, old in enumerate(keep)
            for key in per_layer
            if int(key) == old
        }
    if "qk_rope_head_dim" in values:
        # MLA: head_dim (the RoPE width) and qk_head_dim are derived from the MLA dims
        kwargs.pop("head_dim", None)
    if getattr(default, "sliding_window", None) is not None:
        kwargs["sliding_window"] = TINY_SLIDING_WINDOW
    for name, value in values.items():
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            kwargs[name] = 0.0
    if has("use_cache"):
        kwargs["use_cache"] = False
    for name, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if values.get(name) is not None:
            kwargs[name] = token
    kwargs.update(FAMILY_OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **kwargs)


# ----------------------------------------------------------------------------- one family


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _crash(phase: str, e: BaseException) -> str:
    return f"crash: {phase}: {type(e).__name__}: {_first_line(e)}"


def _build(model_type: str, class_name: str) -> Any:
    import torch
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).float()
    model.train()
    return model


def _tokens(vocab_size: int) -> Any:
    import torch

    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Row(NamedTuple):
    """One family's result."""

    family: str  # the model_type
    class_name: str
    outcome: str  # pass / refused: ... / crash: ... / wrong: ...
    seconds: float  # build, both forwards and backwards, the comparison (rank 0)
    plan: str  # what the applied plan did ("" when none was applied)
    split: int  # modules the applied plan split (0 for a pass: nothing was checked)


def _plan_summary(model: Any) -> tuple[str, int]:
    """``("<source>: <n> split, <m> grad-allreduce[, skipped ...]", n)`` from the recorded
    applied plan, so that a pass that split nothing is visible."""
    from forge_tp_plans import applied_tp_plan

    applied = applied_tp_plan(model)
    if applied is None:
        return "", 0
    styles = list(applied.styles.values())
    allreduce = sum(s == "ReplicatedWithGradAllReduce" for s in styles)
    split = sum(s not in ("replicated", "ReplicatedWithGradAllReduce") for s in styles)
    text = f"{applied.source}: {split} split, {allreduce} grad-allreduce"
    return text + (f", skipped {', '.join(applied.skipped)}" if applied.skipped else ""), split


def check_family(model_type: str, class_name: str, mesh: Any) -> tuple[str, str, int]:
    """``(outcome, plan summary, modules split)`` of one family on this rank, over the 1-D tp
    ``mesh`` (every rank of it calls this together, for the same families in the same order)."""
    from forge_core.errors import ForgeConfigError
    from forge_tp_plans import apply_tensor_parallel

    phase, plan, split = "build", "", 0
    try:
        reference = _build(model_type, class_name)
        parallel = copy.deepcopy(reference)
        tokens = _tokens(reference.config.vocab_size)
        phase = "reference forward/backward"
        ref_out = reference(tokens, labels=tokens)
        ref_out.loss.backward()
        phase = "apply_tensor_parallel"
        try:
            apply_tensor_parallel(parallel, mesh)
        except ForgeConfigError as e:
            return f"refused: {_first_line(e)}", plan, split
        plan, split = _plan_summary(parallel)
        phase = "tp forward"
        par_out = parallel(tokens, labels=tokens)
        phase = "tp backward"
        par_out.loss.backward()
        phase = "compare"
        outcome = _compare(reference, parallel, ref_out.logits, _full(par_out.logits))
        return outcome, plan, split
    except Exception as e:  # noqa: BLE001 - one family's failure must not stop the others
        return _crash(phase, e), plan, split


def _compare(reference: Any, parallel: Any, ref_logits: Any, par_logits: Any) -> str:
    """``pass``, or ``wrong: ...`` with the logits error and the worst gradient."""
    import torch

    problems: list[str] = []
    if par_logits.shape != ref_logits.shape:
        return f"wrong: logits shape {tuple(par_logits.shape)} != {tuple(ref_logits.shape)}"
    logits_err = (par_logits - ref_logits).abs().max().item()
    if not torch.allclose(par_logits, ref_logits, rtol=LOGITS_TOL, atol=LOGITS_TOL):
        problems.append(f"logits max err {logits_err:.1e}")
    par_params = dict(parallel.named_parameters())
    worst: tuple[float, str, float] = (0.0, "", 0.0)  # (excess ratio, name, max abs err)
    for name, ref_param in reference.named_parameters():
        # NOTE: every rank walks the same names in the same order: full_tensor() is a collective
        par_grad = par_params[name].grad if name in par_params else None
        par_grad = _full(par_grad) if par_grad is not None else None
        ref_grad = ref_param.grad
        if (ref_grad is None) != (par_grad is None):
            problems.append(f"{name}: gradient {'missing' if par_grad is None else 'extra'}")
            continue
        if ref_grad is None:
            continue
        err = (par_grad - ref_grad).abs()
        ratio = (err / (GRAD_ATOL + GRAD_RTOL * ref_grad.abs())).max().item()
        if ratio > worst[0]:
            worst = (ratio, name, err.max().item())
    if worst[0] > 1.0:
        problems.append(f"worst grad {worst[1]} max err {worst[2]:.1e} ({worst[0]:.0f}x the bound)")
    return "wrong: " + "; ".join(problems) if problems else "pass"


#: Which outcome a family gets when its ranks' outcomes are of different kinds: the worst.
_SEVERITY = ("wrong", "crash", "refused", "pass")


def _agree(outcomes: Sequence[str]) -> str:
    """One outcome from every rank's: rank 0's where all are of the same kind (``wrong`` ones
    differ in their numbers: each rank sees its own partial gradients), else the worst kind
    with every rank's."""
    kinds = {outcome_kind(o) for o in outcomes}
    if len(kinds) == 1:
        return outcomes[0]
    worst = min(kinds, key=lambda k: _SEVERITY.index(k) if k in _SEVERITY else 0)
    listed = "; ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes))
    return f"{worst}: ranks differ: {listed}"


def run_families(families: Sequence[tuple[str, str]]) -> list[Row]:
    """On every rank of a 2-rank group: check each family in turn (one failure never stops the
    others) and return the same rows on each rank."""
    import torch.distributed as dist
    from forge_mesh import build_device_mesh
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # tiny configs make transformers warn (token ids, rope)
    mesh = build_device_mesh({"tp": TP, "data": "none"}, "cpu")
    rows = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for model_type, class_name in families:
                start = time.perf_counter()
                outcome, plan, split = check_family(model_type, class_name, mesh)
                seconds = time.perf_counter() - start
                every: list[Any] = [None] * dist.get_world_size()
                # NOTE: also lines the ranks up before the next family
                dist.all_gather_object(every, outcome)
                rows.append(Row(model_type, class_name, _agree(every), seconds, plan, split))
    finally:
        hf_logging.set_verbosity(verbosity)
    return rows


# ----------------------------------------------------------------------------- the whole zoo

#: ``run(fn, *args, timeout=...)`` runs ``fn`` on every rank of a 2-rank pool and returns the
#: per-rank results (``RankPool(2).run``, or the tests' ``run_on_ranks`` with 2 bound).
Runner = Callable[..., list[Any]]


def run_zoo(
    run: Runner, families: Sequence[tuple[str, str]], *, chunk: int = 8, timeout: float = 120.0
) -> list[Row]:
    """Check ``families``, ``chunk`` of them per call of ``run`` (one call per family would pay
    a round trip each; one call for all would lose them all to one hang). A call that fails as
    a whole (a rank died or hung: the pool restarts) is retried family by family, so that the
    bad family is reported as ``crash: ranks failed: ...`` and the others still run."""
    from forge_core.testing import RankError

    rows: list[Row] = []
    for i in range(0, len(families), chunk):
        part = list(families[i : i + chunk])
        try:
            rows += run(run_families, part, timeout=timeout)[0]
            continue
        except RankError as e:
            if len(part) == 1:
                rows.append(
                    Row(*part[0], f"crash: ranks failed: {_rank_error_line(e)}", 0.0, "", 0)
                )
                continue
        for family in part:
            try:
                rows += run(run_families, [family], timeout=timeout)[0]
            except RankError as e:
                rows.append(Row(*family, f"crash: ranks failed: {_rank_error_line(e)}", 0.0, "", 0))
    return rows


def _rank_error_line(e: BaseException) -> str:
    """The first failing rank's exception line and the pool's reason (a RankError's message:
    a header line, then each failing rank's traceback, then the reason if a rank hung)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    own = [ln for ln in lines[1:] if not ln.startswith((" ", "---", "Traceback"))]
    if not own:
        return lines[0] if lines else type(e).__name__
    return own[0] if len(own) == 1 else f"{own[0]} ({own[-1]})"


def outcome_kind(outcome: str) -> str:
    """``pass`` / ``refused`` / ``crash`` / ``wrong``."""
    return outcome.split(":", 1)[0]


def counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows of each outcome kind (all four always present)."""
    out = dict.fromkeys(("pass", "refused", "crash", "wrong"), 0)
    for row in rows:
        out[outcome_kind(row.outcome)] = out.get(outcome_kind(row.outcome), 0) + 1
    return out


# ----------------------------------------------------------------------------- report


def _table(rows: Sequence[Row]) -> list[str]:
    lines = ["| family | class | outcome | plan applied | s |", "|---|---|---|---|---:|"]
    for row in rows:
        cells = [row.family, row.class_name, row.outcome, row.plan or "-"]
        cells = [c.replace("|", "\\|") for c in cells]
        lines.append(f"| {' | '.join(cells)} | {row.seconds:.1f} |")
    return lines


def write_markdown(
    rows: Sequence[Row],
    enumeration: Enumeration,
    wall_s: float,
    load_start: tuple[float, ...],
    load_end: tuple[float, ...],
    path: Path = OUT_MD,
) -> None:
    """``benchmarks/hf_zoo.md``: machine, versions, counts, the table, what was left out."""
    import torch
    import transformers

    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    load = ["/".join(f"{x:.1f}" for x in avg) for avg in (load_start, load_end)]
    lines = [
        "# The Hugging Face zoo: dense decoder families at TP=2",
        "",
        "Written by `PYTHONPATH=. uv run python tools/hf_zoo.py`; rerun it to refresh this page. "
        "CI runs the same check as `tests/zoo` (marker `zoo`).",
        "",
        "## Machine",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: `{uname}`",
        f"- cpu cores (nproc): {os.cpu_count()}",
        f"- python: {platform.python_version()}",
        f"- torch: {torch.__version__}",
        f"- transformers: {transformers.__version__}",
        f"- load average at start / end (1/5/15 min): {load[0]} / {load[1]}",
        f"- wall time: {wall_s:.1f} s for {len(rows)} families on 2 gloo CPU ranks, one thread "
        "each (enumeration, pool start and imports included)",
        "",
        "## Question",
        "",
        "Which dense decoder families of the installed transformers does "
        "`forge_tp_plans.apply_tensor_parallel` shard correctly at TP=2, with the family's own "
        "`base_model_tp_plan` (or forge's `FAMILY_PLANS` where it ships none)? Each family is "
        "built tiny from its config (`tiny_config`: random weights, fp32, dropout 0), run "
        f"forward and backward on B={BATCH}, S={SEQ} fixed tokens with `labels=tokens`, "
        f"unsharded and under TP=2: `pass` = logits within {LOGITS_TOL:g} and every parameter "
        f"gradient within rtol {GRAD_RTOL:g} / atol {GRAD_ATOL:g}. `refused` = forge raised "
        "ForgeConfigError; `crash` = an exception (the phase is named); `wrong` = the numbers "
        "differ. *plan applied*: modules split (column/row), modules whose replicated "
        "parameters get their gradient summed over tp, plan patterns skipped (matching no "
        "module).",
        "",
        "## Counts",
        "",
        f"- families: {len(rows)}",
        *(f"- {k}: {v}" for k, v in counts(rows).items()),
        "",
        "## Results",
        "",
        *_table(rows),
        "",
        "## Left out",
        "",
        "MoE families (their experts are expert parallelism's, forge-moe-ep; the field that "
        "made each MoE): "
        + ", ".join(f"{k} ({v})" for k, v in sorted(enumeration.moe.items()))
        + ".",
        "",
        "Families with a plan that are not text decoders: "
        + ", ".join(f"{k} ({v})" for k, v in sorted(enumeration.excluded.items()))
        + ".",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the zoo on a 2-rank pool, print the table, write ``benchmarks/hf_zoo.md``."""
    parser = argparse.ArgumentParser(description="The Hugging Face zoo at TP=2.")
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--chunk", type=int, default=8, help="families per pool call")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    from forge_core.testing import RankPool

    load_start = os.getloadavg()
    start = time.perf_counter()
    enumeration = enumerate_families()
    families = enumeration.zoo
    if args.families:
        wanted = set(args.families.split(","))
        families = [f for f in families if f[0] in wanted]
        if wanted - {f[0] for f in families}:
            print(f"not in the zoo: {sorted(wanted - {f[0] for f in families})}", file=sys.stderr)
    with RankPool(TP) as pool:
        rows = run_zoo(pool.run, families, chunk=args.chunk)
    wall = time.perf_counter() - start
    width = max((len(r.family) for r in rows), default=6)
    cwidth = max((len(r.class_name) for r in rows), default=5)
    for row in rows:
        head = f"{row.family:<{width}}  {row.class_name:<{cwidth}}  {row.seconds:5.1f}s"
        print(f"{head}  {row.outcome}")
        if row.plan:
            print(f"{'':<{len(head)}}  plan: {row.plan}")
    print(f"{len(rows)} families in {wall:.1f} s: {counts(rows)}")
    if not args.no_write and not args.families:
        write_markdown(rows, enumeration, wall, load_start, os.getloadavg())
        print(f"wrote {OUT_MD.relative_to(ROOT)}")


if __name__ == "__main__":
    # NOTE: run as a script this file is ``__main__``; the rank workers import the functions
    # they run by module name, so hand over to the importable ``tools.hf_zoo``.
    sys.path.insert(0, str(ROOT))
    from tools.hf_zoo import main as _main

    _main()
