"""Baton's benchmark harness (`baton bench`; its verbs: `cli.BENCHMARKS`): B1 offline throughput
with a roofline, B2 online serving sweeps per topology, B3 KV-transfer microbenchmarks, and the
router's relay rate; one JSON per run, with the device ceilings measured in the same run."""
