"""The benchmarks behind ``ddpad bench`` (a wing on top of the runtime: only
the CLI and ``benchmarks/`` import it): a trajectory whose atom count
changes (:mod:`.trajectory`), ddpad's own per-call cost (:mod:`.overhead`),
what the dead rows cost a steady step (:mod:`.steady`), and first calls and
warm starts across processes (:mod:`.warmstart`)."""
