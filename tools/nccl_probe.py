"""Can NCCL run several ranks on one GPU, and does forge build pass on it? (tools/gpu_check step)

The lent GPU machines have one GPU, so forge's collectives on NCCL can only be tried with
several processes sharing it. NCCL may refuse that ("Duplicate GPU detected"); this script asks
it once with a plain all-reduce and, when that works, runs ``forge build``'s own rank job
(``forge.job.run_build``: the parallel model against the single-device one, loss and gradient
norm over its steps) for each layout below, every rank on device 0 (``LOCAL_RANK=0``).

    python tools/nccl_probe.py [--device cuda|cpu] [--timeout S]

``--device cpu`` runs the same code on gloo (what ``tools/gpu_check --cpu-dry-run`` checks).
Prints one line per probe and exits 0 when each probe either passed or was refused by NCCL for
sharing the GPU (a fact to record, not a forge failure); 1 when anything else failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from typing import Any

# name, ranks, config overrides (forge build's --set syntax)
LAYOUTS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("TP=2 x FSDP2 (dp_shard=2)", 4, ("parallelism.tp=2", "parallelism.dp_shard=2")),
    (
        "EP=2 x FSDP2 (debug_moe)",
        2,
        ("model.preset=debug_moe", "parallelism.tp=1", "parallelism.ep=2"),
    ),
)
SHARED_GPU_REFUSAL = ("Duplicate GPU", "duplicate GPU")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world: int, port: int, device: str, job: str, overrides: tuple[str, ...], q: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",  # NOTE: every rank on device 0: the probe's whole point
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        if job == "all_reduce":
            q.put((rank, "ok", _all_reduce(device)))
        else:
            from forge import load_config
            from forge.job import run_build

            cfg = dataclasses.asdict(load_config(None, list(overrides)))
            report = run_build(cfg, device)
            lines = [line for line in report.text.splitlines() if "PASS" in line or "FAIL" in line]
            q.put((rank, "ok" if report.passed else "FAIL", " | ".join(lines)))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, one line
        text = f"{type(err).__name__}: {err}".replace("\n", " ")
        q.put((rank, "error", text[:400] + "\n" + traceback.format_exc()[-1500:]))


def _all_reduce(device: str) -> str:
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    try:
        x = torch.full((1024,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(x)
        n = dist.get_world_size()
        want = n * (n + 1) / 2
        if not bool((x == want).all()):
            raise RuntimeError(f"all_reduce gave {x[0].item()}, expected {want}")
        return f"all_reduce of {n} ranks = {want:.0f}"
    finally:
        dist.destroy_process_group()


def probe(device: str, job: str, world: int, overrides: tuple[str, ...], timeout_s: float):
    """Run ``job`` on ``world`` spawned ranks; (status, detail) of rank 0, or the first error."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, device, job, overrides, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, detail = q.get(timeout=1.0)
            results[rank] = (status, detail)
        except Exception:  # noqa: BLE001 - queue.Empty: check the processes and go on
            if any(p.exitcode not in (None, 0) for p in procs) and len(results) < world:
                dead = [p.exitcode for p in procs]
                if all(code is not None for code in dead):
                    break
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    errors = [results[r] for r in sorted(results) if results[r][0] != "ok"]
    if len(results) < world and not errors:
        return "TIMEOUT", f"{world - len(results)} of {world} ranks did not answer in {timeout_s} s"
    if errors:
        return errors[0]
    return results[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per probe")
    args = parser.parse_args()
    ok = True
    status, detail = probe(args.device, "all_reduce", 2, (), args.timeout)
    first = detail.splitlines()[0] if detail else ""
    print(f"probe all_reduce, 2 ranks on one {args.device} device: {status}: {first}", flush=True)
    if status != "ok":
        refused = any(s in detail for s in SHARED_GPU_REFUSAL)
        if not refused:
            print(detail)
        print("NCCL refuses ranks sharing one GPU" if refused else "all_reduce failed")
        return 0 if refused else 1
    for name, world, overrides in LAYOUTS:
        t = time.monotonic()
        status, detail = probe(args.device, "build", world, overrides, args.timeout)
        first = detail.splitlines()[0] if detail else ""
        print(
            f"probe forge build {name}, {world} ranks: {status} in "
            f"{time.monotonic() - t:.0f} s: {first}",
            flush=True,
        )
        if status != "ok":
            print(detail)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
