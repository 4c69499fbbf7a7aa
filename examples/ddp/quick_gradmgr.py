"""The README's first example: a DDP loop (quick_ddp.py) and the same loop with gradmgr
(quick_gradmgr.py). Both print each rank's last loss and weights, the same to the bit:
    torchrun --nproc_per_node 2 examples/ddp/quick_ddp.py
"""
import torch
import torch.distributed as dist

from gradmgr.distributed import data_parallel

dist.init_process_group("gloo")  # "nccl" on GPUs
rank = dist.get_rank()
torch.manual_seed(rank)  # each rank its own data (and weights, until the broadcast)
model = torch.nn.Linear(4, 1)
gm = data_parallel(model)  # broadcasts rank 0's weights; the model stays unwrapped
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
for _ in range(5):
    with gm:  # record the step
        loss = torch.nn.functional.mse_loss(model(x), y)
        gm.backward(loss)  # .grad is now the mean over the ranks
    opt.step()
    opt.zero_grad()
print(f"rank {rank}: loss {loss.item()!r} weight {model.weight.tolist()}")
del gm  # before its process group goes
dist.barrier()  # every rank done communicating: torch 2.13's gloo may abort at exit
dist.destroy_process_group()
