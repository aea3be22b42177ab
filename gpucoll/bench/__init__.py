"""gpucoll-bench: nccl-tests' benchmark-and-check harness for gpucoll (``gpucoll-bench all_reduce --nranks 4``,
``python -m gpucoll.bench all_reduce``). cli.py parses, harness.py measures and checks, report.py prints,
colls/ holds one small file per collective."""
