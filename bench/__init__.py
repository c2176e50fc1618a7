"""Benchmarks (not tests): each measures Tether's path and a bare baseline in the same run."""
