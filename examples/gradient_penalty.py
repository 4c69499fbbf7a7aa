"""WGAN-GP style gradient penalty: second derivatives through nested GradManagers.

The critic's loss contains the norm of the critic's gradient with respect to its input at points
``x_hat`` between real and fake samples. Each step:

    with outer:                                  # outer attaches the critic's parameters
        with inner:                              # inner attaches x_hat
            inner.backward(critic(x_hat).sum())  # x_hat.grad = dD/dx, recorded by outer
        penalty = ((|x_hat.grad| - 1) ** 2).mean()
        outer.backward(critic(fake).mean() - critic(real).mean() + LAMBDA * penalty)

The script checks the first step's parameter gradients against the framework's own
second-order machinery (PyTorch: ``torch.autograd.grad(create_graph=True)``; MegEngine: its
native nested ``GradManager``), rtol 1e-4, atol 1e-6, then trains the critic for a few steps and
checks that the penalty pulled the input-gradient norm towards 1.
"""

from __future__ import annotations

import sys
from typing import Dict, List

import numpy as np
from cli import assert_close, expect, run

from gradmgr import GradManager

LAMBDA = 10.0
STEPS = 60
LR = 0.01
HIDDEN = 32


def make_problem(seed: int = 0) -> Dict[str, np.ndarray]:
    """Critic weights and per-step batches of real, fake and interpolation weights."""
    rng = np.random.default_rng(seed)
    angles = rng.uniform(0, 2 * np.pi, size=(STEPS, 64))
    real = np.stack([np.cos(angles), np.sin(angles)], axis=-1) * 2.0  # a ring of radius 2
    fake = rng.normal(0.0, 0.5, size=(STEPS, 64, 2))
    eps = rng.uniform(0.0, 1.0, size=(STEPS, 64, 1))
    sizes = [(2, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 1)]
    weights = {}
    for i, (fan_in, fan_out) in enumerate(sizes):
        weights[f"w{i}"] = rng.normal(0.0, 1.5 / np.sqrt(fan_in), size=(fan_in, fan_out))
        weights[f"b{i}"] = np.zeros(fan_out)
    problem = {k: v.astype(np.float32) for k, v in weights.items()}
    problem.update(real=real.astype(np.float32), fake=fake.astype(np.float32),
                   eps=eps.astype(np.float32))
    return problem


def critic(ops, params: List, x):
    """A tanh MLP (tanh so the second derivative is not piecewise zero)."""
    w0, b0, w1, b1, w2, b2 = params
    h = ops.tanh(ops.matmul(x, w0) + b0)
    h = ops.tanh(ops.matmul(h, w1) + b1)
    return ops.matmul(h, w2) + b2


def gp_step(ops, params: List, outer: GradManager, real, fake, eps):
    """One critic step's gradients into ``p.grad``; returns (loss, mean input-grad norm)."""
    x_hat = eps * real + (1 - eps) * fake
    inner = GradManager()
    with outer:
        with inner:
            inner.attach(x_hat)
            inner.backward(critic(ops, params, x_hat).sum())
        norm = ops.sqrt((x_hat.grad * x_hat.grad).sum(axis=1))
        penalty = ((norm - 1.0) ** 2).mean()
        wasserstein = critic(ops, params, fake).mean() - critic(ops, params, real).mean()
        loss = wasserstein + LAMBDA * penalty
        outer.backward(loss)
    return float(ops.numpy(loss)), float(ops.numpy(norm).mean())


def train(ops, reference_grads) -> None:
    """Check step 0 against ``reference_grads(params, real, fake, eps)``, then train."""
    problem = make_problem()
    names = ["w0", "b0", "w1", "b1", "w2", "b2"]
    params = [ops.parameter(problem[n]) for n in names]
    outer = GradManager().attach(params)
    norms = []
    for step in range(STEPS):
        batch = [ops.tensor(problem[k][step]) for k in ("real", "fake", "eps")]
        if step == 0:
            want = reference_grads(params, *batch)
        loss, norm = gp_step(ops, params, outer, *batch)
        norms.append(norm)
        if step == 0:
            for name, p, ref in zip(names, params, want):
                assert_close(f"step-0 d loss/d {name}", ops.numpy(p.grad), ref, rtol=1e-4)
        if step % 20 == 0 or step == STEPS - 1:
            print(f"  step {step:3d}: critic loss {loss:9.4f}   mean |dD/dx_hat| {norm:.4f}")
        ops.sgd(params, LR)
    first, last = abs(norms[0] - 1.0), abs(np.mean(norms[-10:]) - 1.0)
    print(f"  | |dD/dx_hat| - 1 |: {first:.3f} at the start -> {last:.3f} over the last 10 steps")
    expect(last < 0.5 * first, "the gradient penalty did not pull the input-gradient norm to 1")


def run_torch() -> None:
    from types import SimpleNamespace

    import torch

    def sgd(params, lr):
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad = None

    ops = SimpleNamespace(
        tensor=torch.from_numpy, parameter=lambda a: torch.nn.Parameter(torch.from_numpy(a)),
        numpy=lambda t: t.detach().numpy(), matmul=torch.matmul, tanh=torch.tanh,
        sqrt=torch.sqrt, sgd=sgd,
    )

    def reference(params, real, fake, eps):
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (dx,) = torch.autograd.grad(critic(ops, leaves, x_hat).sum(), x_hat, create_graph=True)
        penalty = ((torch.sqrt((dx * dx).sum(dim=1)) - 1.0) ** 2).mean()
        loss = critic(ops, leaves, fake).mean() - critic(ops, leaves, real).mean()
        grads = torch.autograd.grad(loss + LAMBDA * penalty, leaves)
        return [g.numpy() for g in grads]

    train(ops, reference)


def run_megengine() -> None:
    from types import SimpleNamespace

    from quiet_megengine import import_megengine

    megengine = import_megengine()  # without the CUDA banner of a GPU-less machine
    import megengine.functional as F
    from megengine.autodiff import GradManager as NativeGradManager

    def sgd(params, lr):
        for p in params:
            p._reset(p - lr * p.grad)
            p.grad = None

    ops = SimpleNamespace(
        tensor=megengine.tensor, parameter=megengine.Parameter, numpy=lambda t: t.numpy(),
        matmul=F.matmul, tanh=F.tanh, sqrt=F.sqrt, sgd=sgd,
    )

    def reference(params, real, fake, eps):
        leaves = [megengine.Parameter(p.numpy()) for p in params]
        x_hat = eps * real + (1 - eps) * fake
        outer, inner = NativeGradManager().attach(leaves), NativeGradManager()
        with outer:
            with inner:
                inner.attach(x_hat)
                inner.backward(critic(ops, leaves, x_hat).sum())
            norm = F.sqrt((x_hat.grad * x_hat.grad).sum(axis=1))
            penalty = ((norm - 1.0) ** 2).mean()
            loss = critic(ops, leaves, fake).mean() - critic(ops, leaves, real).mean()
            outer.backward(loss + LAMBDA * penalty)
        return [p.grad.numpy() for p in leaves]

    train(ops, reference)


if __name__ == "__main__":
    sys.exit(run(__doc__.splitlines()[0], {"torch": run_torch, "megengine": run_megengine}))
