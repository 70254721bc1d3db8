"""forge train and its checkpoints: resharding resume, atomic saves, safe loading, data, loss.

Layout changes are run on persistent gloo ranks (``run_on_ranks``) through ``run_train`` itself;
the CLI runs (``forge train`` for dense, MoE and VLM, the progress bar, SIGTERM) start real ranks
through forge's launcher.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from forge import load_config
from forge.data import SyntheticData, TokenFile
from forge.export import export_checkpoint
from forge.kinds import model_kind
from forge.optim import clip_grad_norm_, warmup_cosine
from forge.train import _nonfinite_values, peak_flops, run_train, train_flops_per_token
from forge.train_console import StopFlag
from forge_checkpoint.dcp import SafeFileSystemReader, load_model_weights
from forge_checkpoint.export import from_hf_llama, hf_llama_config, load_safetensors
from forge_checkpoint.files import find_latest, latest_intact, read_train_state
from forge_core import ForgeConfigError, ModelConfig, Transformer
from forge_core.training import forward_backward

ROOT = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forge.cli"]


def _cfg(out: Path, steps: int = 10, **sections: dict) -> dict:
    cfg: dict = {
        "model": {"preset": "debug"},
        "training": {"steps": steps, "out_dir": str(out), "warmup_steps": 2, "lr": 3e-3},
        "checkpoint": {"every": 5, "save_at_end": False, "resume": "none"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _train(cfg: dict):
    return run_train(cfg, "cpu")


def _steps(summaries) -> list[tuple[int, float, float]]:
    return [(s.step, s.loss, s.grad_norm) for s in summaries[0].steps]


def _assert_same_steps(resumed, reference, tol: float = 1e-4) -> None:
    ref = {step: (loss, gnorm) for step, loss, gnorm in reference}
    assert resumed, "the resumed run did no step"
    for step, loss, gnorm in resumed:
        ref_loss, ref_gnorm = ref[step]
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= tol * abs(ref_gnorm), (step, gnorm, ref_gnorm)


# ---- resharding: save at step 5 under layout X, resume under layout Y, steps 6-10 equal ----------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "x", "y", "y_ranks"),
    [
        ("debug", {"dp_shard": 4}, {"tp": 2}, 4),  # FSDP2 x4 -> dp_shard 2 x tp 2
        ("debug", {"tp": 2}, {"data": "none"}, 1),  # FSDP2 x TP -> one plain rank
        # NOTE: the heavy lane (the README suite's 10 minutes): the next case changes EP too
        pytest.param("debug_moe", {"ep": 2}, {"ep": 4}, 4, marks=pytest.mark.heavy),  # EP 2 -> 4
        ("debug_moe", {"ep": 4}, {"tp": 2, "ep": 2}, 4),  # EP 4 -> dp_shard 2 x tp 2, EP 2
        ("debug_vlm", {"dp_shard": 4}, {"tp": 2}, 4),
        ("debug_field", {"domain": 2}, {"domain": 4}, 4),  # dp_shard 2 x domain 2 -> domain 4
        ("debug_field", {"domain": 4}, {"data": "none"}, 1),
    ],
)
def test_resume_under_another_layout_continues_the_uninterrupted_run(
    run_on_ranks, tmp_path, preset, x, y, y_ranks
):
    # Clipping (max_grad_norm below every step's norm), warmup + cosine and AdamW state all
    # have to come back for steps 6-10 to match.
    clip = {"max_grad_norm": 0.05 if preset == "debug_field" else 1.0}
    model = {"preset": preset}
    full = _steps(
        run_on_ranks(4, _train, _cfg(tmp_path / "x", model=model, parallelism=x, training=clip))
    )
    assert [s for s, _, _ in full] == list(range(1, 11))
    assert all(g > clip["max_grad_norm"] for _, _, g in full), "clipping must be active"
    ckpt = tmp_path / "x" / "checkpoints" / "step-00000005"
    resumed_cfg = _cfg(tmp_path / "y", model=model, parallelism=y, training=clip)
    resumed_cfg["checkpoint"]["resume"] = str(ckpt)
    resumed = _steps(run_on_ranks(y_ranks, _train, resumed_cfg))
    assert [s for s, _, _ in resumed] == [6, 7, 8, 9, 10]
    _assert_same_steps(resumed, full)


@pytest.mark.slow
def test_token_file_training_resumes_at_its_data_position(run_on_ranks, tmp_path):
    tokens = torch.empty(20_000, dtype=torch.long)  # a learnable file: t[i+1] = 3 t[i] + 1 mod 256
    tokens[0] = 5
    for i in range(1, len(tokens)):
        tokens[i] = (3 * tokens[i - 1] + 1) % 256
    (tmp_path / "tokens.bin").write_bytes(tokens.numpy().astype("uint16").tobytes())
    data = {"path": str(tmp_path / "tokens.bin"), "dtype": "uint16"}
    full = _steps(run_on_ranks(4, _train, _cfg(tmp_path / "x", data=data)))
    resumed_cfg = _cfg(tmp_path / "y", data=data, parallelism={"tp": 2})
    resumed_cfg["checkpoint"]["resume"] = str(tmp_path / "x" / "checkpoints" / "step-00000005")
    resumed = _steps(run_on_ranks(4, _train, resumed_cfg))
    assert [s for s, _, _ in resumed] == [6, 7, 8, 9, 10]
    _assert_same_steps(resumed, full)  # the same windows at the same steps on another layout
    assert full[-1][1] < full[0][1] - 1.0  # it learns the file's rule


@pytest.mark.slow
def test_async_save_and_resume_latest(run_on_ranks, tmp_path):
    cfg = _cfg(tmp_path, steps=6, checkpoint={"every": 2, "async_save": True, "keep": 2})
    full = _steps(run_on_ranks(2, _train, cfg))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000004", "step-00000006"]  # keep=2 pruned step 2
    # A second run with more steps and resume="latest" continues from step 6.
    more = _cfg(tmp_path, steps=8, checkpoint={"every": 2, "async_save": True, "resume": "latest"})
    summary = run_on_ranks(2, _train, more)[0]
    assert summary.start_step == 6 and [s.step for s in summary.steps] == [7, 8]
    assert read_train_state(find_latest(tmp_path / "checkpoints"))["step"] == 8
    assert full[-1][0] == 6


# ---- atomic saves: a save killed half-way leaves the previous checkpoint loadable --------------

_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time, torch
    import forge_checkpoint.dcp as fc
    from torch.distributed.checkpoint import FileSystemWriter
    from forge_checkpoint.dcp import Checkpointer
    from forge_core import ModelConfig, Transformer

    def save_and_stall(root, phase):
        model = Transformer(ModelConfig.preset("debug"))
        model.init_weights(0)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = Checkpointer(root)
        ckpt.save(2, model, opt, {})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

        def stall(*args, **kwargs):
            print("STALLED", phase, os.getpid(), flush=True)
            time.sleep(120)

        def then_stall(fn):
            def wrapped(*args, **kwargs):
                out = fn(*args, **kwargs)
                stall()
                return out
            return wrapped

        if phase == "before shards":  # the JSON and RNG files exist, no tensor data
            FileSystemWriter.write_data = stall
        elif phase == "after shards":  # shards written; DCP's .metadata not yet
            FileSystemWriter.finish = stall
        elif phase == "before the manifest":  # every DCP file written
            fc.write_manifest = stall
        elif phase == "before the rename":  # manifest written and fsynced, not yet published
            fc.write_manifest = then_stall(fc.write_manifest)
        ckpt.save(4, model, opt, {})

    # NOTE: one interpreter imports torch and forge once (seconds), then forks one process per
    # phase (before any tensor work, so no thread pool is forked); each saves into its own root
    # and is killed by the test. The parent reports how each ended.
    children = {}
    for root, phase in zip(sys.argv[1::2], sys.argv[2::2]):
        pid = os.fork()
        if pid == 0:
            try:
                save_and_stall(root, phase)
            except BaseException:  # say why on stdout: the test shows what it read
                import traceback
                print("FAILED", phase, traceback.format_exc().replace(chr(10), " | "), flush=True)
            finally:
                os._exit(1)
        children[pid] = phase
    while children:
        pid, status = os.wait()
        print("ENDED", children.pop(pid), os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    """
)

_PHASES = ["before shards", "after shards", "before the manifest", "before the rename"]


class _StalledSaves:
    """The process of _KILLED_SAVE and what it printed: ``STALLED <phase> <pid>`` when the save
    of a phase stalls, ``ENDED <phase> <signal>`` once that process is gone."""

    def __init__(self, base: Path) -> None:
        self.roots = {phase: base / phase.replace(" ", "-") / "ckpt" for phase in _PHASES}
        args = [str(a) for phase, root in self.roots.items() for a in (root, phase)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_SAVE, *args],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: close() ends it and every child
        )
        self.lines: list[str] = []

    def line(self, prefix: str, phase: str) -> list[str]:
        """The words after ``<prefix> <phase>``, reading on until that line has come."""
        while True:
            for line in self.lines:
                if line.startswith(f"{prefix} {phase} "):
                    return line[len(prefix) + len(phase) + 2 :].split()
                assert not line.startswith(f"ENDED {phase} "), (
                    f"it ended before {prefix}: {self.lines}"
                )
            line = self.proc.stdout.readline()
            assert line, f"{prefix} {phase} never came: {self.lines}"
            self.lines.append(line.strip())

    def close(self) -> None:
        if self.proc.poll() is None:  # NOTE: alive, so its group id is still its own
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def stalled_saves(tmp_path_factory):
    saves = _StalledSaves(tmp_path_factory.mktemp("killed-saves"))
    yield saves
    saves.close()


@pytest.mark.lifecycle  # NOTE: whole forge train runs killed mid-save: the process lane
@pytest.mark.parametrize("phase", _PHASES)
def test_a_save_killed_half_way_leaves_the_previous_checkpoint_intact(stalled_saves, phase):
    root = stalled_saves.roots[phase]
    (pid,) = stalled_saves.line("STALLED", phase)
    os.kill(int(pid), signal.SIGKILL)  # no cleanup runs
    assert stalled_saves.line("ENDED", phase) == [str(int(signal.SIGKILL))]  # and it is gone
    leftovers = sorted(p.name for p in root.iterdir())
    assert leftovers == [".tmp-step-00000004", "step-00000002"]
    tmp = root / ".tmp-step-00000004"
    assert any(tmp.glob("*.distcp")) == (phase != "before shards"), "the kill came where planned"
    assert (tmp / "manifest.json").is_file() == (phase == "before the rename")
    latest, skipped = latest_intact(root)
    assert latest is not None and latest.name == "step-00000002" and not skipped
    from forge_checkpoint.dcp import Checkpointer

    model = Transformer(ModelConfig.preset("debug"))
    model.init_weights(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(root).load(latest, model, opt)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name  # step 2's weights, not the +1 of step 4
    # The next save clears the leftover.
    Checkpointer(root).save(6, model, opt, {})
    assert not list(root.glob(".tmp-*")) and find_latest(root).name == "step-00000006"


# ---- safe loading ------------------------------------------------------------------------------


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_metadata_with_foreign_objects_is_refused(tmp_path):
    model = nn.Linear(2, 2)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    reader = SafeFileSystemReader(tmp_path)
    assert "model.weight" in reader.read_metadata().state_dict_metadata  # DCP's own: accepted
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeFileSystemReader(tmp_path).read_metadata()


def test_checkpoint_with_pickled_objects_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": {"w": torch.ones(2)}, "extra": {"obj": [1, 2]}},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    with pytest.raises(ForgeConfigError, match="pickled objects"):
        SafeFileSystemReader(tmp_path).read_metadata()


# ---- export: a sharded checkpoint consolidated, to safetensors and to a HF Llama folder ----------


@pytest.mark.slow
def test_export_of_a_sharded_checkpoint_round_trips_through_hugging_face(run_on_ranks, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_on_ranks(4, _train, _cfg(tmp_path, steps=5, parallelism={"tp": 2}))
    ckpt = tmp_path / "checkpoints" / "step-00000005"
    flat = load_safetensors(export_checkpoint(ckpt, tmp_path / "model.safetensors"))
    cfg = ModelConfig.preset("debug")
    with torch.device("meta"):
        forge_model = Transformer(cfg)
    forge_model.to_empty(device="cpu")
    forge_model.reset_rope()
    forge_model.load_state_dict(flat)
    assert not torch.equal(
        flat["layers.0.attention.wq.weight"], _fresh_weights()["layers.0.attention.wq.weight"]
    )
    hf_dir = export_checkpoint(ckpt, tmp_path / "hf", layout="hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, forge_model(tokens), rtol=1e-5, atol=1e-5)
    back = from_hf_llama(hf.state_dict(), cfg)  # and back: bit-identical weights
    for name, value in flat.items():
        assert torch.equal(back[name], value), name
    assert hf_llama_config(cfg).num_hidden_layers == cfg.n_layers


def _fresh_weights() -> dict:
    model = Transformer(ModelConfig.preset("debug"))
    model.init_weights(0)
    return model.state_dict()


# ---- the loss: token-weighted over the data-parallel ranks ---------------------------------------


def _token_weighted_grads() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """2 DDP ranks with very different numbers of ignored targets vs one device on the whole batch."""
    from forge_fsdp_wrap import apply_ddp
    from forge_mesh import build_device_mesh

    cfg = ModelConfig.preset("debug")
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17))
    tokens[:2, 3:] = 7  # rank 0's samples: most targets are the ignored id
    reference = Transformer(cfg)
    reference.init_weights(0)
    forward_backward(reference, tokens, mesh=None, ignore_token=7)
    mesh = build_device_mesh({"data": "ddp"}, "cpu")
    parallel = Transformer(cfg)
    parallel.init_weights(0)
    ddp = apply_ddp(parallel, mesh)
    rank = dist.get_rank()
    local = tokens.chunk(2)[rank]
    forward_backward(ddp, local, mesh=mesh, ignore_token=7)  # x dp / the global count
    naive = Transformer(cfg)
    naive.init_weights(0)
    # mesh=None: each rank's own token mean, which DDP then averages: what a naive loop does
    forward_backward(apply_ddp(naive, mesh), local, mesh=None, ignore_token=7)
    grads = [p.grad for p in reference.parameters()]
    return (
        [
            (a - b).abs().max() / b.abs().max()
            for a, b in zip((p.grad for p in parallel.parameters()), grads, strict=True)
        ],
        [
            (a - b).abs().max() / b.abs().max()
            for a, b in zip((p.grad for p in naive.parameters()), grads, strict=True)
        ],
    )


def test_loss_is_token_weighted_across_data_parallel_ranks(run_on_ranks):
    weighted, naive = run_on_ranks(2, _token_weighted_grads)[0]
    assert max(weighted) < 1e-5
    assert max(naive) > 1e-2  # the test can tell the two apart


def _train_until_divergence(cfg: dict) -> str:
    try:
        run_train(cfg, "cpu")
    except FloatingPointError as err:
        return str(err)
    return "no divergence"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_diverging_run_stops_before_the_bad_step_and_publishes_only_finite_checkpoints(
    run_on_ranks, tmp_path, async_save
):
    """lr 1e36 (no clipping): step 1 is finite (huge weights), step 2's loss is NaN. The run
    stops before step 2's optimizer step; the only checkpoint is step 1, finite throughout (a
    resume=latest would load a usable model). Written asynchronously, it is still published
    before the run stops, and the message names it."""
    cfg = _cfg(tmp_path, steps=6, training={"lr": 1e36, "max_grad_norm": 0.0, "warmup_steps": 0})
    cfg["checkpoint"].update(every=1, keep=10, async_save=async_save)
    message = run_on_ranks(2, _train_until_divergence, cfg)[0]
    assert message.startswith("loss is nan at step 2; stopped before the optimizer step"), message
    root = tmp_path / "checkpoints"
    assert message.endswith(f"; the last checkpoint is {root / 'step-00000001'}"), message
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    model = Transformer(ModelConfig.preset("debug"))
    load_model_weights(root / "step-00000001", model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert max(p.abs().max() for p in model.parameters()) > 1e30  # it did blow up


def _train_with_nan_router_biases(cfg: dict) -> str:
    """run_train whose MoE balancing update turns the routers' ``expert_bias`` buffers into
    NaN (as ``moe.moe_bias_update_rate = inf`` did): the parameters stay finite."""
    from forge_moe_ep.moe import MoE

    update = MoE.forge_after_optimizer_step

    def poisoned(self: MoE) -> None:
        update(self)
        self.router.expert_bias.fill_(float("nan"))

    MoE.forge_after_optimizer_step = poisoned  # type: ignore[method-assign]
    try:
        return _train_until_divergence(cfg)
    finally:
        MoE.forge_after_optimizer_step = update  # type: ignore[method-assign]


def test_a_checkpoint_with_non_finite_buffers_is_never_written(run_on_ranks, tmp_path):
    cfg = _cfg(tmp_path, steps=3, model={"preset": "debug_moe"})
    cfg["checkpoint"].update(every=1)
    message = run_on_ranks(2, _train_with_nan_router_biases, cfg)[0]
    assert message.startswith("step 1: non-finite values (NaN/inf): "), message
    assert "(first: model.layers.0.feed_forward.router.expert_bias)" in message
    assert message.endswith("; no checkpoint was saved"), message
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_nonfinite_values_counts_parameters_and_optimizer_state():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert _nonfinite_values(model, optimizer) == 0
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    optimizer.state[model.bias]["exp_avg"][1] = float("inf")
    assert _nonfinite_values(model, optimizer) == 2


# ---- pieces ----------------------------------------------------------------------------------


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert abs(float(ours) - float(theirs)) < 1e-6
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_takes_norm_type_and_returns_the_grads_dtype_as_torch(norm_type, dtype):
    torch.manual_seed(1)
    a = [nn.Parameter(torch.randn(4, 3, dtype=dtype)) for _ in range(3)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(a, 0.5, norm_type=norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(b, 0.5, norm_type=norm_type)
    assert ours.dtype == theirs.dtype == dtype and ours.device == theirs.device
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert abs(float(ours) - float(theirs)) <= tol * float(theirs)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ForgeConfigError, match="norm_type=0"):
        clip_grad_norm_(a, 0.5, norm_type=0)


def _sharded_norms() -> list[tuple[float, float]]:
    """TP-sharded (DTensor) and plain gradients on 2 ranks: forge's norms vs torch's on the
    gathered full gradients, for each norm type."""
    from forge_mesh import build_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")["tp"]
    torch.manual_seed(2)  # same on both ranks: the full tensors agree
    full = [torch.randn(6, 4), torch.randn(5)]
    out = []
    for norm_type in (1.0, 2.0, float("inf")):
        sharded = nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))
        sharded.grad = distribute_tensor(full[0].clone(), mesh, [Shard(0)])
        plain = nn.Parameter(torch.zeros(5))
        plain.grad = full[1].clone()
        ours = clip_grad_norm_([sharded, plain], 0.0, norm_type=norm_type)  # 0: measure only
        theirs = torch.nn.utils.get_total_norm([g.clone() for g in full], norm_type)
        out.append((float(ours), float(theirs)))
    return out


def test_clip_grad_norm_p_norms_of_sharded_gradients(run_on_ranks):
    for ours, theirs in run_on_ranks(2, _sharded_norms)[0]:
        assert abs(ours - theirs) <= 1e-6 * theirs


def test_sigterm_is_noted_quietly_and_ctrl_c_is_acknowledged(capsys, monkeypatch):
    # SIGTERM (a scheduler's preemption) is noted without a line: the report names it.
    quiet = StopFlag()
    quiet(signal.SIGTERM, None)
    quiet(signal.SIGINT, None)  # a second signal changes nothing
    assert quiet.signal == "SIGTERM" and capsys.readouterr().err == ""
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    loud = StopFlag()
    loud(signal.SIGINT, None)
    assert loud.signal == "SIGINT"
    assert capsys.readouterr().err == "[rank 0] SIGINT: finishing this step, then saving\n"


def test_the_stop_names_the_signal_and_the_rank_that_got_it():
    # every rank's vote is its signal number (0: none); the run stops when any rank has one
    flag = StopFlag()
    assert flag.stopped_by([0, int(signal.SIGTERM), int(signal.SIGINT)]) == "SIGTERM on rank 1"
    flag(signal.SIGTERM, None)  # this rank got one too: its own is named
    assert flag.signum == signal.SIGTERM and flag.stopped_by([15, int(signal.SIGINT)]) == "SIGTERM"


def test_flops_per_token_and_no_mfu_on_cpu():
    cfg = load_config({"training": {"seq_len": 32}})
    m = cfg.decoder
    assert train_flops_per_token(cfg) == 6 * m.num_params() + 6 * m.n_layers * 32 * m.dim
    moe = load_config({"model": {"preset": "debug_moe"}})
    inactive = (
        (moe.decoder.num_experts - moe.decoder.top_k)
        * 3
        * moe.decoder.dim
        * moe.decoder.moe_ffn_dim
    )
    assert 6 * (moe.decoder.num_params() - 2 * inactive) + 6 * 2 * 32 * 64 == train_flops_per_token(
        moe
    )
    assert peak_flops(torch.device("cpu")) is None


def test_warmup_then_cosine_to_the_floor():
    f = [warmup_cosine(s, warmup_steps=4, total_steps=14, min_ratio=0.1) for s in range(16)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and abs(f[9] - 0.55) < 1e-12 and f[14] == f[15] == pytest.approx(0.1)
    assert all(x >= y for x, y in zip(f[4:], f[5:], strict=False))


def test_token_file_is_sharded_by_data_parallel_rank(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes((torch.arange(1000) % 251).numpy().astype("uint16").tobytes())
    kwargs = dict(seq_len=16, global_batch=8, vocab_size=256, seed=0)
    whole = TokenFile(str(path), "uint16", dp_rank=0, dp_size=1, **kwargs)
    shards = [TokenFile(str(path), "uint16", dp_rank=r, dp_size=4, **kwargs) for r in range(4)]
    for step in (0, 7, 60):  # step 60 is past one pass over the 62 windows: a reshuffled pass
        parts = torch.cat([s.batch(step).tokens for s in shards])
        assert torch.equal(parts, whole.batch(step).tokens)
        rows = whole.batch(step).tokens
        assert rows.shape == (8, 17)
        assert torch.equal(
            rows[:, 1:] - rows[:, :-1],
            torch.ones(8, 16, dtype=torch.long).masked_fill(rows[:, 1:] == 0, -250),
        )
    seen = torch.cat([whole.batch(s).tokens[:, 0] for s in range(7)])  # 56 of 62 windows, no repeat
    assert len(set(seen.tolist())) == 56
    with pytest.raises(ForgeConfigError, match="vocab_size"):
        TokenFile(str(path), "uint16", dp_rank=0, dp_size=1, **{**kwargs, "vocab_size": 100}).batch(
            0
        )
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ForgeConfigError, match="multiple of 2"):
        TokenFile(str(tmp_path / "odd.bin"), "uint16", dp_rank=0, dp_size=1, **kwargs)


def test_forge_train_refuses_a_missing_checkpoint_or_token_file_before_launch(tmp_path, capsys):
    from forge.cli import main

    missing = str(tmp_path / "nope")
    assert main(["train", "--set", f"checkpoint.resume={missing!r}"]) == 2
    assert "is not a forge checkpoint" in capsys.readouterr().err
    assert main(["train", "--set", f"data.path={missing!r}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_synthetic_data_slices_one_global_batch():
    cfg = load_config({"training": {"global_batch_size": 8}})
    parts = torch.cat([SyntheticData(cfg, r, 4).batch(3).tokens for r in range(4)])
    assert torch.equal(parts, SyntheticData(cfg, 0, 1).batch(3).tokens)


@pytest.mark.parametrize("preset", ["debug", "debug_vlm"])
def test_a_ranks_synthetic_batch_holds_only_its_own_rows(preset):
    """The rank's slice owns its storage: a view would keep the whole global batch (every
    rank's images) alive for as long as autograd keeps the slice, through backward
    (tools/bench_plan_accuracy.py measured the VLM rows 9% over the plan until this)."""
    cfg = load_config({"model": {"preset": preset}, "training": {"global_batch_size": 8}})
    kind = model_kind(cfg)
    batch = kind.data(1, 4, image_token_id=3, image_tokens=4).batch(0)
    for tensor in (batch.tokens, batch.images):
        if tensor is not None:
            assert tensor.untyped_storage().nbytes() == tensor.nbytes, tensor.shape


# ---- the CLI: 20 steps on 4 ranks for dense, MoE and VLM, progress, SIGTERM ---------------------


def _env() -> dict:
    # NOTE: prepend: where forge runs from sources (tools/forge_pythonpath.sh) they are there too.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _train_printing(cfg: dict) -> tuple[list[tuple[int, float, float]], str]:
    """run_train with rank 0's stdout (the non-TTY progress lines) captured."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        summary = run_train(cfg, "cpu")
    return [(s.step, s.loss, s.grad_norm) for s in summary.steps], buffer.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["debug", "debug_moe", "debug_vlm", "debug_field"])
def test_train_10_steps_on_4_ranks_for_each_model_kind(run_on_ranks, tmp_path, preset):
    # forge train's own ranks and CLI are exercised by the SIGTERM and Ctrl-C tests below.
    # NOTE: 10 steps (20 before): checkpoints at steps 5 and 10, and the loss still falls by
    # more than a fifth; the suite's 10 minutes are better spent elsewhere.
    steps_n = 10
    cfg = _cfg(tmp_path, steps=steps_n, model={"preset": preset}, checkpoint={"save_at_end": True})
    cfg["parallelism"] = {"domain": 2} if preset == "debug_field" else {"tp": 2}
    steps, printed = run_on_ranks(4, _train_printing, cfg)[0]
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{k}/{steps_n}" for k in range(1, steps_n + 1)]
    assert "gnorm" in lines[-1] and ("tok/s" in lines[-1] or "pts/s" in lines[-1])
    assert lines[-1].split("mem ")[1].split()[0].count("|") == 3  # peak memory of 4 ranks
    assert steps[-1][1] < 0.8 * steps[0][1]  # it learns
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps_logged] == list(range(1, steps_n + 1))
    assert len(steps_logged[0]["peak_mem_bytes"]) == 4 and records[0]["event"] == "start"
    assert records[-1]["event"] == "end" and records[-1]["step"] == steps_n
    assert find_latest(tmp_path / "checkpoints").name == f"step-{steps_n:08d}"


@pytest.mark.lifecycle  # NOTE: a whole forge train signalled (Ctrl-C): the process lane
def test_progress_bar_on_a_terminal_and_ctrl_c_saves_and_exits_cleanly(tmp_path):
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: forge train with a terminal as stdout and stderr
        os.environ.update(PYTHONPATH=_env()["PYTHONPATH"], COLUMNS="160", LINES="24")
        args = ["train", "--nproc", "2", "--set", "training.steps=100000"]
        os.execv(sys.executable, [*FORGE, *args, "--set", f"training.out_dir={tmp_path}"])
    text, interrupted = "", False
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        text += chunk.decode(errors="replace")
        if not interrupted and "| 4/100000" in text:
            # Ctrl-C: the terminal sends SIGINT to its foreground process group, the launcher
            # and both ranks (pty.fork made the child a session and group leader).
            os.killpg(pid, signal.SIGINT)
            interrupted = True
    _, status = os.waitpid(pid, 0)
    assert interrupted and os.WEXITSTATUS(status) == 0, text[-2000:]
    bar = [part for part in text.split("\r") if "forge train " in part and "tok/s" in part]
    assert len(bar) >= 4, text[-2000:]  # redrawn in place (carriage returns), once per step
    assert "loss" in bar[-1] and "gnorm" in bar[-1] and "GiB" in bar[-1]
    assert "step 1/" not in text  # no plain lines on a terminal
    assert "stopped by SIGINT" in text
    state = read_train_state(find_latest(tmp_path / "checkpoints"))
    assert state["step"] >= 4


@pytest.mark.lifecycle  # NOTE: a whole forge train signalled (SIGTERM): the process lane
def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen(
        [
            *FORGE,
            "train",
            "--nproc",
            "2",
            "--set",
            "training.steps=100000",
            "--set",
            f"training.out_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 3/"):
            break
    # not a terminal: one plain line per step with the numbers and every rank's peak memory
    assert [line.split()[1] for line in lines if line.startswith("step ")] == [
        "1/100000",
        "2/100000",
        "3/100000",
    ]
    for field in ("loss", "gnorm", "tok/s", "mem ", "GiB", "lr"):
        assert field in lines[-1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM" in err
    latest = find_latest(tmp_path / "checkpoints")
    state = read_train_state(latest)
    assert state["step"] >= 3 and latest.name == f"step-{state['step']:08d}"
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["event"] == "end" and end["stopped_by"] == "SIGTERM" and end["step"] == state["step"]
