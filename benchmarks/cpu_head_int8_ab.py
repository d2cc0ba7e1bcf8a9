"""The default workload on two engines of the default model that differ only in the output head's
x: float32 in one, 8-bit blocks in the other (the rest of the arithmetic as the engine's defaults
have it), alternated in one process so the machine's drift falls on both alike.

    python benchmarks/cpu_head_int8_ab.py [--rounds 4]

The rounds are cpu_engine_ab.py's: a warm-up workload on each engine, then the default workload's
shape with seed 100, 101, ... (a new one each round, the same for both engines), the order of the
engines reversed every other round.
"""

from __future__ import annotations

import argparse

from cpu_engine_ab import workloads  # beside this script

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.models.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    engines = {name: LLMEngine(EngineConfig(model=str(default_model_path())))
               for name in ("head float32 x", "head 8-bit x")}
    engines["head float32 x"].runner.worker.model.packed_lm_head.int8_rows = 0
    print({name: (engine.arithmetic, engine.runner.worker.model.packed_lm_head.int8_rows)
           for name, engine in engines.items()})
    workloads(engines, args.rounds)


if __name__ == "__main__":
    main()
