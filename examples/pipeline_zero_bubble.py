"""Pipeline-parallel training on 2 processes: 1F1B, and a zero-bubble schedule built on
``GradManager.backward_split``.

An MLP of 8 Linear layers is cut into 2 stages of 4 layers, one per process: rank 0 runs the
first stage, rank 1 the second and the loss. Activations go down and input gradients go up as
torch.distributed point-to-point messages (gloo; NCCL with ``--device cuda`` and a GPU per
rank). A step trains on one global batch cut into M micro-batches (``--micro-batches``), then
each stage takes its own optimizer step (AdamW, or SGD). Two schedules train side by side from
the same weights:

* **1F1B**: stage s first runs ``P - 1 - s`` forwards (warm-up; P stages), then one forward and
  one whole backward in turn, then the remaining backwards (cool-down). A backward is one
  ``gm.backward(out, dy)``, and the gradient of the stage's input is sent upstream after it.
* **Zero bubble** (like ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism"): the same order
  of forwards and backwards, but each backward is split in two.
  ``rest = gm.backward_split(out, dy, first=[x])`` is **B**: it computes only the gradient of the
  stage's input ``x``, which is sent upstream at once, so the stage before starts its own
  backward half a backward earlier. ``rest.finish()`` is **W**: the weights' gradients,
  computed later. Stage s runs the W of micro-batch m after the B of micro-batch m + s, so the
  last stage does W work while it would otherwise wait for the next activation, and its last
  W's overlap the first stage's last backwards. The first stage has no input gradient to send,
  so it runs whole backwards, as in 1F1B. In a model where F, B and W each take one unit (a
  whole backward two), 1F1B takes 3 (M + P - 1) units a step and this schedule 3 M + P - 1
  (15 and 13 for the defaults): the script prints that model's numbers for the orders it runs.

A micro-batch's forward and its backward are one recording (``gm.record()`` at the forward,
ended by the backward); since 1F1B runs other forwards in between, each stage has one
GradManager per micro-batch in flight (``P - s`` on stage s), all attached to the stage's
parameters. The stage input ``x`` (a received activation) is attached while recording, right
after it arrives, which is what ``first=[x]`` asks for.

The script prints each step's loss under both schedules and under single-process training of
the same model on the same micro-batches (plain ``loss.backward()``, no gradmgr), the median
step time of both schedules and how long each stage waited for messages. It exits non-zero
unless every micro-batch's loss of both schedules equals the single-process one exactly
(``==``, no tolerance: the stage cut changes no arithmetic, the split backward is bit-identical
to a single backward on the same graph, gradients are accumulated over the micro-batches in the
same order, and the optimizers update each parameter by the same per-tensor arithmetic) and the
final parameters are ``torch.equal`` to the single-process ones on every stage.

What to expect of the times: the split has a fixed cost (about half a millisecond per
micro-batch on a CPU: a Python walk of the graph and one more engine run per layer), so the
zero-bubble schedule gains only where a micro-batch's work is large against it. On 16 idle CPU
cores (one thread per rank), five runs of 10-20 steps with the defaults gave it 0.88x to 0.98x
the 1F1B step time (median 0.94x; the unit-cost model says 13/15 = 0.87), and 0.99x to 1.03x
with ``--batch 64``. On a busy machine the times are noise. On a GPU at these sizes a step is
bound by Python's overhead, not by the GPU, and the split's bookkeeping makes the zero-bubble
step the slower one (1.24x with ``--device cuda`` on one GPU).

Run it either way (``torchrun`` also takes 4 or 8 ranks: a stage each):
    python examples/pipeline_zero_bubble.py --steps 10    # spawns the 2 ranks itself
    torchrun --nproc_per_node 2 examples/pipeline_zero_bubble.py --steps 10
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gradmgr import GradManager
from gradmgr.distributed import run_ranks

WORLD = 2  # processes spawned by `python examples/pipeline_zero_bubble.py`
LAYERS = 8  # Linear layers; every stage gets LAYERS // stages of them

Op = Tuple[str, int]
"""One piece of work of a stage: (kind, micro-batch). Kinds: "F" forward, "BW" whole backward,
"B" the input-gradient part of a backward, "W" its weight part."""


# ------------------------------------------------------------------------------- schedules
def one_f_one_b(stage: int, stages: int, micro: int) -> List[Op]:
    """1F1B: ``stages - 1 - stage`` warm-up forwards, then forward / whole backward pairs,
    then the backwards left."""
    warm = min(stages - 1 - stage, micro)
    ops: List[Op] = [("F", m) for m in range(warm)]
    for m in range(micro - warm):
        ops += [("F", warm + m), ("BW", m)]
    return ops + [("BW", m) for m in range(micro - warm, micro)]


def zero_bubble(stage: int, stages: int, micro: int) -> List[Op]:
    """1F1B's forwards and backwards in 1F1B's order, every backward split into B then W;
    the W of micro-batch m runs after the B of micro-batch m + stage (the last stages wait
    longest for activations, so they keep the most W work back), the rest at the end.

    Stage s then holds at most ``stages`` micro-batches' saved tensors (1F1B's ``stages - s``
    until B, up to s more until W), as many as 1F1B's first stage. The first stage has no
    input gradient to send and would run each W right after its B: it runs whole backwards.
    """
    lag = stage
    if lag == 0:
        return one_f_one_b(stage, stages, micro)
    ops: List[Op] = []
    for kind, m in one_f_one_b(stage, stages, micro):
        if kind == "F":
            ops.append(("F", m))
            continue
        ops.append(("B", m))
        if m >= lag:
            ops.append(("W", m - lag))
    return ops + [("W", m) for m in range(max(micro - lag, 0), micro)]


SCHEDULES = {"1F1B": one_f_one_b, "zero bubble": zero_bubble}
UNIT_COST = {"F": 1, "B": 1, "W": 1, "BW": 2}


def unit_cost_time(orders: Sequence[Sequence[Op]]) -> int:
    """How long a step takes when F, B and W take one unit each (BW two) and messages none:
    each stage runs its ops in order, an F waiting for the activation from the stage before,
    a B or BW for the gradient from the stage after. Raises if the orders deadlock, so every
    schedule run below is checked here first."""
    stages = len(orders)
    ready: Dict[Tuple[str, int, int], int] = {}  # (message, from stage, micro-batch) -> time
    pos, clock = [0] * stages, [0] * stages
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while pos[s] < len(orders[s]):
                kind, m = orders[s][pos[s]]
                need = (("act", s - 1, m) if kind == "F" and s > 0 else
                        ("grad", s + 1, m) if kind in ("B", "BW") and s < stages - 1 else None)
                if need is not None and need not in ready:
                    break
                clock[s] = max(clock[s], ready[need] if need else 0) + UNIT_COST[kind]
                if kind == "F":
                    ready[("act", s, m)] = clock[s]
                elif kind in ("B", "BW"):
                    ready[("grad", s, m)] = clock[s]
                pos[s] += 1
                moved = True
    stuck = [s for s in range(stages) if pos[s] < len(orders[s])]
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: stages {stuck} wait forever")
    return max(clock)


def describe(ops: Sequence[Op]) -> str:
    return " ".join(f"{kind}{m}" for kind, m in ops)


# ------------------------------------------------------------------------------- model, data
def build_model(args: argparse.Namespace) -> nn.Sequential:
    """Linear layers inputs -> hidden -> ... -> hidden -> outputs with tanh between them."""
    torch.manual_seed(args.seed)
    dims = [args.inputs] + [args.hidden] * (LAYERS - 1) + [args.outputs]
    modules: List[nn.Module] = []
    for i in range(LAYERS):
        modules.append(nn.Linear(dims[i], dims[i + 1]))
        if i < LAYERS - 1:
            modules.append(nn.Tanh())
    return nn.Sequential(*modules)


def stage_slice(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """Stage ``stage``'s Linear layers, each with the tanh after it (modules shared with
    ``model``)."""
    per = 2 * (LAYERS // stages)  # a Linear and its tanh
    return model[stage * per:min((stage + 1) * per, len(model))]


def micro_batches(step: int, args: argparse.Namespace) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The step's global batch as M micro-batches of (x, y), the same on every rank: a fixed
    regression task, y = sin(x A) plus noise."""
    g = torch.Generator().manual_seed(1000 + step)
    a = torch.linspace(-1.0, 1.0, args.inputs * args.outputs).reshape(args.inputs, args.outputs)
    out = []
    for _ in range(args.micro_batches):
        x = torch.randn(args.batch, args.inputs, generator=g)
        out.append((x, torch.sin(x @ a) + 0.05 * torch.randn(args.batch, args.outputs,
                                                             generator=g)))
    return out


def loss_of(out: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    """A micro-batch's share of the global batch's mean squared error."""
    return F.mse_loss(out, y) / micro


def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def total(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """A step's loss: the micro-batches' float32 losses added in order."""
    result = torch.zeros((), dtype=losses[0].dtype, device=losses[0].device)
    for loss in losses:
        result = result + loss
    return result


# ------------------------------------------------------------------------------- messages
class Links:
    """A stage's point-to-point messages: activations down to stage + 1, input gradients up to
    stage - 1. Each direction between two neighbours has a process group of its own, so that
    on NCCL a send in one direction never queues behind a receive in the other. All the
    receives of a step are posted when it starts, each into its own buffer, so a message
    never waits for its receiver; ``waited`` adds up the time spent waiting for one."""

    def __init__(self, stage: int, stages: int, device: torch.device, via_host: bool) -> None:
        # every rank creates every group, in the same order
        self.down = [dist.new_group([s, s + 1]) for s in range(stages - 1)]
        self.up = [dist.new_group([s, s + 1]) for s in range(stages - 1)]
        self.stage, self.stages, self.device = stage, stages, device
        self.wire = torch.device("cpu") if via_host else device  # gloo sends CPU tensors only
        self.sends: List[Tuple[dist.Work, torch.Tensor]] = []
        self.waited = 0.0

    def post_receives(self, shape: Tuple[int, ...],
                      micro: int) -> Tuple[Optional[list], Optional[list]]:
        """(activations from stage - 1, gradients from stage + 1): per micro-batch a
        (work, buffer) pair, or None on the first / last stage."""
        def receive(peer: int, group) -> list:
            pending = []
            for _ in range(micro):
                buffer = torch.empty(shape, device=self.wire)
                pending.append((dist.irecv(buffer, peer, group=group), buffer))
            return pending

        s = self.stage
        acts = receive(s - 1, self.down[s - 1]) if s > 0 else None
        grads = receive(s + 1, self.up[s]) if s < self.stages - 1 else None
        return acts, grads

    def wait(self, pending: Tuple[dist.Work, torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        work, buffer = pending
        work.wait()
        self.waited += time.perf_counter() - start
        return buffer.to(self.device)

    def send_down(self, activation: torch.Tensor) -> None:
        self._send(activation, self.stage + 1, self.down[self.stage])

    def send_up(self, grad: torch.Tensor) -> None:
        self._send(grad, self.stage - 1, self.up[self.stage - 1])

    def _send(self, tensor: torch.Tensor, peer: int, group) -> None:
        tensor = tensor.detach().to(self.wire).contiguous()
        self.sends.append((dist.isend(tensor, peer, group=group), tensor))

    def finish_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


# ------------------------------------------------------------------------------- one stage
class Stage:
    """One pipeline stage: its layers, optimizer and GradManagers, and one training step
    under a schedule."""

    def __init__(self, model: nn.Sequential, stage: int, stages: int, links: Links,
                 args: argparse.Namespace, device: torch.device) -> None:
        self.module = stage_slice(model, stage, stages).to(device)
        self.stage, self.stages, self.links, self.args, self.device = (
            stage, stages, links, args, device)
        self.first, self.last = stage == 0, stage == stages - 1
        # one manager per micro-batch in flight: a micro-batch's recording runs from its
        # forward to its backward, and 1F1B runs up to stages - stage forwards before a backward
        in_flight = min(stages - stage, args.micro_batches)
        self.managers = [GradManager().attach(self.module.parameters())
                         for _ in range(in_flight)]
        self.opt = make_optimizer(self.module.parameters(), args)

    def train_step(self, ops: Sequence[Op],
                   batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
        """Run ``ops``, then the optimizer step; return the micro-batches' losses (last
        stage) or []."""
        micro, links = len(batches), self.links
        acts, grads = links.post_receives((self.args.batch, self.args.hidden), micro)
        recorded: Dict[int, tuple] = {}  # forward done, backward not yet: (gm, x, out)
        deferred = {}  # B done, W not yet: the DeferredBackward
        losses: List[torch.Tensor] = []
        for kind, m in ops:
            if kind == "F":
                gm = self.managers[m % len(self.managers)]
                gm.record()  # ended by this micro-batch's backward
                if self.first:
                    x = batches[m][0].to(self.device)
                else:
                    x = links.wait(acts[m])
                    gm.attach(x)  # the stage input: its gradient goes upstream
                out = self.module(x)
                if self.last:
                    out = loss_of(out, batches[m][1].to(self.device), micro)
                    losses.append(out.detach())
                else:
                    links.send_down(out)
                recorded[m] = (gm, x, out)
            elif kind == "W":
                deferred.pop(m).finish()  # the weights' gradients, accumulated into .grad
            else:
                gm, x, out = recorded.pop(m)
                dy = None if self.last else links.wait(grads[m])
                if kind == "BW":
                    gm.backward(out, dy)
                else:  # "B": x.grad now, the weights' gradients at this micro-batch's "W"
                    deferred[m] = gm.backward_split(out, dy, first=[] if self.first else [x])
                if not self.first:
                    links.send_up(x.grad)
        links.finish_sends()
        if recorded or deferred:
            raise RuntimeError(f"schedule left work undone: {sorted(recorded)} {sorted(deferred)}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return losses


def train_single_process(model: nn.Module, args: argparse.Namespace,
                         device: torch.device) -> Tuple[List[List[torch.Tensor]], nn.Module]:
    """The reference: the whole model in one process, plain ``loss.backward()`` per
    micro-batch (gradients accumulate in micro-batch order), one optimizer step per step."""
    model = copy.deepcopy(model).to(device)
    opt = make_optimizer(model.parameters(), args)
    losses = []
    for step in range(args.steps):
        batches = micro_batches(step, args)
        step_losses = []
        for x, y in batches:
            loss = loss_of(model(x.to(device)), y.to(device), len(batches))
            loss.backward()
            step_losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_losses)
    return losses, model


# ------------------------------------------------------------------------------- training
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def train(rank: int, world: int, args: argparse.Namespace, device: torch.device,
          via_host: bool) -> bool:
    stages, last = world, world - 1
    model = build_model(args)
    links = Links(rank, stages, device, via_host)
    names = list(SCHEDULES)
    orders = {name: [SCHEDULES[name](s, stages, args.micro_batches) for s in range(stages)]
              for name in names}
    units = {name: unit_cost_time(orders[name]) for name in names}  # also: no deadlock
    runners = {name: Stage(copy.deepcopy(model), rank, stages, links, args, device)
               for name in names}
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"MLP of {LAYERS} Linear layers ({args.inputs} -> {args.hidden} x "
              f"{LAYERS - 1} -> {args.outputs}, tanh), {params} parameters, cut into "
              f"{stages} stages of {LAYERS // stages} layers, one per process "
              f"({dist.get_backend()}{', via host memory' if via_host else ''}, {device.type}); "
              f"{args.micro_batches} micro-batches of {args.batch} per step; "
              f"{'AdamW' if args.optimizer == 'adamw' else 'SGD'} lr {args.lr:g}")
        print("schedules (F forward, BW whole backward, B input-gradient part, W weight part; "
              "the number is the micro-batch):")
        for name in names:
            for s, ops in enumerate(orders[name]):
                print(f"  {name if s == 0 else '':<12} stage {s}: {describe(ops)}")
        print("unit-cost model (F = B = W = 1, BW = 2, messages free): "
              + ", ".join(f"{name} {units[name]}" for name in names) + " units a step",
              flush=True)

    times: Dict[str, List[float]] = {name: [] for name in names}
    waits: Dict[str, List[float]] = {name: [] for name in names}
    losses: Dict[str, List[List[torch.Tensor]]] = {name: [] for name in names}
    for step in range(args.steps):
        batches = micro_batches(step, args)
        # alternate which schedule goes first, so neither always finds the caches warm
        for name in (names if step % 2 == 0 else names[::-1]):
            sync(device)
            links.waited = 0.0
            start = time.perf_counter()
            step_losses = runners[name].train_step(orders[name][rank], batches)
            sync(device)
            times[name].append(time.perf_counter() - start)
            waits[name].append(links.waited)
            losses[name].append(step_losses)

    # the reference, on every rank (each checks its own stage's parameters against it)
    ref_losses, ref_model = train_single_process(model, args, device)
    failures: List[str] = []

    def fail(what: str) -> None:
        if len(failures) < 10:
            failures.append(f"rank {rank}: {what}")

    for name in names:
        for step in range(args.steps if rank == last else 0):
            got = [loss.item() for loss in losses[name][step]]
            want = [loss.item() for loss in ref_losses[step]]
            if got != want:  # exact: float32 values compared as Python floats
                fail(f"{name} step {step}: micro-batch losses {got} != single-process {want}")
        stage_params = list(runners[name].module.parameters())
        ref_params = list(stage_slice(ref_model, rank, stages).parameters())
        if not all(torch.equal(a, b) for a, b in zip(stage_params, ref_params)):
            fail(f"{name}: final parameters of stage {rank} differ from single-process "
                 f"training's")

    mine = {
        "times": times, "waits": waits, "failures": failures,
        "losses": {name: [total(ls).item() for ls in losses[name]] if rank == last else []
                   for name in names},
        "reference": [total(ls).item() for ls in ref_losses],
    }
    every: List[dict] = [{} for _ in range(world)]
    dist.all_gather_object(every, mine)
    if rank == 0:
        report(every, names, args, stages)
    return not any(r["failures"] for r in every)


def report(every: List[dict], names: List[str], args: argparse.Namespace, stages: int) -> None:
    last = every[-1]
    times = every[0]["times"]  # the same steps on every rank, between barriers
    print(f"{'step':>4}  " + "  ".join(f"{name + ' loss':>16}" for name in names)
          + f"  {'single-process':>16}  " + "  ".join(f"{name + ' ms':>14}" for name in names))
    for step in range(args.steps):
        print(f"{step:4d}  " + "  ".join(f"{last['losses'][name][step]:16.9g}" for name in names)
              + f"  {last['reference'][step]:16.9g}  "
              + "  ".join(f"{times[name][step] * 1e3:14.2f}" for name in names), flush=True)
    median = {name: statistics.median(times[name]) for name in names}
    first, second = names
    print(f"median step time over {args.steps} steps: {first} {median[first] * 1e3:.2f} ms, "
          f"{second} {median[second] * 1e3:.2f} ms ({median[second] / median[first]:.2f}x)")
    for name in names:
        waited = ", ".join(f"stage {s} {statistics.median(every[s]['waits'][name]) * 1e3:.2f} ms"
                           for s in range(stages))
        print(f"median time a step waited for messages, {name}: {waited}")
    for result in every:
        for line in result["failures"]:
            print(f"ERROR {line}", flush=True)
    if not any(r["failures"] for r in every):
        for name in names:
            print(f"check {name} losses: every micro-batch's loss at all {args.steps} steps == "
                  f"single-process training's: matches")
        print("check final parameters: torch.equal to single-process training's on every "
              "stage, under both schedules: matches", flush=True)


def run(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank (= one stage); ``port`` 0 means torchrun set MASTER_ADDR / MASTER_PORT."""
    if world < 2 or LAYERS % world:
        if rank == 0:
            print(f"needs 2, 4 or 8 ranks (one stage each, {LAYERS} layers), not {world}",
                  file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    device, backend, via_host = torch.device("cpu"), "gloo", False
    if args.device == "cuda":
        if torch.cuda.device_count() >= world:  # a GPU per rank: NCCL
            device, backend = torch.device("cuda", rank), "nccl"
            torch.cuda.set_device(device)
        else:  # ranks share a GPU: NCCL refuses that, so gloo, through host memory
            device, via_host = torch.device("cuda", 0), True
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        ok = train(rank, world, args, device, via_host)
        dist.barrier()  # every rank done communicating before its group goes
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches per step (default 4)")
    parser.add_argument("--batch", type=int, default=256,
                        help="samples per micro-batch (default 256)")
    parser.add_argument("--hidden", type=int, default=512, help="width of the hidden layers")
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--outputs", type=int, default=8)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default 1e-3 for AdamW, 0.02 for SGD)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: NCCL with a GPU per rank, else gloo through host memory")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.micro_batches < 1 or args.batch < 1:
        parser.error("--steps, --micro-batches and --batch must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.02
    return args


def main(argv=None) -> int:
    return run_ranks(run, WORLD, parse(argv))  # torchrun's rank, or WORLD ranks started here


if __name__ == "__main__":
    sys.exit(main())
