"""The habits of the habit harness (issue 25), in the order of the docs table: each is the
documented training script of habit_sides.py with one habit a DDP or ZeroRedundancyOptimizer
user brings typed in, as a function ``name(kind, rank, world) -> dict`` (habits_model.py,
habits_optim.py, habits_wrong.py) run once on DDP (``kind`` "ddp") and once per gradmgr path
it applies to. What it returns (losses, norms, parameters, buffers) is compared bit for bit.

``ddp=False``: DDP itself is silently wrong (or hangs) with this habit, so it is not run;
gradmgr must raise. Full sharding's reference is FSDP2 alone (habit_sides.py's "fsdp2"), run
where ``fsdp2`` says (by default where DDP's is; False where FSDP2 has no counterpart, True
where plain FSDP2 is what the habit types). ``accept``: an exception that is not gradmgr's
but counts as clear, ``(type name, text it contains)``. ``alone``: only that rank runs the
habit's call (``if rank == 0: ...``), so only it must raise, and the others go on. ``ahead``:
the rank with a step more than the others (one skipped a batch): only it can find out, so
only it must raise, and the others end their loop; its error says to start a new process
group, which the harness does after the case. ``risky``: may hang or crash a rank on today's
code, so it runs after the others; ``teardown``: destroys its process group, so it runs last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from . import habits_model, habits_optim, habits_wrong
from .habit_sides import PATHS

ALL, ZERO = PATHS, ("sharded",)
NOT_FULL = PATHS[:3]  # not run under full sharding: docs/switching-from-ddp.md says why


@dataclass(frozen=True)
class Habit:
    name: str  # its function's name
    title: str  # its row in docs/switching-from-ddp.md
    paths: Tuple[str, ...] = ALL
    ddp: bool = True
    accept: Optional[Tuple[str, str]] = None
    risky: bool = False
    alone: Optional[int] = None  # only this rank makes the call: its clear error suffices
    ahead: Optional[int] = None  # only this rank takes a step more: its clear error suffices
    teardown: bool = False
    fsdp2: Optional[bool] = None  # full sharding's reference runs (None: where DDP's does)

    def reference(self, path: str) -> bool:
        """Whether the case ``habit:path`` has a reference side."""
        if path == "full" and self.fsdp2 is not None:
            return self.fsdp2
        return self.ddp

    @property
    def fn(self) -> Callable:
        for module in (habits_model, habits_optim, habits_wrong):
            if hasattr(module, self.name):
                return getattr(module, self.name)
        raise LookupError(f"no habit function {self.name!r}")


HABITS = [
    Habit("documented",
          'none: the documented script'),
    Habit("module_attribute",
          '`model.module.state_dict()` for the checkpoint',
          accept=("AttributeError", "'module'"), fsdp2=False),
    Habit("train_eval_switch",
          '`model.eval()`, a validation forward under `no_grad`, `model.train()`, between steps'),
    Habit("eval_after_training",
          'evaluation after training: `model.eval()`, a validation pass (item 6)'),
    Habit("no_grad_in_train_mode",
          'a forward under `torch.no_grad()` between steps, in train mode'),
    Habit("broadcast_buffers_false",
          '`broadcast_buffers=False`'),
    Habit("zero_grad_keep",
          '`opt.zero_grad(set_to_none=False)`'),
    Habit("zero_grad_keep_unused",
          '`opt.zero_grad(set_to_none=False)`, a layer used at the first step only'),
    Habit("model_zero_grad",
          '`model.zero_grad()` instead of `opt.zero_grad()`'),
    Habit("adam",
          '`torch.optim.Adam` instead of SGD'),
    Habit("lr_scheduler",
          '`StepLR(opt, 1)` over the optimizer'),
    Habit("adam_groups",
          "Adam over parameter groups with their own `lr`, `weight_decay` and `betas`"),
    Habit("plateau",
          "`ReduceLROnPlateau(opt)` stepped with a validation metric"),
    Habit("one_cycle",
          "`OneCycleLR` over Adam (it cycles `betas` too)"),
    Habit("closure_step",
          "`loss = opt.step(closure)`, the closure running the forward and backward"),
    Habit("ema_model",
          "an EMA of the model (`AveragedModel`) updated after each step",
          accept=("AssertionError", "FSDP does not support deepcopy"), fsdp2=False),
    Habit("adafactor",
          "torch's `Adafactor` (not elementwise)", paths=NOT_FULL),
    Habit("clip_torch",
          "torch's `clip_grad_norm_(model.parameters(), ...)` (item 5)"),
    Habit("grad_div_",
          "manual averaging after `no_sync` accumulation: `p.grad.div_(n)`"),
    Habit("grad_itruediv",
          "the same written `p.grad /= n` (`n` a 0-dim tensor)"),
    Habit("clip_value",
          "torch's `clip_grad_value_(model.parameters(), ...)`, `foreach=True` too"),
    Habit("dp_noise",
          "DP-SGD's noise: `p.grad.add_(noise)`, the same noise on every rank"),
    Habit("nan_to_num",
          "`p.grad.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0)`"),
    Habit("clamp_min_max",
          "`p.grad.clamp_min_(-v).clamp_max_(v)`", paths=NOT_FULL),
    Habit("grad_metadata",
          "memory accounting and logging: `.grad`'s `numel() * element_size()`, shape, "
          "dtype, strides after the backward"),
    Habit("grad_scaler",
          '`torch.amp.GradScaler("cpu")`: `scale`, `unscale_`, clip, `step`, `update`'),
    Habit("cuda_grad_scaler",
          '`torch.cuda.amp.GradScaler()` on a machine without CUDA'),
    Habit("autocast_bf16",
          'the forward under `torch.autocast("cpu", dtype=torch.bfloat16)`'),
    Habit("parameter_hook",
          '`register_hook` on a parameter'),
    Habit("freeze_mid_training",
          '`requires_grad_(False)` on a layer after a step, every rank'),
    Habit("unused_layer",
          'a layer the forward never uses'),
    Habit("accumulate_no_sync",
          'gradient accumulation under `no_sync`'),
    Habit("custom_function_none_all",
          'a custom `autograd.Function` returning `None` for a weight (item 4)',
          paths=NOT_FULL),
    Habit("tied_weight",
          'a layer used twice in the forward (tied weights)'),
    Habit("shared_parameter",
          'a parameter shared by two layers (`head.weight = fc2.weight`)', fsdp2=False),
    Habit("freeze_before_wrapping",
          '`requires_grad_(False)` on a layer before wrapping'),
    Habit("deepcopy_model",
          '`copy.deepcopy(model)` after training (an EMA or evaluation copy)',
          accept=("AssertionError", "FSDP does not support deepcopy"), fsdp2=False),
    Habit("checkpointed",
          'activation checkpointing, `use_reentrant=False`'),
    Habit("two_forwards",
          'two forwards, one backward of the summed losses (`broadcast_buffers=False`)'),
    Habit("split_1f1b",
          "a pipeline stage's `backward_split` in 1F1B order inside `no_sync` accumulation "
          "(both micro-batches' input halves, then both weight halves)"),
    Habit("gradient_penalty",
          "a gradient penalty (WGAN-GP): an inner manager's backward inside `with gm:` "
          "(`broadcast_buffers=False`)", fsdp2=False),
    Habit("zero_checkpoint",
          "ZeRO's checkpoint: `opt.consolidate_state_dict(to=0)`, then rank 0's `state_dict()`",
          paths=ZERO, risky=True),
    Habit("skip_failed_batch",
          "a rank's batch fails inside the step; every rank catches it and skips the batch",
          paths=NOT_FULL),
    Habit("forward_outside_with",
          'the forward before `with gm:`, only the backward inside'),
    Habit("autograd_grad_outside",
          '`torch.autograd.grad` outside `with gm:` (a saliency map, gradient norms)',
          paths=NOT_FULL),
    Habit("backward_inside_with",
          '`loss.backward()` inside `with gm:`, every rank'),
    Habit("second_data_parallel",
          'a second `data_parallel(model)` on the same model, the first manager kept',
          ddp=False),
    Habit("backward_inside_with_single",
          '`loss.backward()` inside `with gm:`, one process (item 3)',
          paths=("single",)),
    Habit("ddp_then_data_parallel",
          '`net = DDP(model)` kept, then `data_parallel(net)` (item 1)',
          ddp=False),
    Habit("data_parallel_then_ddp",
          '`data_parallel(model)`, then `net = DDP(model)` (item 1)',
          ddp=False, paths=NOT_FULL),
    Habit("forgotten_with",
          '`with gm:` forgotten: a plain `loss.backward()` (item 2)',
          ddp=False, fsdp2=True),
    Habit("double_after_wrap",
          '`model.double()` after wrapping (item 8)',
          paths=NOT_FULL),
    Habit("model_checkpoint_rank0",
          '`if rank == 0: torch.save(model.state_dict(), path)` after every step'),
    Habit("sharded_groups_differ",
          'ranks give `ShardedOptimizer` different groups (item 5)',
          paths=ZERO, ddp=False),
    Habit("checkpoint_rank0",
          '`if rank == 0: torch.save(opt.state_dict(), path)` (item 5)',
          risky=True, alone=0),
    Habit("custom_function_none_one",
          'a custom `autograd.Function` returning `None` for a weight on one rank (item 4)',
          risky=True, paths=NOT_FULL),
    Habit("no_sync_on_rank0_only",
          'only rank 0 wraps a micro-batch in `no_sync` (item 7)',
          ddp=False, risky=True),
    Habit("rank_skips_silently",
          'one rank skips a batch before its forward (`continue`)',
          ddp=False, risky=True, ahead=0),
    Habit("rank_skips_in_join",
          'the same, inside `with Join([gm]):` (DDP: `with Join([model]):`; sharded: '
          '`Join([gm, opt])`)', fsdp2=False),
    Habit("destroy_then_del",
          '`dist.destroy_process_group()`, then `del gm` (item 9)',
          teardown=True),
]
BY_NAME = {h.name: h for h in HABITS}
