"""ddpad's MD step inside an engine against the engine's own model wrapper.

``python benchmarks/engine_step.py {torchsim,ase,lammps} {one,batch} [--adapter mace] [--model NAME|PATH] [--blocks 8] [--steps 10] [--backend inductor] [--json FILE]``

One engine and system per run, for the benchmarks page; ``ddpad bench
ADAPTER --engines`` runs every engine in one table. What is measured and how
(the model, the systems, the baselines, the alternating blocks) is
:mod:`ddpad._bench.engines`. The model is the adapter's random model, MACE in
float64, SevenNet, Orb, MatterSim and AIMNet2 in float32 (SevenNet's and
MatterSim's only dtype, Orb's calculator's default, aimnet's default dtype),
or with ``--model`` a trained model the adapter's ``load_model`` takes
(sevennet: ``7net-0``, shipped in the sevenn wheel).
"""

from __future__ import annotations

import argparse
import json
import sys

ADAPTERS = ("mace", "sevennet", "orb", "mattersim", "aimnet2")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=("ase", "torchsim", "lammps"))
    parser.add_argument("kind", choices=("batch", "one"))
    parser.add_argument("--adapter", choices=ADAPTERS, default="mace")
    parser.add_argument("--model", help="a trained model (file, or a name load_model takes); default: random")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    import torch

    from ddpad._bench.engines import Unavailable, format_engines, measure
    from ddpad.adapters import get

    adapter = get(args.adapter)
    if args.model:
        model = adapter.tools.load_model(args.model, "cpu")
    else:
        model = adapter.tools.random_model(*((torch.float64,) if args.adapter == "mace" else ()))
    try:
        row = measure(args.engine, args.kind, adapter, model, blocks=args.blocks, steps=args.steps,
                      backend=args.backend)
    except Unavailable as exc:
        raise SystemExit(f"engine_step.py: {exc}") from exc
    if args.model:
        row["model"] = args.model
    print(f"{row['adapter']}{f' ({args.model})' if args.model else ''}, {row['threads']} thread(s); caps {row['caps']}, "
          f"{row['disagreements']} compiled graph(s) disagreeing with eager (run eager):")
    print(format_engines([row]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
