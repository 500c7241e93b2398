"""Baton's benchmark harness (`baton bench offline | serve | kv`): B1 offline throughput with a
roofline, B2 online serving sweeps per topology, B3 KV-transfer microbenchmarks; one JSON
per run, with the device ceilings measured in the same run."""
