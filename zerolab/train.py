"""Train a small model with any stage: the same script on one machine or on many.

    python -m zerolab.train --stage 0 --world-size 2          # 2 ranks started by zerolab.launch
    python -m zerolab.train --stage 0 1 2 3                   # every stage, one after the other
    torchrun --nproc-per-node 2 -m zerolab.train --stage 0    # ranks started by torchrun (env://)
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port 29500 \\
             --nproc-per-node 4 -m zerolab.train --stage 2    # two machines, 8 ranks

Under torchrun the script joins the process group from the environment
(:func:`zerolab.init_from_env`); otherwise it starts ``--world-size`` local ranks itself. Every rank
trains on its own batches (rank r, step s: ``zerolab.models.batch(seed=...)``), so the run equals
one process training on the N batches concatenated. Rank 0 prints, per step, the GLOBAL loss (the
mean over ranks = the loss of the concatenated batch), the step time and the bytes sent.
"""
import argparse
import os
import sys
import time

DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerolab.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, nargs="+", default=[0], choices=(0, 1, 2, 3),
                   help="0 = data parallel, 1/2/3 = ZeRO; several run one after the other (default 0)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--param-dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--offload", choices=("optimizer",), default=None)
    p.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--backend", default="auto", help="auto (nccl with a GPU per rank, else gloo), gloo, nccl")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.world_size < 1:
        p.error("--steps, --batch-size and --world-size must be positive")
    return args


def step_batch(name, model, *, step, rank, world_size, seed, batch_size):
    """The batch rank ``rank`` trains on at ``step`` (distinct for every (step, rank))."""
    from zerolab import models
    return models.batch(name, seed=seed * 1_000_003 + step * world_size + rank,
                        batch_size=batch_size, model=model)


def train(args, *, log=print):
    """Train each stage of ``args.stage`` from the same initial model, ``args.steps`` steps, on
    this rank (the process group must exist). Returns {stage: [global loss of each step]}."""
    return {stage: train_stage(args, stage, log=log) for stage in args.stage}


def train_stage(args, stage, *, log=print):
    import torch
    import torch.distributed as dist

    import zerolab
    from zerolab import comm, models
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.build(args.model, seed=args.seed)
    dtype = DTYPES[args.param_dtype] and getattr(torch, DTYPES[args.param_dtype])
    engine = zerolab.initialize(model, stage=stage, lr=args.lr, param_dtype=dtype,
                                       offload=args.offload, bucket_bytes=args.bucket_bytes)
    losses = []
    for step in range(args.steps):
        x, y = step_batch(args.model, model, step=step, rank=rank, world_size=world_size,
                          seed=args.seed, batch_size=args.batch_size)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        seconds = time.perf_counter() - t0
        sent = engine.last_step_comm.sent_bytes
        total = loss.detach().float().reshape(1).clone()
        comm.all_reduce(total)                       # outside the step's log: reporting only
        losses.append(total.item() / world_size)
        if rank == 0:
            log(f"stage {stage} step {step} loss {losses[-1]:.6f} time {seconds * 1e3:.1f} ms "
                f"sent {sent / 1e6:.3f} MB")
    if rank == 0:
        report = engine.memory_report()
        states = sum(b for dev in report.values() for b in dev.values())
        log(f"stage {stage}, {world_size} ranks: model states on rank 0 {states / 1e6:.3f} MB")
    return losses


def _under_torchrun():
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def main(argv=None):
    args = parse_args(argv)
    if _under_torchrun():
        import torch.distributed as dist

        from zerolab import init_from_env
        init_from_env(backend=args.backend)
        try:
            train(args, log=lambda line: print(line, flush=True))
        finally:
            dist.destroy_process_group()
    else:
        from zerolab import launch
        launch(train, args.world_size, args, backend=args.backend, timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
