"""Rank program part: a ``paddle.DataParallel`` next to ``data_parallel(model)`` in the places
the first check missed (a subclass with a forward of its own, a wrapper around a sublayer,
before and after ``data_parallel``), and ``gm.backward`` given one output twice; run inside
paddle_suite.py's spawn (no spawn of its own).

Each refused place runs two steps through the wrapper with a ``register_hook`` (x2) on
``0.weight`` (the hook that made Paddle's reducer fail the next forward, ``PreconditionNotMet``,
on the old code), keeps what each step raised and ``.grad`` after them, then puts the model
back and keeps the gradients of one step through it: rank 0's ``sgd`` step 0, ``0.weight``'s
doubled.
"""

from __future__ import annotations

import paddle

from . import paddle_suite as suite


class OwnForward(paddle.DataParallel):
    """A subclass whose forward does what ``paddle.DataParallel.forward`` does without calling
    it (a frame the first check did not look for)."""

    def forward(self, x):
        out = self._layers(x)
        if self.grad_need_sync and paddle.is_grad_enabled():
            self._reducer.prepare_for_backward(list(self._find_tensor(out)))
        return out


class Passing(paddle.DataParallel):
    """A subclass whose forward calls ``paddle.DataParallel``'s."""

    def forward(self, *inputs, **kwargs):
        return super().forward(*inputs, **kwargs)


def _step(gm, forward, rank: int, world: int, step: int = 0) -> None:
    with gm:
        gm.backward(suite.loss_of(forward, *suite.local(step, rank, world)))


def _subclass(model):
    return OwnForward(model), lambda: None


def _passing(model):
    return Passing(model), lambda: None


def _sublayer(model):
    wrapper = model[0] = paddle.DataParallel(model[0])

    def undo():
        # the wrapper stays alive: dropped, Paddle's reducer left hooked to 0.weight crashed
        # the next backward running that parameter's hook (a segfault, in Paddle 3.3.1)
        model[0] = wrapper._layers
    return model, undo


def _holder(model):
    return paddle.DataParallel(paddle.nn.Sequential(model)), lambda: None


AFTER = {"subclass_forward": _subclass, "subclass_super": _passing, "sublayer": _sublayer,
         "holder": _holder}


def wrapped_after(place: str, rank: int, world: int) -> dict:
    """``data_parallel(model)``, then the wrapper of ``place``; two steps through it, then
    the wrapper undone and one step through the model."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    gm = data_parallel(model)
    model[0].weight.register_hook(lambda grad: grad * 2)
    forward, undo = AFTER[place](model)
    out: dict = {"errors": [suite.error_of(lambda s=s: _step(gm, forward, rank, world, s))
                            for s in range(2)]}
    out["grads_after"] = suite.grads(model)
    model.clear_gradients(set_to_zero=False)
    undo()
    _step(gm, model, rank, world)
    out["grads"] = suite.grads(model)
    return out


def wrapped_before(rank: int, world: int) -> dict:
    """A wrapper built before ``data_parallel``: around a sublayer of the model given to it, a
    subclass given to it; a ``paddle.DataParallel(model)`` kept aside while the model itself
    is given (a step through the model, then one through the wrapper)."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    model[0] = paddle.DataParallel(model[0])
    out: dict = {"sublayer": suite.error_of(lambda: data_parallel(model)),
                 "subclass": suite.error_of(lambda: data_parallel(OwnForward(suite.net(rank))))}
    model = suite.net(rank)
    wrapper = paddle.DataParallel(model)
    gm = data_parallel(model)
    model[0].weight.register_hook(lambda grad: grad * 2)
    _step(gm, model, rank, world)
    out["aside_grads"] = suite.grads(model)
    model.clear_gradients(set_to_zero=False)
    out["aside_wrapper"] = suite.error_of(lambda: _step(gm, wrapper, rank, world))
    return out


def repeated_outputs(rank: int, world: int) -> dict:
    """``gm.backward([y, y], ...)`` and ``gm.backward([y, y[:]], ...)`` under
    ``data_parallel``: what each raised, ``.grad`` after them, then a whole step's gradients."""
    from gradmgr.distributed import data_parallel

    model = suite.net(rank)
    gm = data_parallel(model)
    x, y = suite.local(0, rank, world)

    def twice(pick) -> None:
        with gm:
            outs = pick(model(x))
            gm.backward(outs, [paddle.ones_like(o) for o in outs])
    out: dict = {"errors": [suite.error_of(lambda: twice(lambda o: [o, o])),
                            suite.error_of(lambda: twice(lambda o: [o, o[:]]))]}
    out["grads_after"] = suite.grads(model)
    _step(gm, model, rank, world)
    out["grads"] = suite.grads(model)
    return out


def run(rank: int, world: int) -> dict:
    out: dict = {place: wrapped_after(place, rank, world) for place in AFTER}
    out["before"] = wrapped_before(rank, world)
    out["repeated"] = repeated_outputs(rank, world)
    return out
