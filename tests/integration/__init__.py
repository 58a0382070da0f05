"""Integration tests: real ``kvtier serve`` processes, clients in and out of process."""
