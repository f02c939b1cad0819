"""Performance models for allocation: a job's throughput as a function of its resources (docs/sched.md)."""
