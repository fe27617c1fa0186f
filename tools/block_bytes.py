"""What a GGUF model's linears hold and read once built: the bytes a decode step's linears
read (at 1 and 8 rows, as `stopline bench floors` counts them), the block bytes kept, whether a
lone decode runs as one row, and the process's memory.

    PYTHONPATH=. python tools/block_bytes.py MODEL.gguf exact|fast
"""

from __future__ import annotations

import gc
import resource
import sys
from pathlib import Path

import psutil

from stopline import LLM
from stopline.bench.floors import _weight_bytes
from stopline.model.loaders.loader import load_model


def main() -> None:
    path, mode = Path(sys.argv[1]), sys.argv[2]
    loaded = load_model(path, progress=False)
    llm = LLM(model=loaded, progress=False, num_blocks=64, block_size=16, numerics=mode)
    model = llm.engine.model
    model.calibrate()
    lins = [model.lm_head, *(v for layer in model.layers for v in layer.values() if hasattr(v, "fast"))]
    kept = sum((lin.quant.packed.numel() if lin.quant is not None else 0)
               + (lin.fast.packed.numel() if lin.fast is not None else 0) for lin in lins)
    del loaded
    gc.collect()
    mib = 2 ** 20
    print(f"{mode}: read/step 1 row {_weight_bytes(model, 1) / mib:.1f} MiB, 8 rows "
          f"{_weight_bytes(model, 8) / mib:.1f} MiB; packed blocks held {kept / mib:.1f} MiB; "
          f"one_row_ok {model.one_row_ok}; rss {psutil.Process().memory_info().rss / mib:.0f} MiB, "
          f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
