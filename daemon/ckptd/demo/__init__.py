"""`ckptd demo` and what it needs, kept out of the daemon package: the demo itself (main), its
tiny character-level language model (charlm), and the launcher that starts `ckptd serve` as a
child process and waits until it is healthy (process; the tests and benchmarks use it too)."""
