"""``make gpu-check`` (``python -m train.bench.gpu [NAME ...|all]``): what only a GPU can show, on one GPU.

The checks are the rows of table.py:CHECKS; each prints one PASS/FAIL line and writes a JSON record under
``runs/gpu-check/``. Without a CUDA device it says so and exits 0 having run nothing; exit 1 when a check
fails, 2 for an unknown check. checks.py holds the checks; perf.py (the trainer measured in this process),
peer.py (neuraloperator's own Trainer on the same data), fsdp.py (FSDP2 against the plain model) and
ceiling.py (the FNO's bare step on random data) what they measure with.
"""
