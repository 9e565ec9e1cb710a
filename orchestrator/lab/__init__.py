"""The local lab: simulated hosts on loopback for tests, demos and benchmarks."""
