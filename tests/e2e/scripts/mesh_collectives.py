"""Four ranks as a 2×2 mesh (pp × dp), each step one all-reduce in its dp group then one in its pp
group, under `stalwart run` with a Flight Recorder dumper per rank. --stuck-rank R stops entering
collectives before its dp all-reduce of --at-step (it spins in Python, as a stuck data loader would);
--desync-rank R calls a broadcast where the others all-reduce (gloo then hangs: a desync; a size
mismatch would abort the receiving process instead)."""

import argparse
import time

import torch
import torch.distributed as dist

from stalwart import report
from stalwart.observe.flight import start_for_worker

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--at-step", type=int, default=4)
parser.add_argument("--stuck-rank", type=int, default=-1)
parser.add_argument("--desync-rank", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
pp, dp = divmod(rank, 2)
dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
dp_group, pp_group = dp_groups[pp], pp_groups[dp]
start_for_worker({"dp": dp_group, "pp": pp_group}, {"dp": dp, "pp": pp})

x = torch.ones(8)
for step in range(1, args.steps + 1):
    if rank == args.stuck_rank and step == args.at_step:
        while True:  # never enters dp collective #at_step
            sum(range(1000))
    if rank == args.desync_rank and step == args.at_step:
        dist.broadcast(x, src=dist.get_process_group_ranks(dp_group)[0], group=dp_group)
    else:
        dist.all_reduce(x, group=dp_group)
    dist.all_reduce(x[:4], group=pp_group)
    x /= 4
    report(step)
    time.sleep(0.05)
