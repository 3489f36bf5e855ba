"""python -m train.bench.gpu [NAME ...|all] (make gpu-check GPU_CHECKS=...): the rows of table.py:CHECKS on
one GPU, a PASS/FAIL line and runs/gpu-check/NAME.json each."""

from __future__ import annotations

import json
import sys
import time

from train.bench.gpu import checks
from train.bench.gpu.table import BY_NAME, CHECKS, DEFAULT


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was run")
        return 0
    names = [row.name for row in CHECKS] if argv == ["all"] else argv or list(DEFAULT)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"gpu-check: unknown check(s) {', '.join(unknown)}; the checks: {', '.join(BY_NAME)}")
        return 2
    checks.OUT.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    print(f"gpu-check on {device}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    failed = []
    for name in names:
        start = time.perf_counter()
        try:
            record = getattr(checks, BY_NAME[name].check)()
        except Exception as e:  # one check's crash is its FAIL line, not the end of the others
            record = {"passed": False, "error": f"{type(e).__name__}: {e}"}
        record.update(check=name, device=device, seconds=round(time.perf_counter() - start, 1))
        (checks.OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
        shown = {k: v for k, v in record.items() if k not in ("tail", "check", "device", "passed")}
        print(f"{'PASS' if record['passed'] else 'FAIL'} {name}: {json.dumps(shown)[:1500]}", flush=True)
        if not record["passed"]:
            failed.append(name)
    print(f"gpu-check: {len(names) - len(failed)}/{len(names)} passed; records in {checks.OUT}/", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
