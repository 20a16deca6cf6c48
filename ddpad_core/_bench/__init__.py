"""The benchmarks behind ``ddpad bench`` (a wing on top of the runtime: only
the CLI and ``benchmarks/`` import it): a trajectory whose atom count
changes (:mod:`.trajectory`), ddpad's own per-call cost (:mod:`.overhead`),
what the dead rows cost a steady step (:mod:`.steady`), first calls and
warm starts across processes (:mod:`.warmstart`), and the MD step inside the
engines against each engine's own model (:mod:`.engines`)."""
