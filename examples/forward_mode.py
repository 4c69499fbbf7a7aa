"""Forward mode (a Jacobian-vector product) from two nested reverse passes.

For ``y = f(x)`` the vector-Jacobian product ``g(u) = J(x)^T u`` is linear in ``u``, so its own
vector-Jacobian product with ``v`` is ``d(g(u) . v)/du = J v``. With GradManagers:

    outer attaches u (a dummy cotangent, zeros)
    with outer:
        with inner:                   # inner attaches x
            inner.backward(f(x), u)   # x.grad = J^T u, recorded by the outer manager
        outer.backward(x.grad, v)     # u.grad = J v

Here ``f(x) = A @ sin(x) + x * x`` on R^3, whose Jacobian is ``A diag(cos x) + 2 diag(x)``.
The script checks ``u.grad`` against that analytic JVP (rtol 1e-5, atol 1e-6), builds the whole
Jacobian column by column the same way, and on PyTorch also compares with ``torch.func.jvp``.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
from cli import assert_close, run

from gradmgr import GradManager

A = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, -1.0], [3.0, 0.0, 1.0]], dtype=np.float32)
X0 = np.array([0.3, -0.7, 1.1], dtype=np.float32)
V = np.array([1.0, 0.5, -2.0], dtype=np.float32)


def analytic_jacobian(x: np.ndarray) -> np.ndarray:
    return A * np.cos(x)[None, :] + np.diag(2.0 * x)


def jvp_by_double_reverse(tensor, f, x0: np.ndarray, v: np.ndarray, numpy) -> np.ndarray:
    """``J(x0) v`` for ``f``, using only GradManagers (``tensor``/``numpy`` convert)."""
    x = tensor(x0)
    u = tensor(np.zeros(len(x0), dtype=np.float32))
    outer, inner = GradManager(), GradManager()
    with outer:
        outer.attach(u)
        with inner:
            inner.attach(x)
            inner.backward(f(x), u)
        outer.backward(x.grad, tensor(v))
    return numpy(u.grad)


def show(framework: str, tensor, f, numpy) -> np.ndarray:
    jv = jvp_by_double_reverse(tensor, f, X0, V, numpy)
    print(f"  J v by double reverse ({framework}): {np.array2string(jv, precision=6)}")
    assert_close("J v vs analytic", jv, analytic_jacobian(X0) @ V)
    eye = np.eye(3, dtype=np.float32)
    jacobian = np.stack([jvp_by_double_reverse(tensor, f, X0, e, numpy) for e in eye], axis=1)
    table = textwrap.indent(np.array2string(jacobian, precision=5), "    ")
    print(f"  Jacobian from three JVPs:\n{table}")
    assert_close("Jacobian vs analytic", jacobian, analytic_jacobian(X0))
    return jv


def run_torch() -> None:
    import torch

    a = torch.from_numpy(A)

    def f(x):
        return a @ torch.sin(x) + x * x

    jv = show("torch", torch.tensor, f, lambda t: t.detach().numpy())
    _, reference = torch.func.jvp(f, (torch.from_numpy(X0),), (torch.from_numpy(V),))
    assert_close("J v vs torch.func.jvp", jv, reference.numpy())


def run_megengine() -> None:
    from quiet_megengine import import_megengine

    megengine = import_megengine()  # without the CUDA banner of a GPU-less machine
    import megengine.functional as F

    a = megengine.tensor(A)

    def f(x):
        return F.matmul(a, F.sin(x)) + x * x

    show("megengine", megengine.tensor, f, lambda t: t.numpy())


if __name__ == "__main__":
    sys.exit(run(__doc__.splitlines()[0], {"torch": run_torch, "megengine": run_megengine}))
