"""PyTorch backend: GradManager semantics on top of PyTorch's autograd engine.

How the contract maps onto autograd:

* ``backward`` runs the engine with ``inputs=<attached tensors>`` (see :mod:`.engine`), so it
  only computes what attached tensors need and never touches ``.grad`` of anything else.
  Without callbacks or nesting the engine accumulates into ``.grad`` itself, like
  ``loss.backward()``; otherwise it returns the gradients (``None`` for unreached tensors, whose
  ``.grad`` stays ``None``) and the manager delivers them.
* A tensor with callbacks gets one tensor hook for the manager's whole life (not one per step):
  autograd fires it the moment that tensor's gradient is ready, and the hook feeds the callback
  chain while the engine goes on with earlier layers. Tensors without callbacks get no hook; their
  gradients are taken from the engine's result.
* Attaching a leaf with ``requires_grad=False`` (an input) turns the flag on while recording and
  restores it when the last manager recording it releases (:mod:`.flags`).
* Nesting: the backward is recorded (``create_graph``) only while a manager that started
  recording earlier is still recording; the graph is kept (``retain_graph``) while any other
  manager is recording.

What PyTorch cannot do exactly (see README "PyTorch notes"): autograd records operations on a
``requires_grad`` tensor whether or not a manager is recording, so gradient can flow through
operations done before ``record()`` (or before a mid-recording ``attach``). The backend detects
this from node sequence numbers and warns (:mod:`.prerecord`).

The modules: :mod:`.backend` (:class:`TorchBackend`, what the core talks to), :mod:`.tape`
(:class:`TorchTape`), :mod:`.foreign` (``loss.backward()`` inside a recording), :mod:`.engine`
(entering the engine), :mod:`.graph` (graph walks), :mod:`.flags` (requires_grad and
grad-mode bookkeeping), :mod:`.prerecord` (the pre-record check), :mod:`.grads` (writing
``.grad``), :mod:`.split` (split backward) and :mod:`.split_plan` (its plan); for data parallelism
:mod:`.ops` (bucket buffers), :mod:`.transport` (torch.distributed) and :mod:`.reducer` (torch's
C++ ``Reducer``, DDP's).
"""

from __future__ import annotations

from .backend import TorchBackend
from .graph import reachable_leaves
from .prerecord import PreRecordGradientWarning, set_pre_record_check
from .tape import TorchTape
from .transport import TorchTransport

__all__ = [
    "PreRecordGradientWarning",
    "TorchBackend",
    "TorchTape",
    "TorchTransport",
    "reachable_leaves",
    "set_pre_record_check",
]
