"""Rank program part: habits of a Paddle training step, ``data_parallel(model)`` next to
``paddle.DataParallel`` on the same script in the same processes; run inside paddle_suite.py's
spawn (no spawn of its own).

Each habit trains :data:`STEPS` steps on each rank's own rows (ranks seeded differently: both
sides broadcast rank 0's weights) and keeps every step's gradients and parameters: a
``GradScaler`` with a batch that overflows on rank 1 alone, ``ClipGradByGlobalNorm`` with
weight decay (AdamW; Momentum with ``L2Decay``), BatchNorm with a layer frozen from the start
and an evaluation under ``paddle.no_grad()`` between steps, the model under
``paddle.jit.to_static``, two synced backwards accumulated per step, a gradient penalty
(``paddle.grad(..., create_graph=True)`` inside the recording), a registered buffer that the
forward updates. Where ``paddle.DataParallel`` is not the reference, the docstring says why.
"""

from __future__ import annotations

import contextlib
import warnings

import paddle

from . import paddle_suite as suite

STEPS = 3
COMPARED = ("scaler", "clip_adamw", "clip_momentum", "batchnorm", "to_static", "accumulate",
            "penalty", "buffer_kept")
# data_parallel's options where the habit is one: paddle.DataParallel broadcasts no buffer after
# its construction (measured), so each rank keeps its own, as with broadcast_buffers=False
OPTIONS = {"buffer_kept": {"broadcast_buffers": False}}


class BNNet(paddle.nn.Layer):
    """fc (6 -> 8), BatchNorm1D, tanh, out (8 -> 3), then ``frozen`` (3 -> 3), frozen from the
    start (``stop_gradient=True``); with ``counter``, ``seen``, a registered buffer the
    training forward adds its batch size times (rank + 1) to (each rank's own count)."""

    def __init__(self, rank: int, counter: bool) -> None:
        super().__init__()
        paddle.seed(rank)
        self.fc, self.bn = paddle.nn.Linear(6, 8), paddle.nn.BatchNorm1D(8)
        self.out, self.frozen = paddle.nn.Linear(8, 3), paddle.nn.Linear(3, 3)
        for p in self.frozen.parameters():
            p.stop_gradient = True
        if counter:
            self.register_buffer("seen", paddle.zeros([1]))
        self.rank, self.counter = rank, counter

    def forward(self, x):
        if self.counter and self.training:
            self.seen.set_value(self.seen + x.shape[0] * (self.rank + 1))
        return self.frozen(self.out(paddle.tanh(self.bn(self.fc(x)))))


def _scaler():
    """A ``GradScaler`` that runs: Paddle turns it off on a CPU ("AmpScaler can only be enabled
    on CUDAPlace..."), so its constructor is shown a GPU place; its kernels
    (``check_finite_and_unscale``, ``update_loss_scaling``) then run on the CPU."""
    import paddle.amp.grad_scaler as grad_scaler

    class _Place:
        def is_gpu_place(self) -> bool:
            return True

    real = grad_scaler._dygraph_tracer
    grad_scaler._dygraph_tracer = lambda: type("Tracer", (), {"_expected_place": _Place()})
    try:
        return paddle.amp.GradScaler(init_loss_scaling=1024.0, incr_every_n_steps=1)
    finally:
        grad_scaler._dygraph_tracer = real


@contextlib.contextmanager
def _autocast():
    """``paddle.amp.auto_cast()``, whose casts Paddle turns off on a CPU (a warning, kept
    quiet); the scaler scales only under it (in float32 Paddle turns the scaler off)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with paddle.amp.auto_cast():
            yield


def _optimizer(habit: str, model):
    params = model.parameters()
    clip = paddle.nn.ClipGradByGlobalNorm(0.05)
    if habit == "clip_adamw":
        return paddle.optimizer.AdamW(learning_rate=0.01, parameters=params, weight_decay=0.1,
                                      grad_clip=clip)
    if habit == "clip_momentum":
        return paddle.optimizer.Momentum(learning_rate=0.1, momentum=0.9, parameters=params,
                                         weight_decay=paddle.regularizer.L2Decay(0.01),
                                         grad_clip=clip)
    return suite.optimizer("sgd", model)


def _loss(habit: str, net, x, y):
    if habit != "penalty":
        return suite.loss_of(net, x, y)
    x.stop_gradient = False
    out = net(x)
    (gx,) = paddle.grad(out.sum(), x, create_graph=True)
    return ((out - y) ** 2).mean() + (gx ** 2).mean()


def _batch(habit: str, step: int, micro: int, rank: int, world: int):
    x, y = suite.local(step * 2 + micro if habit == "accumulate" else step, rank, world)
    if habit == "batchnorm":
        x = x * (rank + 1)  # the ranks' batch statistics differ
    if habit == "scaler" and step == 1 and rank == 1:
        x = paddle.concat([paddle.full([1, 6], float("inf")), x[1:]])  # overflows here only
    return x, y


def train(habit: str, rank: int, world: int, ours: bool, **options) -> dict:
    """The habit on gradmgr (``ours``, ``options`` to ``data_parallel``) or on
    ``paddle.DataParallel``: each step's gradients, parameters, evaluation outputs, buffers
    and loss scale."""
    from gradmgr.distributed import data_parallel

    model = (BNNet(rank, habit == "buffer_kept") if habit in ("batchnorm", "buffer_kept")
             else suite.net(rank))
    gm = data_parallel(model, **options) if ours else None
    static = paddle.jit.to_static(model, full_graph=True) if habit == "to_static" else model
    net = static if ours else paddle.DataParallel(static)  # (Paddle's: to_static inside it)
    opt, scaler = _optimizer(habit, model), _scaler() if habit == "scaler" else None
    out: dict = {"params": [], "grads": [], "evals": [], "buffers": [], "scale": []}
    for step in range(STEPS):
        for micro in range(2 if habit == "accumulate" else 1):
            x, y = _batch(habit, step, micro, rank, world)
            with contextlib.nullcontext() if gm is None else gm:
                with _autocast() if scaler is not None else contextlib.nullcontext():
                    loss = _loss(habit, net, x, y)
                    loss = loss if scaler is None else scaler.scale(loss)
                if gm is None:
                    loss.backward()
                else:
                    gm.backward(loss)
        out["grads"].append(suite.grads(model))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            out["scale"].append(float(scaler._scale))
        opt.clear_grad()
        out["params"].append(suite.values(model))
        out["buffers"].append([b.numpy().copy() for b in model.buffers()])
        if habit == "batchnorm":
            model.eval()
            with paddle.no_grad():
                out["evals"].append([net(suite.local(0, rank, world)[0]).numpy()])
            model.train()
    return out


def forgotten_under_to_static(rank: int, world: int) -> dict:
    """``with gm:`` forgotten under ``paddle.jit.to_static``: what ``loss.backward()`` raised,
    and ``.grad`` after it."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    gm = data_parallel(model)
    net = paddle.jit.to_static(model, full_graph=True)
    out: dict = {"error": None}
    try:
        suite.loss_of(net, *suite.local(0, rank, world)).backward()
    except Exception as e:  # noqa: BLE001 (what each rank raised is the result)
        out["error"] = f"{type(e).__name__}: {e}"
    out["grads"] = suite.grads(model)
    del gm  # (kept until here: a dropped manager watches nothing)
    return out


def float64_after(rank: int, world: int) -> dict:
    """``model.to(dtype="float64")`` on every rank after ``data_parallel(model)`` and a step:
    each later step's gradients, and the mean of the ranks' own float64 gradients
    (``paddle.grad``, gathered)."""
    import paddle.distributed as dist

    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    gm = data_parallel(model)
    out: dict = {"grads": [], "means": []}
    for step in range(2):
        if step == 1:
            model.to(dtype="float64")
        x, y = (t.astype("float64" if step else "float32") for t in suite.local(step, rank, world))
        means = []
        for g in paddle.grad(suite.loss_of(model, x, y), list(model.parameters())):
            both: list = []
            dist.all_gather(both, g)
            means.append(((both[0] + both[1]) / 2).numpy())
        with gm:
            gm.backward(suite.loss_of(model, x, y))
        out["grads"].append(suite.grads(model))
        out["means"].append(means)
        model.clear_gradients(set_to_zero=False)
    return out


def run(rank: int, world: int) -> dict:
    """Every habit, both sides; the buffer with data_parallel's default too; the forgotten
    ``with gm:`` under ``to_static``; a model cast to float64 after ``data_parallel``."""
    out = {habit: {"ours": train(habit, rank, world, True, **OPTIONS.get(habit, {})),
                   "paddle": train(habit, rank, world, False)} for habit in COMPARED}
    out["buffer_broadcast"] = train("buffer_kept", rank, world, True)
    out["forgotten_to_static"] = forgotten_under_to_static(rank, world)
    out["float64_after"] = float64_after(rank, world)
    return out
