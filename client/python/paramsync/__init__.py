"""paramsync: torch.distributed's collectives as gRPC calls to paramsyncd.

    import paramsync.distributed as dist
    dist.init_process_group("paramsync")
    dist.all_reduce(tensor)

`paramsync.distributed` follows torch.distributed's names and signatures;
`python3 -m paramsync.run --nproc N script.py` launches N workers (and a
daemon when none is given), like torchrun.
"""
__version__ = "0.1.0"
